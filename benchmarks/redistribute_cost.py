"""What a repeated ``reshard.redistribute`` call costs next to a cached ``Executor``.

The same synthetic model (``reshard bench``'s) as ``{name: DTensor}``, moved between two
meshes of local gloo processes, four ways timed interleaved in one run (the order rotated
every repeat, so load from the rest of the machine hits all alike):

* ``executor``: a kept :class:`reshard.Executor`'s ``run(src, dst)`` (its default
  ``check=True``: one agreement collective, then the transfer);
* ``executor, check=False``: the transfer alone;
* ``redistribute, out=``: the one-call collective, repeated, writing into given DTensors;
* ``executor, new outputs``: the kept executor into freshly allocated tensors each call;
* ``redistribute``: the one-call collective returning new DTensors (allocating their
  local tensors, as ``DTensor.redistribute`` does): compare it with the line above.

Every destination is verified bit for bit first. A call ends when its slowest rank ends;
the figure is the median over repeats.

    .venv/bin/python benchmarks/redistribute_cost.py --model-bytes 256MiB --repeats 15
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchtools import slowest_median
from reshard.comm import Comm
from reshard.dtensor import redistribute
from reshard.executor import Executor
from reshard.tools.bench import BenchConfig, build_plan, dtensors_of
from reshard.tools.launch import run_processes
from reshard.tools.report import parse_bytes, print_table
from reshard.tools.synthetic import fill_local, matches

WAYS = ("executor", "executor, check=False", "redistribute, out=", "executor, new outputs",
        "redistribute")


def _worker(rank: int, world: int, cfg: BenchConfig) -> dict:
    plan, _ = build_plan(cfg)
    comm = Comm.from_group()
    src = {t.name: fill_local(t.src, rank) for t in plan.tensors if rank in t.src.rank_set}
    dst = {t.name: torch.zeros(t.dst.local_shape(rank), dtype=getattr(torch, t.dst.dtype))
           for t in plan.tensors if rank in t.dst.rank_set}
    sources, outs = dtensors_of(plan, rank, src, "src"), dtensors_of(plan, rank, dst, "dst")
    meshes = {n: d.device_mesh for n, d in outs.items()}
    placements = {n: d.placements for n, d in outs.items()}
    executor = Executor(plan, comm, budget_bytes=cfg.budget_bytes)
    ok = {}
    ways = {
        "executor": lambda: executor.run(src, dst),
        "executor, check=False": lambda: executor.run(src, dst, check=False),
        "redistribute, out=": lambda: redistribute(sources, out=outs,
                                                   budget_bytes=cfg.budget_bytes),
        "executor, new outputs": lambda: executor.run(src, _fresh(dst)),
        "redistribute": lambda: redistribute(sources, meshes, placements,
                                             budget_bytes=cfg.budget_bytes),
    }
    for name, fn in ways.items():  # first calls: plan, schedule, topology; then verify
        for t in dst.values():
            t.zero_()
        got = fn()
        held = ({n: d.to_local() for n, d in got.items()} if name == "redistribute"
                else dst)
        if name == "executor, new outputs":
            fresh = _fresh(dst)
            executor.run(src, fresh)
            held = fresh
        ok[name] = all(matches(t.dst, rank, held[t.name]) for t in plan.tensors
                       if rank in t.dst.rank_set)
    times: dict[str, list[float]] = {name: [] for name in ways}
    order = list(ways.items())
    for i in range(cfg.repeats):
        for name, fn in order[i % len(order):] + order[:i % len(order)]:
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "ok": ok}


def _fresh(dst: dict) -> dict:
    return {n: torch.empty_like(t) for n, t in dst.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="tp4")
    ap.add_argument("--dst", default="tp2,dp2")
    ap.add_argument("--model-bytes", default="256MiB")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = BenchConfig(src=args.src, dst=args.dst, model_bytes=parse_bytes(args.model_bytes),
                      repeats=args.repeats)
    plan, world = build_plan(cfg)
    per_rank = run_processes(_worker, world, cfg, timeout=1800)
    seconds = {w: slowest_median(r["times"][w] for r in per_rank)
               for w in WAYS}
    verified = {w: all(r["ok"][w] for r in per_rank) for w in WAYS}
    base = seconds["executor"]
    if args.json:
        print(json.dumps({"src": cfg.src, "dst": cfg.dst, "model_bytes": cfg.model_bytes,
                          "tensors": len(plan), "seconds": seconds, "verified": verified}))
        return
    print_table(f"repeated call, {args.model_bytes} in {len(plan)} tensors: {cfg.src} -> "
                f"{cfg.dst} on {world} local processes ({cfg.repeats} repeats, median)",
                ["way", "seconds", "vs executor", "bit-exact"],
                [[w, f"{seconds[w]:.4f}", f"{seconds[w] / base:.2f}x",
                  "yes" if verified[w] else "NO"] for w in WAYS])
    if not all(verified.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
