"""``reshard simulate``: predicted refit time of a model between two parallel layouts on a
cluster preset, for every method, with the bottleneck and the lower bound; optional
plots (byte matrix, link loads) and sweeps over model size or cluster size.

    reshard simulate --model deepseek-v3 --src pp16,ep16 --dst tp32,dp8 --cluster dgx-h100
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

from .cluster import CLUSTERS, get_cluster
from .costmodel import DEFAULT_BUDGET_BYTES, METHODS, Simulation, simulate

__all__ = ["register", "run_case", "sweep"]

_LINKS = (("nic_out", "NIC out"), ("nic_in", "NIC in"), ("intra_out", "fast out"),
          ("intra_in", "fast in"))


def run_case(model, src: str, dst: str, cluster, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
             dst_dtype: str | None = None, separate: bool = True) -> dict[str, Any]:
    """Plan ``model`` (a ModelSpec) from ``src`` to ``dst`` and simulate it on ``cluster``;
    returns the plan, the simulation and the timings."""
    from .plan import plan as make_plan
    from .specs import ParallelSpec, model_layouts

    cluster = get_cluster(cluster)
    t0 = time.perf_counter()
    src_spec = ParallelSpec.parse(src)
    src_layouts = model_layouts(model.tensors, src_spec)
    dst_layouts = model_layouts(model.tensors, dst, first_rank=src_spec.world_size,
                                dtype=dst_dtype)
    plan = make_plan(src_layouts, dst_layouts, allow_cast=dst_dtype is not None)
    t1 = time.perf_counter()
    ranks = cluster.place(*plan.ranks(), separate=separate)
    sim = simulate(plan, cluster, ranks=ranks, budget_bytes=budget_bytes)
    t2 = time.perf_counter()
    return {"plan": plan, "sim": sim, "plan_seconds": t1 - t0, "simulate_seconds": t2 - t1}


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


def cmd_simulate(args: argparse.Namespace) -> int:
    from .cli import _table, parse_bytes

    cluster = get_cluster(args.cluster)
    budget = parse_bytes(args.budget)
    if args.sweep:
        return _cmd_sweep(args, cluster, budget)
    model = _model(args)
    case = run_case(model, args.src, args.dst, cluster, budget_bytes=budget,
                    dst_dtype=args.dst_dtype, separate=not args.shared_domains)
    sim: Simulation = case["sim"]
    if args.plot:
        plot_simulation(sim, args.plot, title=f"{model.name}: {args.src} -> {args.dst} on "
                                              f"{cluster.name}")
    if args.json:
        print(json.dumps({"model": model.name, "model_bytes": model.nbytes, "src": args.src,
                          "dst": args.dst, "cluster_params": asdict(cluster),
                          "plan_seconds": case["plan_seconds"],
                          "simulate_seconds": case["simulate_seconds"],
                          "plan_stats": case["plan"].stats().as_dict(), **sim.as_dict()}))
        return 0
    _table(f"predicted refit, {model.name} ({_gb(model.nbytes)}): {args.src} -> {args.dst} "
           f"on {cluster.name}", ["method", "seconds", "vs bound", "network bytes"], _rows(sim))
    for m, p in sim.predictions.items():
        print(f"  {m} bottleneck: {p.bottleneck}")
    print(f"  lower bound: {sim.lower_bound}")
    print(f"planned {len(case['plan'])} tensors in {case['plan_seconds']:.2f} s, simulated "
          f"in {case['simulate_seconds']:.2f} s; cluster: {cluster.source}")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _model(args: argparse.Namespace):
    from .cli import parse_bytes
    from .models import preset, synthetic_model

    try:
        if args.model is None:
            return synthetic_model(parse_bytes(args.model_bytes), dtype=args.dtype)
        return preset(args.model, dtype=args.dtype)
    except ValueError as e:  # unknown preset or dtype: the same exit as other user errors
        raise SystemExit(f"reshard: error: {e}") from None


# ------------------------------------------------------------------------------ sweeps

SWEEP_MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "llama-3.1-70b", "qwen3-235b-a22b",
                "llama-3.1-405b", "deepseek-v3", "kimi-k2")


def sweep(kind: str, src: str, dst: str, cluster, *, model: str | None = None,
          budget_bytes: int = DEFAULT_BUDGET_BYTES, dst_dtype: str | None = None,
          dtype: str = "bfloat16") -> list[dict[str, Any]]:
    """Predicted times over model size (``kind="model"``: the presets that the two specs
    fit) or over cluster size (``kind="cluster"``: the inference side's dp doubled from 1
    up to its value in ``dst``, or up to 16 when it is 1)."""
    from .errors import LayoutError
    from .models import preset
    from .specs import AXES, ParallelSpec

    cases: list[tuple[str, str, str]] = []
    if kind == "model":
        cases = [(m, src, dst) for m in SWEEP_MODELS]
    elif kind == "cluster":
        spec = ParallelSpec.parse(dst)
        top = spec.dp if spec.dp > 1 else 16
        dps = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
        for dp in dps:
            sizes = dict(zip(AXES, spec.sizes), dp=dp)
            cases.append((model or "deepseek-v3", src,
                          ",".join(f"{a}{n}" for a, n in sizes.items() if n > 1) or "dp1"))
    else:
        raise ValueError(f"--sweep expects 'model' or 'cluster', got {kind!r}")
    out = []
    for name, s, d in cases:
        spec = preset(name, dtype=dtype)
        try:
            case = run_case(spec, s, d, cluster, budget_bytes=budget_bytes, dst_dtype=dst_dtype)
        except LayoutError as e:
            out.append({"model": name, "src": s, "dst": d, "skipped": str(e)})
            continue
        sim = case["sim"]
        gpus = sum(len(x) for x in case["plan"].ranks())
        out.append({"model": name, "src": s, "dst": d, "model_bytes": spec.nbytes,
                    "gpus": gpus, "lower_bound_s": sim.lower_bound_s,
                    **{m: p.seconds for m, p in sim.predictions.items()}})
    return out


def _cmd_sweep(args: argparse.Namespace, cluster, budget: int) -> int:
    from .cli import _table

    rows = sweep(args.sweep, args.src, args.dst, cluster, model=args.model, budget_bytes=budget,
                 dst_dtype=args.dst_dtype, dtype=args.dtype)
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
                      *(f"{r[m]:.3f}" for m in METHODS), f"{r['lower_bound_s']:.3f}"])
    _table(f"sweep over {args.sweep} size on {cluster.name} (seconds)",
           ["model", "dst", "GPUs", "size", *METHODS, "lower bound"], table)
    return 0


# ------------------------------------------------------------------------------- plots

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("reshard simulate --plot needs matplotlib: "
                         "pip install 'reshard[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def byte_matrix(sim: Simulation, max_blocks: int = 64):
    """(matrix of bytes, source block size, destination block size): the plan's bytes from
    each source rank (rows) to each destination rank (columns), ranks aggregated into
    blocks of consecutive ranks when a side has more than ``max_blocks``."""
    import numpy as np

    src, dst, nbytes = sim.pairs
    if not len(src):
        return np.zeros((1, 1)), 1, 1
    s_ranks, s_idx = np.unique(src, return_inverse=True)
    d_ranks, d_idx = np.unique(dst, return_inverse=True)
    s_block = -(-len(s_ranks) // max_blocks)
    d_block = -(-len(d_ranks) // max_blocks)
    out = np.zeros((-(-len(s_ranks) // s_block), -(-len(d_ranks) // d_block)))
    np.add.at(out, (s_idx // s_block, d_idx // d_block), nbytes)
    return out, s_block, d_block


def plot_simulation(sim: Simulation, path: str, *, title: str = "") -> None:
    """Byte matrix, the most loaded link per class and method, and per-NIC load."""
    import numpy as np

    plt = _pyplot()
    fig, (ax_m, ax_b, ax_n) = plt.subplots(1, 3, figsize=(17, 5))
    matrix, sb, db = byte_matrix(sim)
    im = ax_m.imshow(matrix / 1e9, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax_m, label="GB")
    ax_m.set_xlabel(f"destination rank block ({db} rank(s) each)")
    ax_m.set_ylabel(f"source rank block ({sb} rank(s) each)")
    ax_m.set_title("plan: bytes per rank pair")
    methods = list(sim.predictions)
    width = 0.8 / max(len(methods), 1)
    for k, m in enumerate(methods):
        loads = sim.predictions[m].loads
        values = [float(getattr(loads, f).max(initial=0)) / 1e9 for f, _ in _LINKS]
        ax_b.bar(np.arange(len(_LINKS)) + k * width, values, width,
                 label=f"{m} ({sim.predictions[m].seconds:.2f} s)")
        ax_n.plot(np.asarray(loads.nic_in) / 1e9, label=f"{m} in", lw=1)
    ax_b.set_xticks(np.arange(len(_LINKS)) + width * (len(methods) - 1) / 2,
                    [name for _, name in _LINKS])
    ax_b.set_yscale("log")
    ax_b.set_ylabel("most loaded link (GB, log scale)")
    ax_b.set_title(f"link loads (lower bound {sim.lower_bound_s:.2f} s)")
    ax_b.legend(fontsize=8)
    ax_n.set_xlabel("NIC")
    ax_n.set_ylabel("GB received")
    ax_n.set_title("network receive per NIC")
    ax_n.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], kind: str, path: str, *, title: str = "") -> None:
    plt = _pyplot()
    rows = [r for r in rows if "skipped" not in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["model_bytes"] / 1e9 if kind == "model" else r["gpus"] for r in rows]
    for m in [*METHODS, "lower_bound_s"]:
        ax.plot(x, [r[m] for r in rows], marker="o",
                label="lower bound" if m == "lower_bound_s" else m,
                ls="--" if m == "lower_bound_s" else "-")
    if kind == "model":
        for xi, r in zip(x, rows):
            ax.annotate(r["model"], (xi, r["reshard"]), fontsize=7, rotation=30)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model size (GB)" if kind == "model" else "GPUs (trainer + inference)")
    ax.set_ylabel("predicted refit time (s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------- cli

def register(subparsers) -> None:
    """Add ``reshard simulate`` to the ``reshard`` command's subparsers."""
    s = subparsers.add_parser("simulate", help="predict refit time on a cluster preset")
    s.add_argument("--model", default=None, help="a model preset, e.g. deepseek-v3")
    s.add_argument("--model-bytes", default="1GiB", help="synthetic model size (no --model)")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--dst-dtype", default=None,
                   help="inference dtype when it differs (e.g. float8_e4m3fn: cast on send)")
    s.add_argument("--src", required=True, help="trainer layout, e.g. pp16,ep16")
    s.add_argument("--dst", required=True, help="inference layout, e.g. tp8,dp16")
    s.add_argument("--cluster", default="dgx-h100",
                   help=f"{', '.join(CLUSTERS)}, custom:domain=8,intra=450,nic=45, or "
                        "PRESET:key=value overrides")
    s.add_argument("--budget", default="256MiB", help="staging budget per rank")
    s.add_argument("--shared-domains", action="store_true",
                   help="rank r sits in domain r // domain size (default: trainer and "
                        "inference fill separate domains)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the byte matrix and link loads (or the sweep) to FILE.png")
    s.add_argument("--sweep", choices=("model", "cluster"), default=None,
                   help="predict over model presets, or over the inference side's dp")
    s.set_defaults(func=cmd_simulate)
