"""Peer bootstrap (``reshard.refit.bootstrap``) over real gloo processes, one per rank:
a new TP2 replica filled from two live replicas of other layouts (TP2 rows split, TP1
whole), without a trainer; refused on every rank, before a byte moves, when the peers
hold different versions (then filled at the second try); and a peer SIGKILLed
mid-bootstrap: every survivor fails cleanly, the new replica holds nothing of it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_bootstrap_jobs.py")
MODEL_BYTES = (64 * 48 + 48 * 64 + 64) * 2  # _bootstrap_jobs: bf16
RANKS = [("peer", 0, 2), ("peer", 1, 1), ("new", None, 2)]  # (role, peer, tp)


def _run(tmp: Path, ports: list[int], versions: dict[int, str], die: tuple[int, int] | None = None
         ) -> dict[tuple[str, int | None, int], list]:
    procs = {}
    for role, peer, tp in RANKS:
        for rank in range(tp):
            args = [sys.executable, str(SCRIPT), role, ",".join(map(str, ports)), str(tmp),
                    "--tp", str(tp), "--rank", str(rank)]
            if role == "peer":
                args += ["--peer", str(peer), "--versions", versions[peer]]
            if die == (peer, rank):
                args.append("--die")
            procs[(role, peer, rank)] = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for key, p in procs.items():
            out, _ = p.communicate(timeout=120)
            assert p.returncode == (-9 if key[1:] == die else 0), (key, out[-3000:])
    finally:
        for p in procs.values():
            p.kill()
    logs = {}
    for role, peer, rank in procs:
        path = tmp / f"{role}-{peer if role == 'peer' else 'x'}-{rank}.json"
        logs[(role, peer, rank)] = json.loads(path.read_text()) if path.exists() else []
    return logs


def test_new_replica_filled_from_two_peers_after_a_refusal(tmp_path):
    # first meeting: peer 0 lends version 2, peer 1 version 3; then both version 3
    logs = _run(tmp_path, [free_port(), free_port()], {0: "2,3", 1: "3,3"})
    peers = {k: v for k, v in logs.items() if k[0] == "peer"}
    for key, log in logs.items():
        assert log[0]["error"] == "PlanError", (key, log)
        assert "the peers hold different versions [2, 3]" in log[0]["message"], log
    assert all(logs[("new", None, r)][0]["zero"] for r in range(2))
    got = [logs[("new", None, r)][1] for r in range(2)]
    assert all(g["exact"] and g["version"] == g["receiver_version"] == 3 for g in got), got
    sent = {k: v[1]["sent"] for k, v in peers.items()}
    assert all(v[1]["unchanged"] for v in peers.values())
    # every byte the new replica received came from a peer, each of its ranks its shard
    # (w1 and w2 column halves, b whole), spread over both peers
    received = [g["received"] for g in got]
    assert received == [(64 * 24 + 48 * 32 + 64) * 2] * 2, received
    assert sum(sent.values()) == sum(received)
    by_peer = [sum(v for k, v in sent.items() if k[1] == p) for p in (0, 1)]
    assert min(by_peer) >= 0.3 * sum(by_peer), by_peer
    print(f"bootstrap: bytes from peer 0 / peer 1: {by_peer} of {sum(received)}")


def test_peer_lost_mid_bootstrap_fails_every_survivor_cleanly(tmp_path):
    logs = _run(tmp_path, [free_port()], {0: "4", 1: "4"}, die=(0, 1))
    assert logs[("peer", 0, 1)] == []  # killed before writing
    survivors = {k: v for k, v in logs.items() if k != ("peer", 0, 1)}
    for key, log in survivors.items():
        assert log[0]["error"] == "TransferError", (key, log)
        assert log[0]["seconds"] < 30, log  # well before the refit deadline
    for r in range(2):  # never torn: nothing of the failed bootstrap is live
        assert logs[("new", None, r)][0]["zero"], logs[("new", None, r)]
    seconds = max(v[0]["seconds"] for k, v in survivors.items() if k[0] == "new")
    print(f"peer lost mid-bootstrap: the new replica's error within {seconds:.2f} s")
