"""``reshard simulate``: the command over :mod:`reshard.sim` (predicted refit time of a
model between two parallel layouts on a cluster preset, for every method; plots; sweeps).

    reshard simulate --model deepseek-v3 --src pp16,ep16 --dst tp32,dp8 --cluster dgx-h100
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from reshard.defaults import SIM_METHODS
from reshard.quant.targets import SCALE_SUFFIX
from reshard.sim.cluster import CLUSTERS, get_cluster
from reshard.sim.costmodel import Simulation
from reshard.sim.simulate import plot_simulation, plot_sweep, run_case, sweep
from reshard.tools.report import parse_bytes, print_table

__all__ = ["cmd_simulate", "register"]


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def _rows(sim: Simulation) -> list[list[str]]:
    rows = []
    for m, p in sim.predictions.items():
        ratio = p.seconds / sim.lower_bound_s if sim.lower_bound_s else float("nan")
        network = _gb(p.loads.network_bytes) if p.loads is not None else ""
        rows.append([m, f"{p.seconds:.3f}", f"{ratio:.2f}x", network])
    rows.append(["lower bound", f"{sim.lower_bound_s:.3f}", "1.00x", _gb(sim.network_bytes)])
    return rows


def _fp8_figures(case) -> dict | None:
    """What an FP8 block engine adds: the scales moved, the amax exchange among the
    trainer ranks (one all_reduce of 4 B per block split across them)."""
    fp8, plan = case["fp8"], case["plan"]
    if fp8 is None:
        return None
    return {"format": str(fp8.plan.fmt), "tensors": len(fp8.names),
            "scale_bytes": sum(t.dst.nbytes for t in plan.tensors
                               if t.name.endswith(SCALE_SUFFIX)),
            "engine_bytes": sum(t.dst.nbytes for t in plan.tensors),
            "amax_bytes_per_trainer_rank": fp8.plan.exchange_bytes,
            "shared_blocks": fp8.plan.num_shared}


def _fp8_line(f: dict) -> str:
    return (f"FP8 blocks {f['format']}: {f['tensors']} tensors quantized on the trainer; "
            f"scales {f['scale_bytes'] / 1e6:.1f} MB of the engine's "
            f"{_gb(f['engine_bytes'])}; amax exchange {f['amax_bytes_per_trainer_rank']} B "
            "per trainer rank "
            f"({f['shared_blocks']} blocks split across trainer ranks)")


def cmd_simulate(args: argparse.Namespace) -> int:
    cluster = get_cluster(args.cluster)
    budget = parse_bytes(args.budget)
    if args.sweep:
        return _cmd_sweep(args, cluster, budget)
    model = _model(args)
    case = run_case(model, args.src, args.dst, cluster, budget_bytes=budget,
                    dst_dtype=args.dst_dtype, separate=not args.shared_domains,
                    methods=_methods(args), changed=args.changed)
    sim: Simulation = case["sim"]
    if args.plot:
        plot_simulation(sim, args.plot, title=f"{model.name}: {args.src} -> {args.dst} on "
                                              f"{cluster.name}")
    if args.json:
        print(json.dumps({"model": model.name, "model_bytes": model.nbytes, "src": args.src,
                          "dst": args.dst, "cluster_params": asdict(cluster),
                          "plan_seconds": case["plan_seconds"],
                          "simulate_seconds": case["simulate_seconds"],
                          "plan_stats": case["plan"].stats().as_dict(), **sim.as_dict(),
                          **({"fp8": _fp8_figures(case)} if case["fp8"] else {})}))
        return 0
    print_table(f"predicted refit, {model.name} ({_gb(model.nbytes)}): {args.src} -> {args.dst} "
           f"on {cluster.name}", ["method", "seconds", "vs bound", "network bytes"], _rows(sim))
    for m, p in sim.predictions.items():
        print(f"  {m} bottleneck: {p.bottleneck}")
    print(f"  lower bound: {sim.lower_bound}")
    fp8 = _fp8_figures(case)
    if fp8 is not None:
        print(f"  {_fp8_line(fp8)}")
    print(f"planned {len(case['plan'])} tensors in {case['plan_seconds']:.2f} s, simulated "
          f"in {case['simulate_seconds']:.2f} s; cluster: {cluster.source}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _model(args: argparse.Namespace):
    from reshard.sim.models import preset, synthetic_model

    try:
        if args.model is None:
            return synthetic_model(parse_bytes(args.model_bytes), dtype=args.dtype)
        return preset(args.model, dtype=args.dtype)
    except ValueError as e:  # unknown preset or dtype: the same exit as other user errors
        raise SystemExit(f"reshard: error: {e}") from None


def _methods(args: argparse.Namespace) -> tuple[str, ...]:
    names = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in names if m not in SIM_METHODS]
    if unknown or not names:
        raise SystemExit(f"reshard: error: --methods expects some of {', '.join(SIM_METHODS)}, "
                         f"got {args.methods!r}")
    return names


def _cmd_sweep(args: argparse.Namespace, cluster, budget: int) -> int:
    methods = _methods(args)
    rows = sweep(args.sweep, args.src, args.dst, cluster, model=args.model, budget_bytes=budget,
                 dst_dtype=args.dst_dtype, dtype=args.dtype, methods=methods)
    if args.plot:
        plot_sweep(rows, args.sweep, args.plot, title=f"{args.src} -> {args.dst} on "
                                                       f"{cluster.name}")
    if args.json:
        print(json.dumps({"sweep": args.sweep, "cluster": cluster.name, "rows": rows}))
        return 0
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["model"], r["dst"], "", "", "", "", f"skipped: {r['skipped']}"])
            continue
        table.append([r["model"], r["dst"], str(r["gpus"]), _gb(r["model_bytes"]),
                      *(f"{r[m]:.3f}" for m in methods), f"{r['lower_bound_s']:.3f}"])
    print_table(f"sweep over {args.sweep} size on {cluster.name} (seconds)",
           ["model", "dst", "GPUs", "size", *methods, "lower bound"], table)
    return 0


def register(subparsers) -> None:
    """Add ``reshard simulate`` to the ``reshard`` command's subparsers."""
    s = subparsers.add_parser("simulate", help="predict refit time on a cluster preset")
    s.add_argument("--model", default=None, help="a model preset, e.g. deepseek-v3")
    s.add_argument("--model-bytes", default="1GiB", help="synthetic model size (no --model)")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--dst-dtype", default=None,
                   help="inference dtype when it differs: float8_e4m3fn is an FP8 block "
                        "engine (linear weights quantized in 128x128 blocks with float32 "
                        "scales on the trainer, shard by shard); another dtype is cast on send")
    s.add_argument("--src", required=True, help="trainer layout, e.g. pp16,ep16")
    s.add_argument("--dst", required=True, help="inference layout, e.g. tp8,dp16")
    s.add_argument("--cluster", default="dgx-h100",
                   help=f"{', '.join(CLUSTERS)}, custom:domain=8,intra=450,nic=45, or "
                        "PRESET:key=value overrides")
    s.add_argument("--budget", default="256MiB", help="staging budget per rank")
    s.add_argument("--shared-domains", action="store_true",
                   help="rank r sits in domain r // domain size (default: trainer and "
                        "inference fill separate domains)")
    s.add_argument("--methods", default=",".join(SIM_METHODS),
                   help="comma-separated methods to predict (default: all of "
                        f"{', '.join(SIM_METHODS)})")
    s.add_argument("--changed", type=float, default=None, metavar="F",
                   help="also predict a sparse refit (after the first) with this fraction "
                        "of the engine-dtype values changed, e.g. 0.01")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the byte matrix and link loads (or the sweep) to FILE.png")
    s.add_argument("--sweep", choices=("model", "cluster"), default=None,
                   help="predict over model presets, or over the inference side's dp")
    s.set_defaults(func=cmd_simulate)
