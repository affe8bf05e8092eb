"""Planning cost at DeepSeek-V3 scale: 256-rank trainer -> 128-rank inference, on one core.

    python benchmarks/plan_deepseek.py [--json] [--repeat N]

Trainer (ranks 0..255): PP=16 (layers split into contiguous stages, torch.chunk-style;
embedding on stage 0, final norm and lm_head on the last stage). Each 16-rank stage is a
2-D mesh (ep/dp=8, tp=2): attention and dense/shared-MLP weights are Megatron TP-sharded
over tp (column-parallel Shard(0), row-parallel Shard(1), norms and router replicated)
and replicated over dp; routed expert e of a layer lives on EP rank e // 32 of its stage,
TP-sharded over that EP rank's tp pair (its Layout mesh is just those 2 ranks).

Inference (ranks 256..383): TP8 x DP16, mesh [[256..263], [264..271], ...], placements
[Replicate(), Shard(col/row)] for every matrix (experts included), norms replicated.

Prints the number of tensors, the cold first planning run, then the best of ``--repeat``
warm runs (plan and stats timed separately), and the plan's statistics.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import reshard as R
from benchtools import timed
from reshard.placement import chunk_bounds
from reshard.sim.models import ModelSpec, preset

PP, EP, TP = 16, 8, 2  # trainer: 16 stages of (ep/dp=8) x (tp=2) = 256 ranks
INF_TP, INF_DP, INF_FIRST = 8, 16, 256  # inference: ranks 256..383

COLUMN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj",
          "embed_tokens", "lm_head")
ROW = ("o_proj", "down_proj")


def tp_dim(name: str) -> int | None:
    """The dim tensor parallelism shards (0 column-parallel, 1 row-parallel), or None."""
    parts = name.split(".")
    if len(parts) < 2 or name.endswith("e_score_correction_bias"):
        return None
    module = parts[-2]
    if module in COLUMN:
        return 0
    if module in ROW:
        return 1
    return None  # norms, router (mlp.gate), biases


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else None


def expert_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[5]) if len(parts) > 5 and parts[4] == "experts" else None


class LayoutCache:
    """One Mesh object per rank group and one Layout per (shape, mesh, placements), so
    identical tensors share layouts (and their cached per-rank views)."""

    def __init__(self) -> None:
        self.meshes: dict[str, R.Mesh] = {}
        self.layouts: dict[tuple, R.Layout] = {}

    def mesh(self, ranks: list) -> R.Mesh:
        key = repr(ranks)
        mesh = self.meshes.get(key)
        if mesh is None:
            mesh = self.meshes[key] = R.Mesh(ranks)
        return mesh

    def layout(self, shape: tuple[int, ...], dtype: str, mesh: R.Mesh, placements: tuple):
        key = (shape, dtype, id(mesh), placements)
        lay = self.layouts.get(key)
        if lay is None:
            lay = self.layouts[key] = R.Layout(shape, mesh, placements, dtype)
        return lay


def trainer_layouts(model: ModelSpec, cache: LayoutCache) -> dict[str, R.Layout]:
    layers = model.num_layers
    stage_of_layer = {}
    for s in range(PP):
        lo, hi = chunk_bounds(layers, PP, s)
        for i in range(lo, hi):
            stage_of_layer[i] = s

    def stage_ranks(s: int) -> list[list[int]]:
        base = s * EP * TP
        return [[base + e * TP + t for t in range(TP)] for e in range(EP)]

    stage_mesh = [cache.mesh(stage_ranks(s)) for s in range(PP)]
    expert_mesh = [[cache.mesh(pair) for pair in stage_ranks(s)] for s in range(PP)]
    n_experts = model.config["n_routed_experts"]
    out = {}
    for t in model.tensors:
        layer = layer_of(t.name)
        if layer is not None:
            stage = stage_of_layer[layer]
        elif t.name.startswith("model.embed_tokens"):
            stage = 0
        else:  # model.norm, lm_head
            stage = PP - 1
        d = tp_dim(t.name)
        tp_place = R.Replicate() if d is None else R.Shard(d)
        e = expert_of(t.name)
        if e is not None:
            mesh = expert_mesh[stage][e // (n_experts // EP)]  # its EP rank's tp pair
            out[t.name] = cache.layout(t.shape, t.dtype, mesh, (tp_place,))
        else:
            out[t.name] = cache.layout(t.shape, t.dtype, stage_mesh[stage],
                                       (R.Replicate(), tp_place))
    return out


def inference_layouts(model: ModelSpec, cache: LayoutCache) -> dict[str, R.Layout]:
    mesh = cache.mesh([[INF_FIRST + d * INF_TP + t for t in range(INF_TP)]
                       for d in range(INF_DP)])
    out = {}
    for t in model.tensors:
        d = tp_dim(t.name)
        tp_place = R.Replicate() if d is None else R.Shard(d)
        out[t.name] = cache.layout(t.shape, t.dtype, mesh, (R.Replicate(), tp_place))
    return out


def build(model: ModelSpec):
    cache = LayoutCache()
    return trainer_layouts(model, cache), inference_layouts(model, cache), cache




def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: min(r[k] for r in runs) for k in ("wall", "cpu")}


def _sum(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] + b[k] for k in a}


def run(repeat: int) -> dict:
    torch.set_num_threads(1)
    model = preset("deepseek-v3")
    build_t, (src, dst, cache) = timed(lambda: build(model))

    # cold: the first planning of fresh layouts (templates built, per-rank views computed)
    cold_plan, p = timed(lambda: R.plan(src, dst))
    cold_stats, stats = timed(p.stats)
    warm_plan, warm_stats, warm_total = [], [], []
    for i in range(repeat + 1):  # run 0 is a warm-up
        plan_t, q = timed(lambda: R.plan(src, dst))
        stats_t, _ = timed(q.stats)
        del q
        if i:
            warm_plan.append(plan_t)
            warm_stats.append(stats_t)
            warm_total.append(_sum(plan_t, stats_t))
    templates = len({id(t.template) for t in p.tensors})
    expert_tensors = sum(expert_of(t.name) is not None for t in model.tensors)
    return {
        "model": model.name, "tensors": len(p), "expert_tensors": expert_tensors,
        "model_bytes": model.nbytes, "src_ranks": PP * EP * TP, "dst_ranks": INF_TP * INF_DP,
        "distinct_layouts": len(cache.layouts), "templates": templates,
        "build_layouts_s": build_t,
        "cold": {"plan_s": cold_plan, "stats_s": cold_stats,
                 "total_s": _sum(cold_plan, cold_stats)},
        "warm_best": {"plan_s": _best(warm_plan), "stats_s": _best(warm_stats),
                      "total_s": _best(warm_total)},
        "repeat": repeat,
        "stats": stats.as_dict(),
        "send_balance": stats.send_balance,
        "recv_balance": (stats.max_recv_bytes / stats.recv_lower_bound
                         if stats.recv_lower_bound else 1.0),
        "sent_over_gather_broadcast": stats.bytes_sent / stats.gather_broadcast_bytes,
        "sent_over_gather_broadcast_wire": (stats.bytes_sent
                                            / stats.gather_broadcast_wire_bytes),
    }


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB"


def _t(t: dict[str, float]) -> str:
    return f"{t['wall']:.3f} s (cpu {t['cpu']:.3f})"


def report(r: dict) -> str:
    s = r["stats"]
    cold, warm = r["cold"], r["warm_best"]
    lines = [
        f"{r['model']}: {r['tensors']:,} tensors ({r['expert_tensors']:,} routed-expert), "
        f"{_gb(r['model_bytes'])}; {r['src_ranks']} trainer ranks -> {r['dst_ranks']} "
        f"inference ranks",
        f"  {r['distinct_layouts']} distinct Layout objects, {r['templates']} plan templates; "
        f"building the layouts {_t(r['build_layouts_s'])}",
        f"  cold (first run):  plan {_t(cold['plan_s'])} + stats {_t(cold['stats_s'])}"
        f" = {_t(cold['total_s'])}",
        f"  warm (best of {r['repeat']}): plan {_t(warm['plan_s'])} + stats "
        f"{_t(warm['stats_s'])}; best plan+stats {_t(warm['total_s'])}",
        f"  bytes sent         {_gb(s['bytes_sent'])} in {s['num_messages']:,} remote regions"
        f" (local copies {_gb(s['bytes_local'])})",
        f"  max send / rank    {_gb(s['max_send_bytes'])} vs lower bound "
        f"{_gb(s['send_lower_bound'])} (send_balance {r['send_balance']:.4f})",
        f"  max recv / rank    {_gb(s['max_recv_bytes'])} vs lower bound "
        f"{_gb(s['recv_lower_bound'])} (recv_balance {r['recv_balance']:.4f})",
        f"  gather-broadcast   {_gb(s['gather_broadcast_bytes'])} payload (2x model), "
        f"{_gb(s['gather_broadcast_wire_bytes'])} on the wire",
        f"  sent / gather-broadcast payload = {r['sent_over_gather_broadcast']:.3f}; "
        f"sent / its wire bytes = {r['sent_over_gather_broadcast_wire']:.4f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--repeat", type=int, default=3, help="warm runs after one warm-up")
    args = ap.parse_args(argv)
    result = run(max(1, args.repeat))
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
