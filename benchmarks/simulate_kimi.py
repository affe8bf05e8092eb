"""Plan + simulate at Kimi-K2 scale on one core: 256 trainer ranks -> 128 inference ranks.

    python benchmarks/simulate_kimi.py [--json] [--repeat N] [--cluster dgx-h100]

Trainer ``pp16,ep16`` (16 pipeline stages of 16 ranks; the 384 routed experts of a layer
split 24 per EP rank, everything else replicated over the stage), inference ``tp8,dp16``
(16 replicas of 8-way tensor parallelism). Times building the layouts, planning, and the
cost model (all three methods), cold (first run) and the best of ``--repeat`` warm runs,
wall and CPU; the target is plan + simulate under 10 s on one core.
"""

from __future__ import annotations

import argparse
import json
import sys

from benchtools import timed
from reshard import planner
from reshard.defaults import METHODS
from reshard.sim.costmodel import simulate
from reshard.sim.models import preset
from reshard.sim.specs import ParallelSpec, model_layouts

SRC, DST = "pp16,ep16", "tp8,dp16"




def run(cluster: str, repeat: int) -> dict:
    model = preset("kimi-k2")
    src_spec = ParallelSpec.parse(SRC)
    t_layouts, (src, dst) = timed(lambda: (
        model_layouts(model.tensors, src_spec),
        model_layouts(model.tensors, DST, first_rank=src_spec.world_size)))
    runs = []
    for _ in range(repeat + 1):  # run 0 is the cold one
        t_plan, p = timed(lambda: planner.plan(src, dst))
        t_sim, sim = timed(lambda p=p: simulate(p, cluster, methods=METHODS))  # reshard's own
        runs.append({"plan_s": t_plan, "simulate_s": t_sim,
                     "total_s": {k: t_plan[k] + t_sim[k] for k in t_plan}})
    warm = runs[1:] or runs
    best = {k: {c: min(r[k][c] for r in warm) for c in ("wall", "cpu")}
            for k in ("plan_s", "simulate_s", "total_s")}
    return {"model": model.name, "model_bytes": model.nbytes, "tensors": len(p),
            "src": SRC, "dst": DST, "cluster": cluster, "layouts_s": t_layouts,
            "cold": runs[0], "warm_best": best, "repeat": repeat, **sim.as_dict()}


def report(r: dict) -> str:
    def t(x):
        return f"{x['wall']:.2f} s (cpu {x['cpu']:.2f})"

    lines = [f"{r['model']} ({r['model_bytes'] / 1e9:,.0f} GB, {r['tensors']:,} tensors): "
             f"{r['src']} (256 ranks) -> {r['dst']} (128 ranks) on {r['cluster']}",
             f"  layouts {t(r['layouts_s'])}",
             f"  cold: plan {t(r['cold']['plan_s'])} + simulate {t(r['cold']['simulate_s'])}"
             f" = {t(r['cold']['total_s'])}",
             f"  warm (best of {r['repeat']}): plan {t(r['warm_best']['plan_s'])} + simulate "
             f"{t(r['warm_best']['simulate_s'])} = {t(r['warm_best']['total_s'])}"]
    for m, p in r["predictions"].items():
        lines.append(f"  {m:17} {p['seconds']:8.3f} s   {p['bottleneck']}")
    lines.append(f"  {'lower bound':17} {r['lower_bound_s']:8.3f} s   {r['lower_bound']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=2, help="warm runs after the cold one")
    ap.add_argument("--cluster", default="dgx-h100")
    args = ap.parse_args(argv)
    result = run(args.cluster, max(0, args.repeat))
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
