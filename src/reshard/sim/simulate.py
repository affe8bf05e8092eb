"""Predicted refit time of a model between two parallel layouts on a
cluster preset, for every method, with the bottleneck and the lower bound; optional
plots (byte matrix, link loads) and sweeps over model size or cluster size.
The command ``reshard simulate`` (:mod:`reshard.tools.simulate_cmd`) prints them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from reshard.defaults import DEFAULT_BUDGET_BYTES, SIM_METHODS
from reshard.errors import ConfigError
from reshard.quant.blocks import BlockFormat
from reshard.quant.targets import FP8, fp8_engine_layouts, plan_fp8_refit
from reshard.sim.cluster import get_cluster
from reshard.sim.costmodel import Simulation, simulate

__all__ = ["byte_matrix", "plot_simulation", "plot_sweep", "run_case", "sweep"]

_LINKS = (("nic_out", "NIC out"), ("nic_in", "NIC in"), ("intra_out", "fast out"),
          ("intra_in", "fast in"))


def run_case(model, src: str, dst: str, cluster, *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
             dst_dtype: str | None = None, separate: bool = True,
             methods: Sequence[str] = SIM_METHODS, changed: float | None = None
             ) -> dict[str, Any]:
    """Plan ``model`` (a ModelSpec) from ``src`` to ``dst`` and simulate it on ``cluster``;
    returns the plan, the simulation and the timings. ``dst_dtype="float8_e4m3fn"``: an
    FP8 block engine (its linear weights in FP8 with float32 scales, quantized shard by
    shard on the trainer; ``fp8`` then holds the plan of the amax exchange), any other
    dtype a plain cast. ``changed``: also a sparse refit's row (:mod:`reshard.sim.sparse`)."""
    from reshard import planner
    from reshard.sim.specs import ParallelSpec, model_layouts

    cluster = get_cluster(cluster)
    t0 = time.perf_counter()
    src_spec = ParallelSpec.parse(src)
    src_layouts = model_layouts(model.tensors, src_spec)
    fp8 = None
    if dst_dtype == FP8:
        dst_layouts = fp8_engine_layouts(model_layouts(model.tensors, dst,
                                                       first_rank=src_spec.world_size))
        sources = tuple(range(src_spec.world_size))
        src_layouts, fp8 = plan_fp8_refit(src_layouts, dst_layouts, BlockFormat(), sources,
                                          src_spec.world_size)
    else:
        dst_layouts = model_layouts(model.tensors, dst, first_rank=src_spec.world_size,
                                    dtype=dst_dtype)
    plan = planner.plan(src_layouts, dst_layouts, allow_cast=dst_dtype is not None)
    t1 = time.perf_counter()
    ranks = cluster.place(*plan.ranks(), separate=separate)
    sim = simulate(plan, cluster, ranks=ranks, budget_bytes=budget_bytes, methods=methods,
                   changed=changed)
    t2 = time.perf_counter()
    return {"plan": plan, "sim": sim, "plan_seconds": t1 - t0, "simulate_seconds": t2 - t1,
            "fp8": fp8}


# ------------------------------------------------------------------------------ sweeps

SWEEP_MODELS = ("llama-3.1-8b", "qwen3-30b-a3b", "llama-3.1-70b", "qwen3-235b-a22b",
                "llama-3.1-405b", "deepseek-v3", "kimi-k2")


def sweep(kind: str, src: str, dst: str, cluster, *, model: str | None = None,
          budget_bytes: int = DEFAULT_BUDGET_BYTES, dst_dtype: str | None = None,
          dtype: str = "bfloat16", methods: Sequence[str] = SIM_METHODS
          ) -> list[dict[str, Any]]:
    """Predicted times over model size (``kind="model"``: the presets that the two specs
    fit) or over cluster size (``kind="cluster"``: the inference side's dp doubled from 1
    up to its value in ``dst``, or up to 16 when it is 1)."""
    from reshard.errors import LayoutError
    from reshard.sim.models import preset
    from reshard.sim.specs import AXES, ParallelSpec

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
        raise ConfigError(f"--sweep expects 'model' or 'cluster', got {kind!r}")
    out = []
    for name, s, d in cases:
        spec = preset(name, dtype=dtype)
        try:
            case = run_case(spec, s, d, cluster, budget_bytes=budget_bytes, dst_dtype=dst_dtype,
                            methods=methods)
        except LayoutError as e:
            out.append({"model": name, "src": s, "dst": d, "skipped": str(e)})
            continue
        sim = case["sim"]
        gpus = sum(len(x) for x in case["plan"].ranks())
        out.append({"model": name, "src": s, "dst": d, "model_bytes": spec.nbytes,
                    "gpus": gpus, "lower_bound_s": sim.lower_bound_s,
                    **{m: p.seconds for m, p in sim.predictions.items()}})
    return out


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
    for m in [*(m for m in SIM_METHODS if rows and m in rows[0]), "lower_bound_s"]:
        ax.plot(x, [r[m] for r in rows], marker="o",
                label="lower bound" if m == "lower_bound_s" else m,
                ls="--" if m == "lower_bound_s" else "-")
    if kind == "model" and rows and "reshard" in rows[0]:
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
