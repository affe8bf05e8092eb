"""Validate the cost model against real refits on this machine's emulated nodes.

    sudo .venv/bin/python benchmarks/validate_costmodel.py [--json] [--repeats 2]

1. Measure the emulated cluster itself with bare gloo sends (no refit code involved):
   a 32 MiB send between two namespaces (the shaped node link), the same inside one
   namespace (loopback), four loopback sends at once (the host's CPU cores are shared by
   every namespace), and a small-message ping-pong (latency).
2. Build the ``emulated`` cluster from those numbers (nothing else is tuned).
3. Check the collective model alone: a bare 64 MiB gloo broadcast from node 0 to three
   ranks of node 1, predicted vs measured.
4. Run ``reshard bench`` cases on emulated nodes (every method, bit-exact, median of the
   timed refits) and predict each with the cost model, from the same plan and the same
   node placement. Print predicted vs measured per method with the error.

Needs root, ``ip`` and ``tc`` (network namespaces); about three minutes on two cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import reshard as R
from reshard.sim.cluster import RankMap, emulated
from reshard.sim.costmodel import simulate
from reshard.tools.bench import BenchConfig, build_plan, node_of_rank, run_bench

LINK_MBIT = 500.0
MODEL_BYTES = 64 << 20
CASES = (("tp4", "tp2,dp2", 2), ("dp2,tp4", "dp4,tp2", 4), ("fsdp4", "tp4", 2))
PROBE_NODES = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}  # probe rank -> emulated node
PROBES = {"inter": [(0, 1)], "intra": [(0, 2)],
          "intra_x4": [(0, 2), (2, 4), (1, 3), (3, 5)]}
BCAST_GROUP, BCAST_BYTES = [0, 1, 3, 5], 64 << 20  # root on node 0, three ranks on node 1


def _probe_worker(rank: int, world: int, nbytes: int, repeats: int) -> dict:
    import torch
    import torch.distributed as dist

    buf = torch.empty(nbytes, dtype=torch.uint8)
    out: dict = {}
    for name, pairs in PROBES.items():
        times = []
        for rep in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.isend(buf, d) for s, d in pairs if s == rank]
            works += [dist.irecv(buf, s) for s, d in pairs if d == rank]
            for w in works:
                w.wait()
            dist.barrier()
            if rep:
                times.append(time.perf_counter() - t0)
        out[name] = min(times)
    out["latency"] = _ping_pong(rank, peer=1)  # across the node link
    out["bcast"] = _bare_broadcast(rank, repeats)
    return out


def _bare_broadcast(rank: int, repeats: int) -> float:
    import torch
    import torch.distributed as dist

    group = dist.new_group(BCAST_GROUP)  # every rank calls it
    buf = torch.zeros(BCAST_BYTES, dtype=torch.uint8)
    times = []
    for rep in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in BCAST_GROUP:
            dist.broadcast(buf, BCAST_GROUP[0], group=group)
        dist.barrier()
        if rep:
            times.append(time.perf_counter() - t0)
    return min(times)


def _ping_pong(rank: int, peer: int, reps: int = 100) -> float | None:
    import torch
    import torch.distributed as dist

    small = torch.zeros(8, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(small, peer)
            dist.recv(small, peer)
            times.append((time.perf_counter() - t0) / 2)
        elif rank == peer:
            dist.recv(small, 0)
            dist.send(small, 0)
    return statistics.median(times) if times else None


def _enter(names: dict[int, str], rank: int) -> None:
    from reshard.tools.netns import enter_namespace

    enter_namespace(names[rank])


def measure_links(nbytes: int = 32 << 20, repeats: int = 3) -> dict[str, float]:
    """Bandwidths (GB/s) and latency (s) of the emulated cluster, from bare gloo sends."""
    from reshard.tools.launch import run_processes
    from reshard.tools.netns import EmulatedCluster

    with EmulatedCluster(2, rate_mbit=LINK_MBIT) as cluster:
        names = {r: cluster.ns_name(n) for r, n in PROBE_NODES.items()}
        per_rank = run_processes(_probe_worker, len(PROBE_NODES), nbytes, repeats,
                                 setup=partial(_enter, names), master_addr=cluster.node_addr(0),
                                 env={"GLOO_SOCKET_IFNAME": cluster.iface,
                                      "TORCH_CPP_LOG_LEVEL": "ERROR"})
    r0 = per_rank[0]
    return {"nic_gb_per_s": nbytes / r0["inter"] / 1e9,
            "intra_gb_per_s": nbytes / r0["intra"] / 1e9,
            "shared_intra_gb_per_s": 4 * nbytes / r0["intra_x4"] / 1e9,
            "latency_s": r0["latency"], "probe_bytes": nbytes, "bcast_s": r0["bcast"]}


def predict_bare_broadcast(links: dict) -> float:
    """The cost model's gather_broadcast for one replicated 64 MiB tensor from rank 0 to
    the other members of BCAST_GROUP (no all-gather: a single source rank)."""
    shape = (BCAST_BYTES // 4 // 4096, 4096)
    src = R.Layout(shape, R.Mesh(BCAST_GROUP[:1]), [R.Replicate()])
    dst = R.Layout(shape, R.Mesh(BCAST_GROUP[1:]), [R.Replicate()])
    cluster = _cluster(links, gpus_per_node=3)
    sim = simulate(R.plan(src, dst), cluster,
                   ranks=RankMap.from_domains(PROBE_NODES, gpus_per_nic=3))
    return sim.predictions["gather_broadcast"].seconds


def _cluster(links: dict, gpus_per_node: int):
    return emulated(nic_gb_per_s=links["nic_gb_per_s"],
                    intra_gb_per_s=links["intra_gb_per_s"], latency_s=links["latency_s"],
                    shared_intra_gb_per_s=links["shared_intra_gb_per_s"],
                    gpus_per_node=gpus_per_node)


def validate_case(src: str, dst: str, nodes: int, links: dict, repeats: int) -> dict:
    cfg = BenchConfig(src=src, dst=dst, model_bytes=MODEL_BYTES, nodes=nodes,
                      link_mbit=LINK_MBIT, repeats=repeats)
    measured = run_bench(cfg)
    plan, _ = build_plan(cfg)
    node = node_of_rank(cfg)
    per_node = max(list(node.values()).count(n) for n in set(node.values()))
    cluster = _cluster(links, per_node)
    sim = simulate(plan, cluster, ranks=RankMap.from_domains(node, gpus_per_nic=per_node),
                   budget_bytes=cfg.budget_bytes)
    rows = []
    for method, pred in sim.predictions.items():
        got = measured["methods"][method]
        rows.append({"method": method, "predicted_s": pred.seconds, "measured_s": got["seconds"],
                     "error": pred.seconds / got["seconds"] - 1, "verified": got["verified"],
                     "bottleneck": pred.bottleneck})
    floor = sim.predictions["p2p"].stages["transfer"]
    rows.append({"method": "floor (bare p2p exchange)", "predicted_s": floor,
                 "measured_s": measured["floor_seconds"],
                 "error": floor / measured["floor_seconds"] - 1, "verified": True,
                 "bottleneck": ""})
    return {"src": src, "dst": dst, "nodes": nodes, "model_bytes": MODEL_BYTES,
            "lower_bound_s": sim.lower_bound_s, "rows": rows}


def report(links: dict, results: list[dict]) -> str:
    lines = [f"emulated cluster (measured): node link {links['nic_gb_per_s'] * 1e3:.1f} MB/s, "
             f"loopback {links['intra_gb_per_s']:.2f} GB/s per flow, "
             f"{links['shared_intra_gb_per_s']:.2f} GB/s for all flows together, "
             f"latency {links['latency_s'] * 1e3:.2f} ms",
             f"bare gloo broadcast, 64 MiB, node 0 -> 3 ranks of node 1: predicted "
             f"{links['bcast_predicted_s']:.3f}s, measured {links['bcast_s']:.3f}s "
             f"({links['bcast_predicted_s'] / links['bcast_s'] - 1:+.1%})", ""]
    lines.append(f"{'case':34} {'method':26} {'predicted':>10} {'measured':>10} {'error':>8}")
    for r in results:
        case = f"{r['src']} -> {r['dst']}, {r['nodes']} nodes, {r['model_bytes'] >> 20} MiB"
        for row in r["rows"]:
            lines.append(f"{case:34} {row['method']:26} {row['predicted_s']:9.3f}s "
                         f"{row['measured_s']:9.3f}s {row['error']:+8.1%}")
            case = ""
        lines.append(f"{'':34} {'lower bound':26} {r['lower_bound_s']:9.3f}s")
    worst = max(abs(row["error"]) for r in results for row in r["rows"])
    lines.append(f"\nlargest error {worst:.1%} (target: within 30% for every case)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="timed refits per method")
    args = ap.parse_args(argv)
    from reshard.tools.netns import netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"emulated nodes unavailable here: {reason}", file=sys.stderr)
        return 2
    links = measure_links()
    links["bcast_predicted_s"] = predict_bare_broadcast(links)
    results = [validate_case(s, d, n, links, args.repeats) for s, d, n in CASES]
    if args.json:
        print(json.dumps({"links": links, "cases": results}, indent=2))
    else:
        print(report(links, results))
    ok = all(abs(row["error"]) <= 0.30 for r in results for row in r["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
