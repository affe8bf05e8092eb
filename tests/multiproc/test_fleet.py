"""A fleet of replicas fed by relays (``reshard.fanout``) through the elastic group, and a
relay lost mid-refit.

Every rank in its own fast domain (``RESHARD_DOMAIN_SIZE=1``, the same on every rank),
so every replica rank is reached over "the network": a 2-rank trainer refits replicas A
and B (TP2, bf16) and C and D (TP1, fp32). The schedule relays: the trainer sends one
copy per replica layout (bf16 + fp32), not one per replica, and the replicas forward
the rest from their received, uncommitted shadows (each layout's chain in the order the
replicas asked to join: D asks after C). C SIGKILLs itself in the middle of refit 2,
while it relays to D: every survivor fails that refit with a TransferError and
keeps version 1 bit for bit; at refit 3 the elastic coordinator drops C; refits 3 and 4
reach A, B and D bit for bit (D, alone of its layout, now fed directly, and with it the
busiest link, so the cost model feeds A and B directly too). D takes every version
with ``refit(go_live=False)`` and then ``go_live()``, as an engine that keeps serving
while the next version arrives does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_elastic_jobs.py")
ELEMENTS = 64 * 48 + 48 * 64 + 64  # _elastic_jobs.trainer_layouts
ONE_COPY_EACH = ELEMENTS * 2 + ELEMENTS * 4  # bf16 (TP2 replicas) + fp32 (TP1 replicas)


def _log(tmp: Path, name: str) -> list:
    path = tmp / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.mark.parametrize("sparse", ["off", "on"])
def test_relayed_fleet_loses_a_relay(tmp_path, sparse):
    """``sparse="on"``: refits 2 and 4 run the sparse transport (its chains: the trainer
    feeds A and C, A passes its messages on to B and C to D), refit 1 and 3 are dense
    (no base: the first, and the first after the failed one)."""
    port = free_port()
    env = {**os.environ, "RESHARD_DOMAIN_SIZE": "1"}

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT), *args[:1], str(port),
                                 str(tmp_path), *args[1:]], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start("trainer", "--requests", "4,4,4,4", "--rejoin", "3", "--sparse", sparse),
             start("replica", "--id", "A", "--tp", "2", "--last", "4"),
             start("replica", "--id", "B", "--tp", "2", "--last", "4"),
             start("replica", "--id", "C", "--tp", "1", "--rank", "0", "--die-at", "2")]
    try:
        # D asks to join after C (C's log appears once its request is in): the group
        # orders the replicas as they asked, and the fp32 chain runs C, then D, so the
        # replica killed mid-refit is the one relaying
        deadline = time.monotonic() + 120
        while not (tmp_path / "C-0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.append(start("replica", "--id", "D", "--tp", "1", "--last", "4", "--deferred"))
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=180)
            assert p.returncode == (-9 if i == 3 else 0), out[-3000:]
    finally:
        for p in procs:
            p.kill()
    history = _log(tmp_path, "trainer-0")
    assert [(sorted(h["members"]), h["ok"]) for h in history] == [
        (["A", "B", "C", "D"], True), (["A", "B", "C", "D"], False),
        (["A", "B", "D"], True), (["A", "B", "D"], True)]
    sent = [h.get("sent", 0) + o.get("sent", 0)
            for h, o in zip(history, _log(tmp_path, "trainer-1"))]
    # the trainer's links: one copy per replica layout, not one per replica
    assert history[0]["fanout"] == "relay" and sent[0] == ONE_COPY_EACH, sent
    # without C, D's own link (a full fp32 copy in) is the busiest whether the trainer
    # relays to A and B or not: the cost model keeps the direct fan-out (its tie rule)
    assert history[2]["fanout"] == history[3]["fanout"] == "direct"
    # (A's and B's ranks each get all of b, replicated over TP, as each is a domain)
    assert sent[2] == ELEMENTS * 2 * 2 + 64 * 2 * 2 + ELEMENTS * 4, sent
    if sparse == "on":  # nearly every value changed: about the dense bytes, with headers
        assert not history[2]["sparse"] and history[3]["sparse"], history
        assert 0.9 * sent[2] < sent[3] < 1.05 * sent[2], sent
    else:
        assert sent[3] == sent[2], sent
    relayed = sum(e["sent"] for name, tp in (("A", 2), ("B", 2), ("D", 1))
                  for rank in range(tp) for e in _log(tmp_path, f"{name}-{rank}")[:1])
    assert relayed > 0
    error_s = history[1]["seconds"]
    assert error_s < 30 and history[2]["epoch"] == history[1]["epoch"] + 1
    for name, tp in (("A", 2), ("B", 2), ("D", 1)):
        for rank in range(tp):
            log = _log(tmp_path, f"{name}-{rank}")
            assert [e.get("version") for e in log] == [1, 1, 3, 4], log
            assert log[1]["error"] == "TransferError" and log[1]["kept_previous"], log
            assert all(e["exact"] for e in log if "exact" in e), log
    # D takes each version with go_live=False: whole in its shadow, the live targets
    # still the previous version until go_live()
    assert all(e["waited"] for e in _log(tmp_path, "D-0") if "exact" in e)
    c = _log(tmp_path, "C-0")
    assert c[0]["exact"] and c[0]["sent"] > 0  # C relays (the same schedule in refit 2)
    assert len(c) == 1  # killed in refit 2, before writing again
    print(f"relay lost mid-refit: the trainer's error after {error_s:.2f} s; refit seconds "
          f"{[round(h['seconds'], 2) for h in history]}; trainer bytes {sent}")
