"""A fleet of replicas on emulated nodes: refit time and the bytes on the trainer
node's link against the number of replicas R, direct and relayed, in one run.

One trainer node (2 ranks, the model split in two) and R replica nodes (TP1 or TP2
each), every node a network namespace with one link shaped by ``tc`` to
``--link-mbit`` each way (``reshard.tools.netns``). For each R and TP a fresh cluster;
in it, every rank builds the same plan (the trainer's layouts -> ``tp<TP>,dp<R>``) and
two executors over one gloo group, ``fanout="direct"`` and ``fanout="relay"``; each is
checked bit for bit on every replica rank, then both are timed interleaved. Trainer rank
0 reads its node's link counter (``/proc/net/dev`` in its namespace: every byte the
node sent, headers and control messages included) around each timed refit.

    sudo .venv/bin/python benchmarks/fleet_refit.py --replicas 1,2,4,6 --tp 1,2

``--changed F``: sparse refits instead (``docs/sparse.md``), each after every trainer rank
changed a fraction F of its values: both executors' sparse transports (``direct``: the
trainer ranks send each replica rank its changed values; ``relay``: to the first replica
of a chain, which passes the encoded messages on), sharing the trainer's copies, one
version after another; at the end the replicas' weights are compared bit for bit with a
dense refit of the same values.

Needs root (network namespaces). Prints a table and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial
from pathlib import Path

import torch

from benchtools import median, slowest_median, write_json
from reshard import planner
from reshard.sim.models import synthetic_model
from reshard.sim.specs import model_layouts
from reshard.tools.synthetic import fill_local, matches

TRAINER = 2
MODES = ("direct", "relay")


def build(model_bytes: int, replicas: int, tp: int):
    model = synthetic_model(model_bytes, dtype="float32")
    src = model_layouts(model.tensors, f"fsdp{TRAINER}", dtype="float32")
    dst = model_layouts(model.tensors, f"tp{tp},dp{replicas}", first_rank=TRAINER,
                        dtype="float32")
    return planner.plan(src, dst), model.nbytes


def node_of_rank(replicas: int, tp: int) -> dict[int, int]:
    out = {r: 0 for r in range(TRAINER)}
    out.update({TRAINER + i * tp + j: 1 + i for i in range(replicas) for j in range(tp)})
    return out


def link_tx_bytes(iface: str = "eth0") -> int:
    """Bytes this process's network namespace sent out of ``iface``."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            return int(rest.split()[8])
    raise RuntimeError(f"no {iface} in /proc/net/dev")


def worker(rank: int, world: int, a: argparse.Namespace, replicas: int, tp: int) -> dict:
    from reshard.comm import Comm
    from reshard.executor import Executor
    from reshard.topology import Topology

    torch.set_num_threads(1)
    plan, _ = build(a.model_bytes, replicas, tp)
    comm = Comm.from_group()
    topo = Topology(domains=node_of_rank(replicas, tp))
    src = {t.name: fill_local(t.src, rank) for t in plan.tensors if rank in t.src.rank_set}
    dst = {t.name: torch.zeros(t.dst.local_shape(rank)) for t in plan.tensors
           if rank in t.dst.rank_set}
    out: dict = {}
    runs = {}
    for mode in MODES:
        ex = Executor(plan, comm, method="reshard", budget_bytes=a.budget_bytes,
                      topology=topo, fanout=mode)
        for t in dst.values():
            t.zero_()
        ex.run(src, dst)
        out[mode] = {"ok": all(matches(t.dst, rank, dst[t.name]) for t in plan.tensors
                               if t.name in dst),
                     "times": [], "link": [], "rounds": len(ex.schedule.rounds)}
        runs[mode] = ex
    for i in range(a.repeats):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            before = link_tx_bytes() if rank == 0 else 0  # before the barrier: rank 1
            comm.barrier()  # may start sending as soon as it leaves it
            t0 = time.perf_counter()
            runs[mode].run(src, dst, check=False)
            out[mode]["times"].append(time.perf_counter() - t0)
            comm.barrier()
            if rank == 0:
                out[mode]["link"].append(link_tx_bytes() - before)
    return out


def sparse_worker(rank: int, world: int, a: argparse.Namespace, replicas: int, tp: int
                  ) -> dict:
    """``--changed``: sparse refits, direct and relayed alternating, one version each."""
    from reshard.comm import Comm
    from reshard.executor import Copies, Executor
    from reshard.topology import Topology

    torch.set_num_threads(1)
    plan, _ = build(a.model_bytes, replicas, tp)
    comm = Comm.from_group()
    topo = Topology(domains=node_of_rank(replicas, tp))
    src = {t.name: fill_local(t.src, rank) for t in plan.tensors if rank in t.src.rank_set}
    dst = {t.name: torch.zeros(t.dst.local_shape(rank)) for t in plan.tensors
           if rank in t.dst.rank_set}
    receivers = {r for t in plan.tensors for r in t.dst.rank_set}
    copies = Copies()  # the trainer's, one for both transports (the same regions)
    runs = {mode: Executor(plan, comm, method="reshard", budget_bytes=a.budget_bytes,
                           topology=topo, fanout=mode) for mode in MODES}
    sparse = {mode: ex.sparse_runner(copies) for mode, ex in runs.items()}
    g = torch.Generator().manual_seed(rank)
    version = 1

    def refit(mode: str, base: int | None) -> tuple[float, object]:
        bases = dict.fromkeys(range(world), base)
        comm.barrier()
        t0 = time.perf_counter()
        stats = sparse[mode].run(src, dst, sparse_to=receivers if base else set(),
                                 base=base, bases=bases)
        seconds = time.perf_counter() - t0
        copies.commit(version)
        return seconds, stats

    refit(MODES[0], None)  # dense: the copies made
    out: dict = {mode: {"times": [], "link": [], "wire": [], "rounds": 0} for mode in MODES}
    for i in range(a.repeats):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            for t in src.values():  # a fraction of the values changed
                hit = torch.rand(t.shape, generator=g) < a.changed
                t[hit] += 1.0
            before = link_tx_bytes() if rank == 0 else 0
            version += 1
            seconds, stats = refit(mode, version - 1)
            comm.barrier()
            out[mode]["times"].append(seconds)
            out[mode]["wire"].append(stats.wire_sent)
            out[mode]["rounds"] = stats.rounds
            if rank == 0:
                out[mode]["link"].append(link_tx_bytes() - before)
    after = {n: t.clone() for n, t in dst.items()}
    runs[MODES[0]].run(src, dst)  # the same values, dense
    same = all(torch.equal(after[n].view(torch.int32), t.view(torch.int32))
               for n, t in dst.items())
    for mode in MODES:
        out[mode]["ok"] = same
    return out


def one_fleet(a: argparse.Namespace, replicas: int, tp: int) -> list[dict]:
    from reshard.tools.bench import enter_rank_namespace
    from reshard.tools.launch import run_processes
    from reshard.tools.netns import EmulatedCluster

    nodes = node_of_rank(replicas, tp)
    _, model_bytes = build(a.model_bytes, replicas, tp)
    with EmulatedCluster(1 + replicas, rate_mbit=a.link_mbit, prefix="rfl",
                         queue_ms=a.queue_ms, link=a.link,
                         congestion=a.congestion) as cluster:
        names = {r: cluster.ns_name(n) for r, n in nodes.items()}
        per_rank = run_processes(worker if a.changed is None else sparse_worker, len(nodes),
                                 a, replicas, tp, timeout=a.timeout,
                                 setup=partial(enter_rank_namespace, names, None),
                                 master_addr=cluster.node_addr(0),
                                 env={"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"})
    rows = []
    for mode in MODES:
        rows.append({"replicas": replicas, "tp": tp, "fanout": mode,
                     "seconds": slowest_median([r[mode]["times"] for r in per_rank]),
                     "trainer_link_copies": median(per_rank[0][mode]["link"]) / model_bytes,
                     "model_bytes": model_bytes, "rounds": per_rank[0][mode]["rounds"],
                     "changed": a.changed, "trainer_wire_bytes": sum(
                         median(r[mode]["wire"]) for r in per_rank[:TRAINER]
                     ) if a.changed is not None else None,
                     "verified": all(r[mode]["ok"] for r in per_rank)})
    return rows


def table(rows: list[dict]) -> str:
    base = {(r["tp"], r["fanout"]): r["seconds"] for r in rows if r["replicas"] == 1}
    lines = ["| TP | R | fanout | refit s | vs R=1 | trainer link (model copies) | rounds | "
             "exact |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        one = base.get((r["tp"], r["fanout"]))
        ratio = f"{r['seconds'] / one:.2f}x" if one else "-"
        lines.append(f"| {r['tp']} | {r['replicas']} | {r['fanout']} | {r['seconds']:.3f} | "
                     f"{ratio} | {r['trainer_link_copies']:.3f} | {r['rounds']} | "
                     f"{'yes' if r['verified'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,2,4,6")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--model-mib", type=float, default=8.0)
    ap.add_argument("--link-mbit", type=float, default=200.0)
    ap.add_argument("--link", default="tbf", choices=("tbf", "ack-first"),
                    help="how each link queues (reshard.tools.netns.LINKS)")
    ap.add_argument("--congestion", default=None,
                    help="TCP congestion control inside the nodes (default: the host's)")
    ap.add_argument("--queue-ms", type=float, default=50.0,
                    help="each link's queue, in milliseconds of traffic (tbf's latency)")
    ap.add_argument("--budget-mib", type=float, default=2.0,
                    help="staging budget per rank and round (network chunks: a sixth)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--changed", type=float, default=None,
                    help="sparse refits, this fraction of the values changed before each")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="/tmp/fleet_refit.json")
    a = ap.parse_args()
    a.model_bytes = int(a.model_mib * (1 << 20))
    a.budget_bytes = int(a.budget_mib * (1 << 20))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    rows = []
    for tp in (int(x) for x in a.tp.split(",")):
        for replicas in (int(x) for x in a.replicas.split(",")):
            rows += one_fleet(a, replicas, tp)
            print(table(rows[-2:]).splitlines()[-2:], flush=True)
    print(f"model {a.model_mib} MiB fp32, trainer {TRAINER} ranks on one node, links "
          f"{a.link_mbit:g} Mbit/s each way, budget {a.budget_mib:g} MiB"
          + (f", sparse refits at {a.changed:.1%} changed" if a.changed is not None else ""))
    print(table(rows))
    write_json(Path(a.out), {"args": {k: v for k, v in vars(a).items()}, "rows": rows})


if __name__ == "__main__":
    main()
