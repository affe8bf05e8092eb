"""NeMo RL's hybrid refit, measured on Megatron-shaped trainer layouts, against everything
through reshard (and everything through gather-and-broadcast, for reference).

    python benchmarks/nemo_hybrid.py [--markdown] [--repeats 5] [--nodes 3]

The trainer is Megatron-Core shaped, pipeline 2 x tensor 2 (4 ranks), and each rank
holds only its Megatron tensors; the Hugging Face names are explicit layouts *into*
them, so nothing is copied or gathered to describe them:

* ``linear_qkv`` interleaved by query group (group g: its q heads, then k_g, then v_g;
  a TP rank holds a contiguous run of whole groups) -> ``q_proj`` / ``k_proj`` /
  ``v_proj``, three layouts over the same local tensor;
* ``linear_fc1`` = [gate shard; up shard] on each TP rank (dense layer) and per local
  expert ([gate; up], expert-parallel over the stage's two ranks, expert-TP 1) ->
  ``gate_proj`` / ``up_proj``; row-parallel ``linear_fc2`` / ``linear_proj`` ->
  ``down_proj`` / ``o_proj``; vocab-parallel embedding and output layer; norms, q/k
  norms and the router replicated; layers by pipeline stage.

The inference side is vLLM-shaped: tensor parallel 2, two replicas (4 ranks). NeMo RL's
hybrid sends the FFN projections (dense and routed experts, :func:`reshard.sim.nemo.
is_bulk`) shard to shard, then everything else (attention including q/k/v, norms,
router, embeddings) by gather-and-broadcast; the alternative sends every weight shard to
shard. Each is run on real gloo processes, every destination checked bit for bit, then
timed (median over ``--repeats``, a refit ends with its slowest rank). ``--nodes N``
(root) places the ranks on emulated nodes (network namespaces, ``--link-mbit`` per node:
trainer on the first, each inference replica on its own); without it all ranks share
one host and the domains are only declared to the planner.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from benchtools import slowest_median
from reshard import planner
from reshard.executor import Executor
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.pieces import LocalView, Piece
from reshard.placement import Replicate, Shard
from reshard.sim.models import TensorSpec
from reshard.sim.nemo import is_bulk
from reshard.sim.specs import model_layouts
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches
from reshard.topology import Topology, domain_schedule, link_bytes


@dataclass(frozen=True)
class Shape:
    """A small Qwen3-MoE-like model (bf16): one dense layer, then MoE layers."""

    hidden: int = 512
    heads: int = 8
    groups: int = 4          # query groups (kv heads)
    head_dim: int = 64
    dense_inter: int = 2048
    experts: int = 16
    moe_inter: int = 1024
    layers: int = 4
    vocab: int = 8192
    dtype: str = "bfloat16"


PP, TP = 2, 2                # trainer: ranks 0..3, stage s = ranks 2s, 2s + 1
DST = "dp2,tp2"              # inference: ranks 4..7


def hf_tensors(m: Shape) -> list[TensorSpec]:
    h, hd, dt = m.hidden, m.head_dim, m.dtype
    out = [TensorSpec("model.embed_tokens.weight", (m.vocab, h), dt)]
    for i in range(m.layers):
        p = f"model.layers.{i}"
        out += [TensorSpec(f"{p}.self_attn.q_proj.weight", (m.heads * hd, h), dt),
                TensorSpec(f"{p}.self_attn.k_proj.weight", (m.groups * hd, h), dt),
                TensorSpec(f"{p}.self_attn.v_proj.weight", (m.groups * hd, h), dt),
                TensorSpec(f"{p}.self_attn.o_proj.weight", (h, m.heads * hd), dt),
                TensorSpec(f"{p}.self_attn.q_norm.weight", (hd,), dt),
                TensorSpec(f"{p}.self_attn.k_norm.weight", (hd,), dt)]
        if i == 0:
            out += _mlp(f"{p}.mlp", h, m.dense_inter, dt)
        else:
            out.append(TensorSpec(f"{p}.mlp.gate.weight", (m.experts, h), dt))
            for e in range(m.experts):
                out += _mlp(f"{p}.mlp.experts.{e}", h, m.moe_inter, dt)
        out += [TensorSpec(f"{p}.input_layernorm.weight", (h,), dt),
                TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), dt)]
    out += [TensorSpec("model.norm.weight", (h,), dt),
            TensorSpec("lm_head.weight", (m.vocab, h), dt)]
    return out


def _mlp(prefix: str, h: int, inter: int, dt: str) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.gate_proj.weight", (inter, h), dt),
            TensorSpec(f"{prefix}.up_proj.weight", (inter, h), dt),
            TensorSpec(f"{prefix}.down_proj.weight", (h, inter), dt)]


# ------------------------------------------------------------ Megatron-shaped layouts

def _stage_ranks(layer: int, m: Shape) -> tuple[int, int]:
    stage = layer * PP // m.layers
    return (TP * stage, TP * stage + 1)


def _qkv(name: str, m: Shape, ranks: tuple[int, ...]) -> Layout:
    """One of q/k/v as pieces of each TP rank's ``linear_qkv`` (interleaved by group)."""
    hd, per_group = m.head_dim, m.heads // m.groups
    local_groups = m.groups // TP
    rows = (per_group + 2) * hd  # one group's rows in linear_qkv
    which = name.rsplit(".", 2)[-2][0]  # q, k or v
    views = {}
    for t, rank in enumerate(ranks):
        pieces = []
        for j in range(local_groups):
            g = t * local_groups + j
            if which == "q":
                glob, size, at = g * per_group * hd, per_group * hd, j * rows
            else:
                glob, size = g * hd, hd
                at = j * rows + (per_group + (which == "v")) * hd
            pieces.append(Piece((glob, 0), (size, m.hidden), (at, 0)))
        views[rank] = LocalView((local_groups * rows, m.hidden), tuple(pieces))
    shape = ((m.heads if which == "q" else m.groups) * hd, m.hidden)
    return Layout.explicit(shape, views, m.dtype)


def _gate_up(name: str, shape, ranks: tuple[int, ...], dtype: str) -> Layout:
    """gate or up as a piece of each rank's ``linear_fc1`` = [gate shard; up shard]."""
    rows = shape[0] // len(ranks)
    up = ".up_proj." in name
    views = {rank: LocalView((2 * rows, shape[1]),
                             (Piece((t * rows, 0), (rows, shape[1]), (rows * up, 0)),))
             for t, rank in enumerate(ranks)}
    return Layout.explicit(shape, views, dtype)


def megatron_layouts(m: Shape) -> dict[str, Layout]:
    out = {}
    for t in hf_tensors(m):
        parts = t.name.split(".")
        if t.name.startswith("model.layers."):
            layer = int(parts[2])
            ranks = _stage_ranks(layer, m)
        else:
            ranks = (0, 1) if "embed_tokens" in t.name else (TP * (PP - 1), TP * (PP - 1) + 1)
        if ".experts." in t.name:  # EP over the stage's two ranks, whole experts
            expert = int(parts[parts.index("experts") + 1])
            ranks = (ranks[expert * TP // m.experts],)
        if t.name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[t.name] = _qkv(t.name, m, ranks)
        elif t.name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[t.name] = _gate_up(t.name, t.shape, ranks, m.dtype)
        elif t.name.endswith(("down_proj.weight", "o_proj.weight")):
            out[t.name] = Layout(t.shape, Mesh(list(ranks)), [Shard(1)], m.dtype)
        elif t.name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[t.name] = Layout(t.shape, Mesh(list(ranks)), [Shard(0)], m.dtype)
        else:
            out[t.name] = Layout(t.shape, Mesh(list(ranks)), [Replicate()], m.dtype)
    return out


def plans(m: Shape):
    src = megatron_layouts(m)
    dst = model_layouts(hf_tensors(m), DST, first_rank=PP * TP)
    names = list(src)
    bulk = [n for n in names if is_bulk(n)]
    misc = [n for n in names if not is_bulk(n)]
    pick = lambda keep: planner.plan({n: src[n] for n in keep}, {n: dst[n] for n in keep})  # noqa: E731
    return {"all": pick(names), "bulk": pick(bulk), "misc": pick(misc)}


# ---------------------------------------------------------------------------- ranks

def _sources(plan, rank: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors, each HF name pointing into them (no copies): the
    pieces of q/k/v (and of gate/up) are written into one shared local tensor."""
    fused: dict[tuple, torch.Tensor] = {}
    out = {}
    for t in plan.tensors:
        if rank not in t.src.rank_set:
            continue
        local = fill_local(t.src, rank)
        key = _megatron_key(t.name)
        if key is None:
            out[t.name] = local
            continue
        buf = fused.setdefault(key, torch.zeros_like(local))
        buf += local  # disjoint pieces, zeros elsewhere
        out[t.name] = buf
    return out


def _megatron_key(name: str):
    """The Megatron tensor an HF name lives in, when several share one (else None)."""
    for fused, members in ((".linear_qkv", ("q_proj", "k_proj", "v_proj")),
                           (".linear_fc1", ("gate_proj", "up_proj"))):
        for part in members:
            if f".{part}.weight" in name:
                return name.replace(f".{part}.weight", fused)
    return None


def _worker(rank: int, world: int, m: Shape, repeats: int, domains: dict[int, int]) -> dict:
    from reshard.comm import Comm

    comm = Comm.from_group()
    topo = Topology(domains=domains)
    p = plans(m)
    src = _sources(p["all"], rank)
    assert all(src[t.name].data_ptr() == src[t.name.replace("q_proj", "k_proj")].data_ptr()
               for t in p["all"].tensors if rank in t.src.rank_set and "q_proj" in t.name)
    dst = {t.name: torch.zeros(t.dst.local_shape(rank), dtype=getattr(torch, t.dst.dtype))
           for t in p["all"].tensors if rank in t.dst.rank_set}

    def executor(part, method):
        return Executor(p[part], comm, method=method,
                        topology=topo if method == "reshard" else None)

    cases = {"hybrid (NeMo RL)": [("bulk", "reshard"), ("misc", "gather_broadcast")],
             "all reshard": [("all", "reshard")],
             "all gather_broadcast": [("all", "gather_broadcast")]}
    runs, result = {}, {}
    for case, steps in cases.items():
        exes = [(part, executor(part, method)) for part, method in steps]
        for tensor in dst.values():
            tensor.zero_()
        sent = {}
        for part, ex in exes:
            sent[part] = ex.run(src, dst).bytes_sent  # checked run
        ok = all(matches(t.dst, rank, dst[t.name]) for t in p["all"].tensors if t.name in dst)
        result[case] = {"ok": ok, "sent": sent, "times": [], "part_times": {}}
        runs[case] = exes
    for _ in range(repeats):
        for case, exes in runs.items():
            comm.barrier()
            t0 = time.perf_counter()
            for part, ex in exes:
                t1 = time.perf_counter()
                ex.run(src, dst, check=False)
                result[case]["part_times"].setdefault(part, []).append(
                    time.perf_counter() - t1)
            result[case]["times"].append(time.perf_counter() - t0)
    return result


# ---------------------------------------------------------------------------- driver

def domains_of(nodes: int) -> dict[int, int]:
    """Trainer on domain 0; each inference replica (2 ranks) on a domain of its own."""
    inference = {PP * TP + r: 1 + (r // TP if nodes != 2 else 0) for r in range(4)}
    return {0: 0, 1: 0, 2: 0, 3: 0, **inference}


def summarise(per_rank: list[dict], m: Shape, domains: dict[int, int]) -> dict:
    p = plans(m)
    topo = Topology(domains=domains)
    total = sum(t.src.numel * t.src.itemsize for t in p["all"].tensors)
    bulk = sum(t.src.numel * t.src.itemsize for t in p["bulk"].tensors)
    out = {"model_bytes": total, "bulk_bytes": bulk, "bulk_fraction": bulk / total,
           "cases": {}}
    inter = {part: link_bytes(domain_schedule(p[part], topo, 256 << 20), topo)["inter"]
             for part in ("all", "bulk")}
    for case in per_rank[0]:
        entries = [r[case] for r in per_rank]
        seconds = slowest_median(e["times"] for e in entries)
        parts = {part: slowest_median(e["part_times"][part] for e in entries)
                 for part in entries[0]["part_times"]}
        sent = {part: sum(e["sent"][part] for e in entries) for part in entries[0]["sent"]}
        out["cases"][case] = {"seconds": seconds, "part_seconds": parts, "bytes_sent": sent,
                              "verified": all(e["ok"] for e in entries)}
    out["reshard_inter_domain_bytes"] = inter
    return out


def run(m: Shape, repeats: int, nodes: int, link_mbit: float) -> dict:
    domains = domains_of(nodes)
    world = PP * TP + 4
    if nodes <= 0:
        per_rank = run_processes(_worker, world, m, repeats, domains, timeout=900)
    else:
        from functools import partial

        from reshard.tools.bench import enter_rank_namespace
        from reshard.tools.netns import EmulatedCluster

        with EmulatedCluster(nodes, rate_mbit=link_mbit) as cluster:
            names = {r: cluster.ns_name(d) for r, d in domains.items()}
            per_rank = run_processes(_worker, world, m, repeats, domains, timeout=900,
                                     setup=partial(enter_rank_namespace, names, None),
                                     master_addr=cluster.node_addr(0),
                                     env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    out = summarise(per_rank, m, domains)
    out.update(nodes=nodes, link_mbit=link_mbit if nodes else None, repeats=repeats)
    return out


def markdown(r: dict) -> str:
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    where = (f"{r['nodes']} emulated nodes, {r['link_mbit']:.0f} Mbit/s each" if r["nodes"]
             else "one host, gloo over loopback")
    lines = [f"Megatron-shaped pp2 x tp2 trainer -> vLLM-shaped tp2 x dp2, {mb(r['model_bytes'])}"
             f" bf16 ({r['bulk_fraction']:.1%} in FFN weights), {where}, median of "
             f"{r['repeats']}:", "",
             "| method | seconds | parts (s) | bytes sent | verified |", "|---|---:|---|---:|---|"]
    for case, c in r["cases"].items():
        parts = ", ".join(f"{k} {v:.3f}" for k, v in c["part_seconds"].items())
        sent = " + ".join(mb(v) for v in c["bytes_sent"].values())
        lines.append(f"| {case} | {c['seconds']:.3f} | {parts} | {sent} | "
                     f"{'yes' if c['verified'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=0, help="emulated nodes (root); 0: one host")
    ap.add_argument("--link-mbit", type=float, default=1000.0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    r = run(Shape(), args.repeats, args.nodes, args.link_mbit)
    print(markdown(r) if args.markdown else json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
