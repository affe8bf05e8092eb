"""Where the time above the floor goes: CPU time per refit, against the floor's.

    python benchmarks/cpu_per_refit.py [--src tp4] [--dst tp2,dp2] [--model-bytes 1GiB]
                                       [--repeats 15]

On a machine whose cores the ranks saturate (8 processes on 2 cores here), a method's
time over the floor's is about its CPU over the floor's: this measures that CPU
directly (user + system time of every rank's process, gloo's threads included, around
each timed refit; ``getrusage``), which is steadier than wall time. The floor is the
bench's own (one written buffer per rank pair). Every destination is checked once.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from benchtools import slowest_median
from reshard.executor import Executor
from reshard.tools.bench import BenchConfig, build_plan, floor_runner
from reshard.tools.cli import parse_bytes
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, world: int, cfg: BenchConfig, repeats: int) -> dict:
    from reshard.comm import Comm

    plan, _ = build_plan(cfg)
    comm = Comm.from_group()
    src = {t.name: fill_local(t.src, rank) for t in plan.tensors if rank in t.src.rank_set}
    dst = {t.name: torch.zeros(t.dst.local_shape(rank), dtype=getattr(torch, t.dst.dtype))
           for t in plan.tensors if rank in t.dst.rank_set}
    ex = Executor(plan, comm, method="reshard", budget_bytes=cfg.budget_bytes)
    ex.run(src, dst)
    ok = all(matches(t.dst, rank, dst[t.name]) for t in plan.tensors if t.name in dst)
    runs = {"floor": floor_runner(plan, comm),
            "reshard": lambda: ex.run(src, dst, check=False)}
    out: dict = {"ok": ok, **{f"{n}_{k}": [] for n in runs for k in ("wall", "cpu")}}
    for fn in runs.values():
        fn()
    for i in range(repeats):
        for name, fn in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
            comm.barrier()
            c0, t0 = _cpu(), time.perf_counter()
            fn()
            out[f"{name}_wall"].append(time.perf_counter() - t0)
            out[f"{name}_cpu"].append(_cpu() - c0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="tp4")
    ap.add_argument("--dst", default="tp2,dp2")
    ap.add_argument("--model-bytes", default="1GiB")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    cfg = BenchConfig(src=a.src, dst=a.dst, model_bytes=parse_bytes(a.model_bytes))
    _, world = build_plan(cfg)
    per_rank = run_processes(_worker, world, cfg, a.repeats, timeout=1800)
    wall = {n: slowest_median(r[f"{n}_wall"] for r in per_rank)
            for n in ("floor", "reshard")}
    cpu = {n: sum(sum(r[f"{n}_cpu"]) for r in per_rank) / a.repeats
           for n in ("floor", "reshard")}
    print(f"{a.src} -> {a.dst}, {a.model_bytes}, {world} processes, {a.repeats} refits each, "
          f"verified: {all(r['ok'] for r in per_rank)}")
    for n in ("floor", "reshard"):
        print(f"  {n:8s} wall {wall[n]:.3f} s ({wall[n] / wall['floor']:.2f}x)   "
              f"CPU per refit, all ranks {cpu[n]:.3f} s ({cpu[n] / cpu['floor']:.2f}x)")


if __name__ == "__main__":
    main()
