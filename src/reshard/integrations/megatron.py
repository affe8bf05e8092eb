"""Megatron-Core trainers: their parameters as Hugging Face tensors, shard by shard.

:func:`refit_params` takes a live Megatron-Core ``GPTModel`` (its pipeline / virtual
pipeline chunks) and returns ``(params, layouts)`` for
:class:`reshard.refit.RefitSender`: Hugging Face names, each mapped to the Megatron
parameter itself (no copy, no gather) and a :class:`reshard.Layout` that describes
Megatron's memory as it is, over every rank of the trainer:

* column-parallel weights (``Shard(0)`` rows), row-parallel ones (columns), vocab-parallel
  embedding and output layer (contiguous row blocks; the trainer's vocabulary padding is
  covered by no piece, so it is never sent);
* ``linear_qkv``, interleaved by query group (group g: its q heads, then k_g, then v_g;
  each TP rank a run of whole groups): three HF tensors ``q_proj`` / ``k_proj`` /
  ``v_proj`` (and their biases) whose pieces point into the same local tensor;
* ``linear_fc1`` = ``[gate shard; up shard]`` on each TP rank: ``gate_proj`` / ``up_proj``;
* pipeline and virtual pipeline stages: each layer's global index is its Megatron
  ``layer_number`` (stage-local names are renamed); embedding on the first stage, final
  norm and output layer on the last; with tied embeddings the first stage's embedding
  is sent (the last stage's copy is Megatron's own replica for its gradient);
* expert parallelism: local expert i of EP rank e is global expert ``e * E_local + i``,
  under the ``SequentialMLP`` names (``local_experts.i.linear_fc1``) and the grouped-GEMM
  names (``experts.linear_fc1.weight{i}``); expert TP splits each expert like a dense MLP;
  the router and shared experts too;
* data-parallel copies are replicas (equal boxes on several ranks): the planner spreads
  the senders over them.

The rules are a table (:data:`MEGATRON_TO_HF`, Megatron name -> HF tensors) over plain data
(:class:`Coords`), so they are tested without processes; :data:`FAMILIES` says which
Hugging Face families (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE) a model must match, and
what does not fit raises :class:`reshard.MappingError` on every rank before any byte
moves. Megatron-Core is imported only by :func:`refit_params` (its parallel state).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import MappingError
from reshard.layout import Layout, dtype_name
from reshard.pieces import LocalView, Piece

__all__ = ["FAMILIES", "MEGATRON_TO_HF", "Coords", "Entry", "Family", "check_family", "hf_entries",
           "refit_params"]


@dataclass(frozen=True)
class Coords:
    """What the rules need: the model's sizes and this rank's place in Megatron's grid."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    """The real (Hugging Face) vocabulary; rows past it are the trainer's padding."""
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    local_experts: int = 0
    """Experts each EP rank holds (MoE models)."""
    tied: bool = False
    first_stage: bool = True


@dataclass(frozen=True)
class Entry:
    """One Hugging Face tensor (global ``shape``) and the pieces of it this rank holds."""

    name: str
    shape: tuple[int, ...]
    view: LocalView


def _rows(shape: Sequence[int], runs: Sequence[tuple[int, int, int]]) -> LocalView:
    """A local tensor of ``shape`` holding global rows ``[g, g + n)`` at local row ``l``
    for each run ``(g, n, l)``; every other dim whole."""
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    return LocalView(tuple(shape), tuple(Piece((g, *zeros), (n, *rest), (local, *zeros))
                                         for g, n, local in runs if n))


def _whole(shape: Sequence[int]) -> LocalView:
    return LocalView(tuple(shape), (Piece((0,) * len(shape), tuple(shape), (0,) * len(shape)),))


def _cols(shape: Sequence[int], start: int) -> LocalView:
    """Row-parallel: the local tensor is global columns ``[start, start + shape[1])``."""
    return LocalView(tuple(shape), (Piece((0, start), tuple(shape), (0, 0)),))


_RuleOut = list[Entry]
Rule = Callable[[re.Match, tuple[int, ...], Coords], _RuleOut]
_L = r"^decoder\.layers\.(?P<l>\d+)\."
_HF = "model.layers.{l}."


def _vocab(hf: str) -> Rule:
    def rule(m, shape, c):
        if hf == "lm_head.weight" and c.tied and not c.first_stage:
            return []  # the tied copy of the last stage: the first stage sends the tensor
        per = shape[0]
        if per * c.tp_size < c.vocab:
            raise MappingError(f"{m.string}: {c.tp_size} ranks x {per} rows hold fewer than "
                               f"the vocabulary of {c.vocab}")
        start = c.tp_rank * per
        real = max(0, min(per, c.vocab - start))
        return [Entry(hf, (c.vocab, *shape[1:]), _rows(shape, [(start, real, 0)]))]
    return rule


def _replicated(hf: str) -> Rule:
    return lambda m, shape, c: [Entry(hf.format(**m.groupdict()), shape, _whole(shape))]


def _qkv(m: re.Match, shape: tuple[int, ...], c: Coords) -> _RuleOut:
    """``linear_qkv`` rows: per query group g of this rank, [q heads of g | k_g | v_g]."""
    if c.groups % c.tp_size or c.heads % c.groups:
        raise MappingError(f"{m.string}: {c.groups} query groups of {c.heads} heads do not "
                           f"split over {c.tp_size} tensor-parallel ranks")
    qpg, hd, local_groups = c.heads // c.groups, c.head_dim, c.groups // c.tp_size
    if shape[0] != local_groups * (qpg + 2) * hd:
        raise MappingError(f"{m.string}: local shape {list(shape)}, expected "
                           f"{local_groups * (qpg + 2) * hd} rows ({local_groups} groups of "
                           f"{qpg} q + 1 k + 1 v heads of {hd})")
    runs: dict[str, list[tuple[int, int, int]]] = {"q": [], "k": [], "v": []}
    for j in range(local_groups):
        g, base = c.tp_rank * local_groups + j, j * (qpg + 2) * hd
        runs["q"].append((g * qpg * hd, qpg * hd, base))
        runs["k"].append((g * hd, hd, base + qpg * hd))
        runs["v"].append((g * hd, hd, base + (qpg + 1) * hd))
    rows = {"q": c.heads * hd, "k": c.groups * hd, "v": c.groups * hd}
    prefix = _HF.format(l=m["l"]) + "self_attn."
    return [Entry(f"{prefix}{w}_proj.{m['kind']}", (rows[w], *shape[1:]), _rows(shape, runs[w]))
            for w in "qkv"]


def _gate_up(hf_prefix: str, *, expert_tp: bool = False) -> Rule:
    """``linear_fc1`` = [gate shard; up shard] of this (expert-)TP rank."""
    def rule(m, shape, c):
        rank, size = (c.etp_rank, c.etp_size) if expert_tp else (c.tp_rank, c.tp_size)
        if shape[0] % 2:
            raise MappingError(f"{m.string}: {shape[0]} rows cannot be [gate; up] halves")
        half = shape[0] // 2
        name = hf_prefix.format(e=_expert(m, c), **m.groupdict())
        full = (half * size, *shape[1:])
        return [Entry(f"{name}gate_proj.weight", full, _rows(shape, [(rank * half, half, 0)])),
                Entry(f"{name}up_proj.weight", full, _rows(shape, [(rank * half, half, half)]))]
    return rule


def _row(hf: str, *, expert_tp: bool = False) -> Rule:
    """Row-parallel: the local tensor is a block of the global input columns."""
    def rule(m, shape, c):
        rank, size = (c.etp_rank, c.etp_size) if expert_tp else (c.tp_rank, c.tp_size)
        name = hf.format(e=_expert(m, c), **m.groupdict())
        return [Entry(name, (shape[0], shape[1] * size), _cols(shape, rank * shape[1]))]
    return rule


def _expert(m: re.Match, c: Coords) -> int | None:
    """Global index of the local expert the name carries (``i`` -> ep_rank * E_local + i)."""
    i = m.groupdict().get("i")
    return None if i is None else c.ep_rank * c.local_experts + int(i)


_EXP = _HF + "mlp.experts.{e}."
#: Megatron parameter name (layer numbers global) -> rule giving the HF tensors
MEGATRON_TO_HF: list[tuple[str, Rule]] = [
    (r"^embedding\.word_embeddings\.weight$", _vocab("model.embed_tokens.weight")),
    (r"^output_layer\.weight$", _vocab("lm_head.weight")),
    (r"^decoder\.final_layernorm\.weight$", _replicated("model.norm.weight")),
    (_L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$",
     _replicated(_HF + "input_layernorm.weight")),
    (_L + r"self_attention\.linear_qkv\.(?P<kind>weight|bias)$", _qkv),
    (_L + r"self_attention\.linear_proj\.weight$", _row(_HF + "self_attn.o_proj.weight")),
    (_L + r"self_attention\.(?P<w>q|k)_layernorm\.weight$",
     _replicated(_HF + "self_attn.{w}_norm.weight")),
    (_L + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)$",
     _replicated(_HF + "post_attention_layernorm.weight")),
    (_L + r"mlp\.linear_fc1\.weight$", _gate_up(_HF + "mlp.")),
    (_L + r"mlp\.linear_fc2\.weight$", _row(_HF + "mlp.down_proj.weight")),
    (_L + r"mlp\.router\.weight$", _replicated(_HF + "mlp.gate.weight")),
    (_L + r"mlp\.experts\.local_experts\.(?P<i>\d+)\.linear_fc1\.weight$",
     _gate_up(_EXP, expert_tp=True)),
    (_L + r"mlp\.experts\.local_experts\.(?P<i>\d+)\.linear_fc2\.weight$",
     _row(_EXP + "down_proj.weight", expert_tp=True)),
    (_L + r"mlp\.experts\.linear_fc1\.weight(?P<i>\d+)$", _gate_up(_EXP, expert_tp=True)),
    (_L + r"mlp\.experts\.linear_fc2\.weight(?P<i>\d+)$",
     _row(_EXP + "down_proj.weight", expert_tp=True)),
    (_L + r"mlp\.shared_experts\.linear_fc1\.weight$", _gate_up(_HF + "mlp.shared_expert.")),
    (_L + r"mlp\.shared_experts\.linear_fc2\.weight$",
     _row(_HF + "mlp.shared_expert.down_proj.weight")),
    (_L + r"mlp\.shared_experts\.gate_weight$",
     _replicated(_HF + "mlp.shared_expert_gate.weight")),
]
_COMPILED = [(re.compile(p), rule) for p, rule in MEGATRON_TO_HF]


def hf_entries(name: str, local_shape: Sequence[int], coords: Coords) -> list[Entry]:
    """The HF tensors one Megatron parameter holds pieces of, on this rank. ``name`` has
    global layer numbers (``decoder.layers.{global}.``); plain data, no processes."""
    shape = tuple(int(n) for n in local_shape)
    for pattern, rule in _COMPILED:
        m = pattern.match(name)
        if m:
            return rule(m, shape, coords)
    raise MappingError(f"Megatron parameter {name!r} has no Hugging Face rule (supported: "
                       "the GPT layers of Llama / Qwen2 / Qwen3 / Qwen3-MoE; no MLA, Mamba "
                       "or linear biases)")


# ------------------------------------------------------------------------------ families

@dataclass(frozen=True)
class Family:
    """The Megatron features a Hugging Face family has (the rest must be off)."""

    qk_norm: bool = False
    qkv_bias: bool = False
    moe: bool = False
    shared_experts: bool = False


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "qwen3_moe": Family(qk_norm=True, moe=True),
    "qwen2_moe": Family(qkv_bias=True, moe=True, shared_experts=True),
}


def check_family(config: Any, family: str) -> None:
    """Raise MappingError unless a Megatron ``TransformerConfig`` is a ``family`` model."""
    fam = FAMILIES.get(family)
    if fam is None:
        raise MappingError(f"unknown family {family!r}; expected one of {sorted(FAMILIES)}")
    has = {"qk_layernorm": bool(getattr(config, "qk_layernorm", False)),
           "add_qkv_bias": bool(getattr(config, "add_qkv_bias", False)),
           "num_moe_experts": bool(getattr(config, "num_moe_experts", None)),
           "moe_shared_expert_intermediate_size": bool(
               getattr(config, "moe_shared_expert_intermediate_size", None))}
    want = {"qk_layernorm": fam.qk_norm, "add_qkv_bias": fam.qkv_bias,
            "num_moe_experts": fam.moe, "moe_shared_expert_intermediate_size": fam.shared_experts,
            "gated_linear_unit": True, "add_bias_linear": False,
            "multi_latent_attention": False, "normalization": "RMSNorm"}
    for key in ("gated_linear_unit", "add_bias_linear", "multi_latent_attention",
                "normalization"):
        has[key] = getattr(config, key, want[key])
    bad = [f"{k}={has[k]!r} (expected {want[k]!r})" for k in want if has[k] != want[k]]
    if bad:
        raise MappingError(f"the Megatron model is not a {family} model: " + ", ".join(bad))


# --------------------------------------------------------------------------- live model

def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _global_names(chunk: Any) -> list[tuple[str, Any]]:
    """``(name, param)`` with ``decoder.layers.{i}`` renamed to the layer's global index
    (``layer_number - 1``: pipeline and virtual-pipeline offsets included)."""
    offsets = {str(i): str(layer.layer_number - 1) for i, layer in
               enumerate(getattr(chunk.decoder, "layers", []))} if hasattr(chunk, "decoder") else {}
    out = []
    for name, p in chunk.named_parameters():
        m = re.match(r"^decoder\.layers\.(\d+)\.", name)
        if m:
            name = f"decoder.layers.{offsets[m.group(1)]}.{name[m.end():]}"
        out.append((name, p))
    return out


def _coords(config: Any, vocab_size: int, first_stage: bool, tied: bool) -> Coords:
    from megatron.core import parallel_state as ps

    experts = config.num_moe_experts or 0
    return Coords(
        hidden=config.hidden_size, heads=config.num_attention_heads,
        groups=config.num_query_groups or config.num_attention_heads,
        head_dim=config.kv_channels or config.hidden_size // config.num_attention_heads,
        vocab=vocab_size, tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(), tied=tied,
        first_stage=first_stage,
        local_experts=experts // ps.get_expert_model_parallel_world_size())


def _local(chunks: Sequence[Any], family: str, vocab_size: int
           ) -> tuple[dict[str, Any], dict[str, tuple]]:
    """This rank's HF tensors: name -> Megatron parameter, name -> (shape, dtype, view)."""
    tensors: dict[str, Any] = {}
    table: dict[str, tuple] = {}
    for chunk in chunks:
        chunk = _unwrap(chunk)
        config = chunk.config
        check_family(config, family)
        coords = _coords(config, vocab_size, bool(getattr(chunk, "pre_process", True)),
                         bool(getattr(chunk, "share_embeddings_and_output_weights", False)))
        for name, p in _global_names(chunk):
            for e in hf_entries(name, tuple(p.shape), coords):
                tensors[e.name] = p
                table[e.name] = (e.shape, dtype_name(p.dtype), e.view)
    return tensors, table


def refit_params(model: Any, *, family: str, vocab_size: int, group: Any = None
                 ) -> tuple[dict[str, Any], dict[str, Layout]]:
    """``(params, layouts)`` of a Megatron-Core model for :class:`RefitSender`.

    ``model``: this rank's model chunk, or the list of its (virtual) pipeline chunks;
    ``family``: a key of :data:`FAMILIES`; ``vocab_size``: the real vocabulary (Megatron
    holds it padded). Collective over ``group`` (default: the whole trainer world; group
    rank = trainer rank): every rank learns every rank's pieces (metadata only, one
    object gather), so each can describe every tensor over the whole trainer. A problem
    on any rank raises the same MappingError on every rank."""
    import torch.distributed as dist

    chunks = list(model) if isinstance(model, list | tuple) else [model]
    try:
        tensors, table = _local(chunks, family, vocab_size)
        mine: Any = table
    except MappingError as e:
        tensors, mine = {}, f"{type(e).__name__}: {e}"
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    problems = [(r, t) for r, t in enumerate(every) if isinstance(t, str)]
    if problems:
        raise MappingError(f"trainer rank {problems[0][0]}: {problems[0][1]}; nothing was moved")
    return tensors, _layouts(every)


def _layouts(every: Sequence[Mapping[str, tuple]]) -> dict[str, Layout]:
    """One explicit layout per HF tensor from every rank's ``(shape, dtype, view)``."""
    shapes: dict[str, tuple] = {}
    views: dict[str, dict[int, LocalView]] = {}
    for rank, table in enumerate(every):
        for name, (shape, dtype, view) in table.items():
            if shapes.setdefault(name, (shape, dtype)) != (shape, dtype):
                raise MappingError(f"{name}: trainer rank {rank} says shape {list(shape)} "
                                   f"{dtype}, another rank {list(shapes[name][0])} "
                                   f"{shapes[name][1]}")
            views.setdefault(name, {})[rank] = view
    return {name: Layout.explicit(shapes[name][0], views[name], shapes[name][1])
            for name in sorted(views)}
