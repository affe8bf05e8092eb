"""Emulated multi-node cluster (reshard.tools.netns) with real torch.distributed gloo traffic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.tools.netns import EmulatedCluster, netns_unavailable_reason

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("_netns_worker.py")
NBYTES = 16 << 20
REPS = 3
PORT = 29511  # each namespace is fresh, so any port is free there
RATE_MBIT = 400.0


def _require_netns() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"emulated cluster unavailable: {reason}")


def _ip_netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_intra_node_fast_inter_node_slow(tmp_path: Path) -> None:
    _require_netns()
    t_start = time.monotonic()
    out_json = tmp_path / "result.json"
    placement = [0, 0, 1]  # rank -> node: ranks 0,1 on node 0, rank 2 on node 1
    world = len(placement)
    with EmulatedCluster(2, rate_mbit=RATE_MBIT) as cluster:
        names = [cluster.ns_name(i) for i in range(cluster.num_nodes)]
        assert all(n in _ip_netns_list() for n in names)
        env = {
            **os.environ,
            "GLOO_SOCKET_IFNAME": cluster.iface,
            "MASTER_ADDR": cluster.node_addr(0),
            "MASTER_PORT": str(PORT),
            "OMP_NUM_THREADS": "1",
        }
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank, node in enumerate(placement):
                log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115
                logs.append(log)
                argv = [sys.executable, str(WORKER), str(rank), str(world),
                        cluster.node_addr(0), str(PORT), str(NBYTES), str(REPS), str(out_json)]
                procs.append(cluster.popen(node, argv, env=env, stdout=log,
                                           stderr=subprocess.STDOUT))
            deadline = time.monotonic() + 45
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=5)
            for log in logs:
                log.close()
        output = "\n".join(
            f"--- rank {r} (rc={p.returncode}) ---\n"
            + (tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:]
            for r, p in enumerate(procs)
        )
        assert all(p.returncode == 0 for p in procs), output

    # 3. Everything is gone once the context manager has exited.
    listing = _ip_netns_list()
    assert not any(n in listing for n in names), listing

    res = json.loads(out_json.read_text())
    intra, inter = res["1"], res["2"]
    assert all(intra["intact"]) and all(inter["intact"]), res
    mb = NBYTES / 1e6
    intra_mbs = mb / min(intra["secs"])
    inter_mbs = mb / min(inter["secs"])
    ratio = intra_mbs / inter_mbs
    print(f"\nintra-node {intra_mbs:.0f} MB/s, inter-node {inter_mbs:.1f} MB/s "
          f"(link {RATE_MBIT / 8:.0f} MB/s), ratio {ratio:.1f}x, "
          f"test {time.monotonic() - t_start:.1f}s; raw secs {res}")
    assert ratio >= 4.0, f"inter-node only {ratio:.1f}x slower than intra-node: {res}"


def test_cleanup_on_exception() -> None:
    _require_netns()
    cluster = EmulatedCluster(1, prefix="rshx")
    with pytest.raises(KeyError), cluster:
        name = cluster.ns_name(0)
        assert name in _ip_netns_list()
        raise KeyError("boom")
    assert name not in _ip_netns_list()
    cluster.close()  # idempotent


_SINK = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", 29512))
c, _ = s.accept()
n, t0 = 0, None
while chunk := c.recv(1 << 16):
    t0 = t0 or time.monotonic()
    n += len(chunk)
print(n, time.monotonic() - t0)
"""
_SOURCE = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 29512)); break
    except OSError:
        time.sleep(0.05)
c.sendall(bytes(int(sys.argv[2])))
c.close()
"""


def test_an_ack_first_link_with_reno_shapes_and_carries() -> None:
    """``link="ack-first"`` and ``congestion="reno"`` (the fleet benchmark's other link
    models): the filter that puts pure acknowledgements first is in place, the nodes run
    reno, and a TCP stream crosses at the link's rate, whole."""
    _require_netns()
    nbytes, rate = 3 << 20, 100.0
    with EmulatedCluster(2, rate_mbit=rate, link="ack-first", congestion="reno") as cluster:
        show = subprocess.run(["tc", "-n", cluster.ns_name(1), "filter", "show", "dev",
                               cluster.iface], capture_output=True, text=True).stdout
        assert "flowid 1:10" in show and "match 00100000/00ff0000 at 32" in show, show
        cc = subprocess.run(cluster.command(1, ["sysctl", "-n",
                                                "net.ipv4.tcp_congestion_control"]),
                            capture_output=True, text=True).stdout.strip()
        assert cc == "reno"
        sink = cluster.popen(0, [sys.executable, "-c", _SINK], stdout=subprocess.PIPE,
                             text=True)
        source = cluster.popen(1, [sys.executable, "-c", _SOURCE, cluster.node_addr(0),
                                   str(nbytes)])
        assert source.wait(30) == 0
        got, seconds = sink.communicate(timeout=30)[0].split()
    assert int(got) == nbytes
    mbit = nbytes * 8 / 1e6 / float(seconds)
    assert mbit < 1.3 * rate, (mbit, seconds)  # shaped: not faster than the link
    with pytest.raises(Exception, match="link must be one of"):
        EmulatedCluster(1, link="fq")
    with pytest.raises(Exception, match="no netem delay"):  # refused before it builds
        EmulatedCluster(1, link="ack-first", delay_ms=5)


CARD_BYTES = 4 << 20


def _cross_cards(rank: int, world: int) -> bool:
    """Ranks 0, 1 on node 0 (cards 0, 1), ranks 2, 3 on node 1 (cards 0, 1); rank 0
    sends to rank 3 and rank 1 to rank 2, so each flow goes from one card to the other
    card's number on the far node."""
    import torch
    import torch.distributed as dist

    t = torch.full((CARD_BYTES // 4,), float(rank))
    if rank < 2:
        dist.send(t, 3 - rank)
        return True
    dist.recv(t, 3 - rank)
    return bool((t == 3 - rank).all())


def _card_bytes(cluster: EmulatedCluster, node: int, card: int) -> tuple[int, int]:
    out = subprocess.run(["ip", "-n", cluster.ns_name(node), "-s", "-j", "link", "show",
                          "dev", cluster.nic_name(card)], capture_output=True, text=True,
                         check=True).stdout
    stats = json.loads(out)[0]["stats64"]
    return stats["tx"]["bytes"], stats["rx"]["bytes"]


def test_each_rank_sends_and_receives_through_its_own_card() -> None:
    _require_netns()
    from reshard.tools.netns import cards_unavailable_reason

    reason = cards_unavailable_reason()
    if reason:
        print(f"SKIP a card per rank: {reason}")
        pytest.skip(f"a card per rank unavailable: {reason}")
    from functools import partial

    from reshard.tools.bench import enter_rank_namespace
    from reshard.tools.launch import run_processes

    with EmulatedCluster(2, rate_mbit=2000, nics_per_node=2) as cluster:
        names = {r: cluster.ns_name(r // 2) for r in range(4)}
        cards = {r: r % 2 for r in range(4)}
        ok = run_processes(_cross_cards, 4, setup=partial(enter_rank_namespace, names, cards),
                           master_addr=cluster.node_addr(0), timeout=60,
                           env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
        assert all(ok)
        sent = [_card_bytes(cluster, 0, c)[0] for c in range(2)]
        got = [_card_bytes(cluster, 1, c)[1] for c in range(2)]
    print(f"\nnode 0 cards sent {sent} B, node 1 cards received {got} B")
    # each card carried its own rank's flow, and only that one
    for n in sent + got:
        assert CARD_BYTES <= n < 1.5 * CARD_BYTES, (sent, got)
