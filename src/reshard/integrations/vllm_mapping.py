"""Hugging Face checkpoint names -> vLLM parameters, per tensor-parallel rank.

vLLM fuses and pads what a Hugging Face model keeps apart: ``q_proj``/``k_proj``/
``v_proj`` become one ``qkv_proj`` (rows ``[q | k | v]`` of this rank's heads),
``gate_proj``/``up_proj`` one ``gate_up_proj`` (``[gate | up]``), the routed experts of a
MoE block two 3-D tensors ``w13_weight`` (``[E, gate | up, hidden]``) and ``w2_weight``,
and the vocabulary is padded to a multiple of 64 before being split over ranks. This
module says, for every Hugging Face tensor and every inference rank:

* where it goes: a :class:`Slot`, i.e. a vLLM parameter name plus the view of that rank's
  *logical* (checkpoint-format, per-rank) vLLM tensor it fills -- a row range of
  ``qkv_proj`` / ``gate_up_proj``, an expert index and a row range of ``w13_weight``, an
  expert index of ``w2_weight``, or the whole tensor;
* which part of the full tensor that rank holds: a :class:`reshard.Layout` over the
  inference ranks ``0..tp-1`` (``Shard(0)`` for column-parallel weights, ``Shard(1)`` for
  row-parallel ones, replicated norms and routers, ``Layout.explicit`` for the padded
  vocabulary -- padding rows are covered by no piece -- and for key/value heads
  replicated over ranks when ``tp > num_key_value_heads``).

Writing ``layout.shard(full, rank)`` into ``slot.view(logical)`` for every tensor gives
exactly what vLLM's own weight loaders make of the full checkpoint on that rank, so a
:class:`reshard.refit.RefitReceiver` given :meth:`VllmMapping.targets` and
:attr:`VllmMapping.layouts` receives only its own bytes, fused parameters included.

The mapping is a table of ``(regex, rule)`` pairs (:data:`RULES`); a new family or
tensor kind is one more row. Llama, Mistral, Qwen2 (q/k/v biases), Qwen3
(``q_norm``/``k_norm``), Gemma 3 (four norms a layer), Qwen3-MoE (per-expert checkpoint
names *and* the fused ``experts.gate_up_proj`` / ``experts.down_proj`` parameters of
transformers 5), DeepSeek-V3 (MLA: ``q_a_proj`` + ``kv_a_proj_with_mqa`` into the
replicated ``fused_qkv_a_proj``, column-parallel ``q_b_proj`` / ``kv_b_proj``; shared
experts; the float32 router ``e_score_correction_bias``), NemotronH (Mamba2
``in_proj`` [z | x | B | C | dt] and ``conv1d`` [x | B | C], every block split over the
ranks; ``A`` = -exp(``A_log``) applied at commit, see :data:`CONVERSIONS`), Gemma 2 and
Mixtral (transformers 5's ``mlp`` router and fused experts, or the checkpoint's
``block_sparse_moe.experts.{e}.w1/w2/w3``, into vLLM's ``block_sparse_moe``) are covered;
expert parallelism and pipeline parallelism are not (vLLM's defaults: EP off, PP 1).

Names and shapes are not the whole story: a family can fill every vLLM parameter and
still refit wrong, if vLLM's model code reads a weight through a copy or a transform the
rules do not model (Gemma 2's logits come from a packed copy of the embedding). So the
refit integration accepts only the families whose refit was checked end to end against
a fresh engine (:data:`CHECKED_FAMILIES`) unless the caller opts in
(:func:`check_family`), and refuses configs whose loading the rules do not model at all
(:data:`UNMODELLED_CONFIG_FIELDS`).
Pure Python: no vLLM or transformers import.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from reshard.errors import MappingError
from reshard.layout import Layout, LocalView, Piece, dtype_itemsize, dtype_name
from reshard.mesh import Mesh
from reshard.placement import Replicate, Shard, StridedShard

__all__ = [
    "CHECKED_FAMILIES", "CONVERSIONS", "MOE_BLOCKS", "RULES", "UNCHECKED_FAMILIES_ENV",
    "UNMODELLED_CONFIG_FIELDS", "MappedTensor", "MappingError", "Slot", "VllmMapping",
    "check_family", "hf_to_vllm", "padded_vocab", "unmapped_sides", "VOCAB_PADDING",
]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it.
VOCAB_PADDING = 64


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    """``ceil(vocab / padding) * padding`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab // padding) * padding


#: The ``model_type``s whose refit into vLLM was checked end to end, bit for bit against a
#: fresh engine of the same step (tests/integration/test_vllm_families.py,
#: test_vllm_refit.py, test_megatron_refit.py): the rules are known to be whole for them.
CHECKED_FAMILIES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
    "deepseek_v3", "nemotron_h", "mixtral"})

#: The environment variable that, set to ``1``, lets a family outside
#: :data:`CHECKED_FAMILIES` be refitted (as ``unchecked_family_ok=True`` does).
UNCHECKED_FAMILIES_ENV = "RESHARD_UNCHECKED_FAMILIES"

#: Config fields under which vLLM's loader makes something else of the checkpoint than
#: the rules model, whatever the family (field -> why): refused even with the opt-in.
UNMODELLED_CONFIG_FIELDS = {
    "quantization_config": "a quantized checkpoint: vLLM's loader keeps quantized weights "
                           "and scales, the rules map unquantized tensors",
}


def check_family(config: Any, unchecked_ok: bool = False) -> str:
    """The config's ``model_type``, or a :class:`MappingError` when the refit is not known
    to be whole for it: a config field the rules do not model
    (:data:`UNMODELLED_CONFIG_FIELDS`), or a family outside :data:`CHECKED_FAMILIES`
    unless ``unchecked_ok`` or the environment variable ``RESHARD_UNCHECKED_FAMILIES=1``
    opts in (names and shapes may all match while vLLM's model code reads a weight
    through a copy or a transform the rules do not know: the refit would land wrong
    without a word)."""
    import os

    outer, cfg = _plain_dict(config), _config_dict(config)
    # the model's own type: a multimodal wrapper (Gemma 3's "gemma3") is not its text model
    family = str(outer.get("model_type") or "")
    for field, why in UNMODELLED_CONFIG_FIELDS.items():
        if outer.get(field) or cfg.get(field):
            raise MappingError(f"{family or 'this model'}: the config sets {field} ({why}); "
                               "reshard cannot refit it")
    if family in CHECKED_FAMILIES or unchecked_ok or os.environ.get(
            UNCHECKED_FAMILIES_ENV) == "1":
        return family
    raise MappingError(
        f"model_type {family or None!r} is not among the families whose refit into vLLM "
        f"was checked end to end ({', '.join(sorted(CHECKED_FAMILIES))}): its names and "
        "shapes may all map while vLLM reads a weight through a copy or a transform the "
        "rules do not model, and the refit would land wrong without a word. To try it "
        "anyway, pass unchecked_family_ok=True to reshard_init (or ReshardInitInfo) or "
        f"set {UNCHECKED_FAMILIES_ENV}=1 in the engine's environment, then check every "
        "refit with reshard_verify and against a fresh engine")


#: vLLM's name of a family's MoE block where it is not Hugging Face's ``mlp``
#: (model_type -> name): Mixtral's ``block_sparse_moe``.
MOE_BLOCKS = {"mixtral": "block_sparse_moe"}

#: Element-wise conversions vLLM's loaders apply to a checkpoint tensor (name -> what it
#: computes from the received float32 tensor): Mamba's ``A = -exp(A_log)``.
CONVERSIONS = {"neg_exp": "-exp(x)"}


@dataclass(frozen=True)
class Slot:
    """Where a Hugging Face tensor sits in one rank's logical vLLM tensor ``param``:
    ``tensor[expert]`` first when ``expert`` is set, then rows ``[rows[0], rows[1])``
    when ``rows`` is set; the whole tensor otherwise. ``convert`` names what vLLM's
    loader computes from the checkpoint tensor (:data:`CONVERSIONS`): the logical tensor
    then holds the checkpoint form, and the commit applies it."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    convert: str | None = None

    def view(self, tensor: Any) -> Any:
        """The view of ``tensor`` (the rank's logical ``param``) this slot names."""
        t = tensor if self.expert is None else tensor[self.expert]
        return t if self.rows is None else t[self.rows[0]:self.rows[1]]

    def shape(self, param_shape: Sequence[int]) -> tuple[int, ...]:
        shape = tuple(param_shape)[1:] if self.expert is not None else tuple(param_shape)
        if self.rows is not None:
            shape = (self.rows[1] - self.rows[0], *shape[1:])
        return shape


@dataclass(frozen=True)
class MappedTensor:
    """One Hugging Face tensor: its global shape, its slot (the same on every rank under
    tensor parallelism) and its layout over the inference ranks."""

    name: str
    shape: tuple[int, ...]
    slot: Slot
    layout: Layout


@dataclass(frozen=True)
class _Ctx:
    """What the rules need: the config's sizes, the TP size, dtype, vLLM's shapes."""

    cfg: Mapping[str, Any]
    tp: int
    dtype: str
    logical: Mapping[str, tuple[int, ...]] | None

    @property
    def mesh(self) -> Mesh:
        return Mesh(list(range(self.tp)))

    @property
    def hidden(self) -> int:
        return int(self.cfg["hidden_size"])

    @property
    def heads(self) -> int:
        return int(self.cfg["num_attention_heads"])

    @property
    def kv_heads(self) -> int:
        return int(self.cfg.get("num_key_value_heads") or self.heads)

    @property
    def head_dim(self) -> int:
        return int(self.cfg.get("head_dim") or self.hidden // self.heads)

    def per_rank(self, n: int, what: str) -> int:
        if n % self.tp:
            raise MappingError(f"{what} ({n}) is not divisible by the tensor-parallel size "
                               f"{self.tp} (vLLM requires it)")
        return n // self.tp

    def local_heads(self, n: int, what: str) -> int:
        """Heads per rank: n/tp, or 1 when heads are replicated (tp > n)."""
        if n >= self.tp:
            return self.per_rank(n, what)
        if self.tp % n:
            raise MappingError(f"tp={self.tp} is not a multiple of the {n} {what}")
        return 1

    def pick(self, *candidates: str) -> str:
        """The first candidate vLLM name present in the logical shapes (or the first)."""
        if self.logical is not None:
            for name in candidates:
                if name in self.logical:
                    return name
        return candidates[0]

    # -- layouts ----------------------------------------------------------------------
    def replicated(self, shape: Sequence[int]) -> Layout:
        return Layout(tuple(shape), self.mesh, [Replicate()], self.dtype)

    def sharded(self, shape: Sequence[int], dim: int, what: str) -> Layout:
        self.per_rank(shape[dim], what)
        return Layout(tuple(shape), self.mesh, [Shard(dim)], self.dtype)

    def heads_layout(self, shape: Sequence[int], n_heads: int, head_dim: int,
                     what: str) -> Layout:
        """Column-parallel over heads; when tp > heads, rank r holds head r // (tp/heads)."""
        if n_heads >= self.tp:
            return self.sharded(shape, 0, what)
        self.local_heads(n_heads, what)
        rep = self.tp // n_heads
        rest = tuple(shape[1:])
        views = {r: LocalView((head_dim, *rest), (Piece(((r // rep) * head_dim,) + (0,) * len(rest),
                                                          (head_dim, *rest),
                                                          (0,) * len(shape)),))
                 for r in range(self.tp)}
        return Layout.explicit(tuple(shape), views, self.dtype)


_RuleOut = tuple[Slot, Layout, tuple[int, ...]]  # slot, layout, per-rank logical param shape
Rule = Callable[[re.Match, tuple[int, ...], _Ctx], _RuleOut]


# --------------------------------------------------------------------------------- rules

def _qkv(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """q/k/v weight or bias -> rows of ``qkv_proj``: [q heads | k heads | v heads]."""
    which, kind = m["w"], m["kind"]
    hd = c.head_dim
    q = c.per_rank(c.heads, "num_attention_heads") * hd
    kv = c.local_heads(c.kv_heads, "key/value heads") * hd
    start = {"q": 0, "k": q, "v": q + kv}[which]
    size = q if which == "q" else kv
    heads = c.heads if which == "q" else c.kv_heads
    layout = c.heads_layout(shape, heads, hd, f"{which}_proj.{kind} rows")
    param = f"{m['p']}.qkv_proj.{kind}"
    return Slot(param, rows=(start, start + size)), layout, (q + 2 * kv, *shape[1:])


def _gate_up(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """Dense gate/up weight or bias -> rows of ``gate_up_proj``: [gate | up]."""
    inter = c.per_rank(shape[0], f"{m['w']}_proj rows")
    start = 0 if m["w"] == "gate" else inter
    param = f"{m['p']}.gate_up_proj.{m['kind']}"
    return (Slot(param, rows=(start, start + inter)), c.sharded(shape, 0, "rows"),
            (2 * inter, *shape[1:]))


def _column(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """A column-parallel weight kept under its own name (output dim split)."""
    local = c.per_rank(shape[0], f"{m[0]} rows")
    return Slot(m[0]), c.sharded(shape, 0, "rows"), (local, *shape[1:])


def _row(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """A row-parallel weight (input dim split): o_proj, down_proj."""
    local = c.per_rank(shape[1], f"{m[0]} columns")
    return Slot(m[0]), c.sharded(shape, 1, "columns"), (shape[0], local)


def _replicated(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """Norms, routers, row-parallel biases: every rank holds the whole tensor."""
    return Slot(m[0]), c.replicated(shape), shape


def _float32_replicated(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """A replicated tensor vLLM keeps in float32 whatever the model dtype (DeepSeek-V3's
    router ``e_score_correction_bias``)."""
    return Slot(m[0]), Layout(tuple(shape), c.mesh, [Replicate()], "float32"), shape


def _vocab(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """embed_tokens / lm_head: padded vocabulary split evenly; padding rows in no piece."""
    vocab, rest = shape[0], tuple(shape[1:])
    name = "model.embed_tokens.weight" if m[0] == "model.embeddings.weight" else m[0]
    if c.logical is not None and name in c.logical:
        per = c.logical[name][0]
    else:
        per = c.per_rank(padded_vocab(vocab), "padded vocabulary")
    if per * c.tp < vocab:
        raise MappingError(f"{name}: {c.tp} ranks of {per} rows cannot hold a vocabulary of "
                           f"{vocab}")
    views = {}
    for r in range(c.tp):
        lo, hi = min(r * per, vocab), min((r + 1) * per, vocab)
        pieces = ((Piece((lo,) + (0,) * len(rest), (hi - lo, *rest), (0,) * len(shape)),)
                  if hi > lo else ())
        views[r] = LocalView((per, *rest), pieces)
    return Slot(name), Layout.explicit(shape, views, c.dtype), (per, *rest)


def _moe_block(p: str, c: _Ctx) -> str:
    """vLLM's name of the MoE block HF calls ``p`` (``...mlp``; see :data:`MOE_BLOCKS`)."""
    block = MOE_BLOCKS.get(str(c.cfg.get("model_type")))
    return f"{p[:-len('.mlp')]}.{block}" if block and p.endswith(".mlp") else p


def _experts_params(p: str, c: _Ctx) -> tuple[str, str]:
    p = _moe_block(p, c)
    base = (f"{p}.experts.routed_experts", f"{p}.experts")  # vLLM 0.32 / older vLLM
    return (c.pick(*(f"{b}.w13_weight" for b in base)),
            c.pick(*(f"{b}.w2_weight" for b in base)))


def _num_experts(c: _Ctx) -> int:
    n = c.cfg.get("num_experts") or c.cfg.get("num_local_experts") or c.cfg.get(
        "n_routed_experts")
    if not n:
        raise MappingError("the config names no expert count (num_experts)")
    return int(n)


def _expert_w13(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """experts.{e}.gate_proj / up_proj (Mixtral's checkpoint: w1 / w3) -> w13[e] rows
    [gate | up] of this rank."""
    inter = c.per_rank(shape[0], "moe_intermediate_size")
    start = 0 if m["w"] in ("gate", "w1") else inter
    w13, _ = _experts_params(m["p"], c)
    return (Slot(w13, expert=int(m["e"]), rows=(start, start + inter)),
            c.sharded(shape, 0, "moe_intermediate_size"),
            (_num_experts(c), 2 * inter, shape[1]))


def _expert_w2(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """experts.{e}.down_proj (Mixtral's checkpoint: w2) -> w2[e] (its intermediate
    columns split)."""
    inter = c.per_rank(shape[1], "moe_intermediate_size")
    _, w2 = _experts_params(m["p"], c)
    return (Slot(w2, expert=int(m["e"])), c.sharded(shape, 1, "moe_intermediate_size"),
            (_num_experts(c), shape[0], inter))


def _fused_w13(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """transformers-5 ``experts.gate_up_proj`` [E, 2I, H] -> the whole w13 [E, 2I/tp, H]:
    each half (gate, up) split over the ranks, the two pieces stacked (a strided shard)."""
    e, two_i, h = shape
    inter = c.per_rank(two_i // 2, "moe_intermediate_size")
    w13, _ = _experts_params(m["p"], c)
    layout = Layout(shape, c.mesh, [StridedShard(1, 2) if c.tp > 1 else Replicate()],
                    c.dtype)
    return Slot(w13), layout, (e, 2 * inter, h)


def _fused_w2(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """transformers-5 ``experts.down_proj`` [E, H, I] -> the whole w2 [E, H, I/tp]."""
    e, h, i = shape
    _, w2 = _experts_params(m["p"], c)
    return Slot(w2), c.sharded(shape, 2, "moe_intermediate_size"), (e, h, c.per_rank(i, "I"))


def _router(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """A MoE router (``mlp.gate``), replicated, in vLLM's MoE block (:func:`_moe_block`)."""
    return Slot(f"{_moe_block(m['p'], c)}.gate.weight"), c.replicated(shape), shape


def _mla_qkv_a(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """MLA (DeepSeek-V2/V3): ``q_a_proj`` and ``kv_a_proj_with_mqa`` -> rows of vLLM's
    replicated ``fused_qkv_a_proj`` ([q_a | kv_a with rope]); without a q low-rank
    projection (``q_lora_rank`` None) ``kv_a_proj_with_mqa`` stays itself, replicated."""
    fused = f"{m['p']}.fused_qkv_a_proj.weight"
    q_rank = c.cfg.get("q_lora_rank")
    if not q_rank:
        return Slot(m[0]), c.replicated(shape), shape
    kv = int(c.cfg["kv_lora_rank"]) + int(c.cfg["qk_rope_head_dim"])
    rows = (0, int(q_rank)) if m["w"] == "q_a" else (int(q_rank), int(q_rank) + kv)
    return Slot(fused, rows=rows), c.replicated(shape), (int(q_rank) + kv, shape[1])


def _q_proj(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """``q_proj``: into the fused ``qkv_proj``, or (MLA, no q low rank) column-parallel."""
    if m["w"] == "q" and c.cfg.get("kv_lora_rank"):
        return _column(m, shape, c)
    return _qkv(m, shape, c)


def _blocks_layout(shape: tuple[int, ...], sizes: Sequence[int], c: _Ctx, what: str
                   ) -> Layout:
    """Rows made of consecutive blocks, each split evenly over the ranks; rank r holds
    its part of every block, in block order (vLLM's Mamba ``in_proj``, ``conv1d``)."""
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    locals_ = [c.per_rank(n, what) for n in sizes]
    views = {}
    for r in range(c.tp):
        pieces, start, at = [], 0, 0
        for size, local in zip(sizes, locals_):
            pieces.append(Piece((start + r * local, *zeros), (local, *rest), (at, *zeros)))
            start, at = start + size, at + local
        views[r] = LocalView((at, *rest), tuple(pieces))
    return Layout.explicit(shape, views, c.dtype)


def _mamba_sizes(c: _Ctx) -> tuple[int, int, int]:
    """(intermediate size, B or C rows = groups x state, heads) of a Mamba2 mixer."""
    heads = int(c.cfg["mamba_num_heads"])
    inner = heads * int(c.cfg["mamba_head_dim"])
    groups = int(c.cfg["n_groups"])
    if groups % c.tp:
        raise MappingError(f"n_groups ({groups}) is not divisible by the tensor-parallel "
                           f"size {c.tp}: vLLM then replicates the groups (not mapped)")
    return inner, groups * int(c.cfg["ssm_state_size"]), heads


def _mamba_in_proj(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """Mamba2 ``in_proj`` rows [z | x | B | C | dt], each block split over the ranks."""
    inner, bc, heads = _mamba_sizes(c)
    layout = _blocks_layout(shape, (inner, inner, bc, bc, heads), c, "in_proj blocks")
    return Slot(m[0]), layout, layout.view(0).local_shape


def _mamba_conv(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """Mamba2 ``conv1d`` weight / bias over the channels [x | B | C], each split."""
    inner, bc, _ = _mamba_sizes(c)
    layout = _blocks_layout(shape, (inner, bc, bc), c, "conv1d channels")
    return Slot(m[0]), layout, layout.view(0).local_shape


def _mamba_a(m: re.Match, shape: tuple[int, ...], c: _Ctx) -> _RuleOut:
    """``A_log`` -> vLLM's ``A = -exp(A_log)``, split over heads; sent in float32 (vLLM
    computes it in float32 from the checkpoint tensor, then casts)."""
    local = c.per_rank(shape[0], "mamba_num_heads")
    layout = Layout(shape, c.mesh, [Shard(0)], "float32")
    return Slot(f"{m['p']}.A", convert="neg_exp"), layout, (local, *shape[1:])


#: ``(pattern, rule)``, first match wins. Patterns see the full Hugging Face name.
RULES: list[tuple[re.Pattern[str], Rule]] = [
    (re.compile(r"^(?P<p>.+\.(self_attn|mixer))\.(?P<w>[qkv])_proj\.(?P<kind>weight|bias)$"),
     _q_proj),
    (re.compile(r"^(?P<p>.+\.mixer)\.in_proj\.weight$"), _mamba_in_proj),
    (re.compile(r"^(?P<p>.+\.mixer)\.conv1d\.(weight|bias)$"), _mamba_conv),
    (re.compile(r"^(?P<p>.+\.mixer)\.A_log$"), _mamba_a),
    (re.compile(r"^.+\.mixer\.(D|dt_bias|norm\.weight|up_proj\.weight)$"), _column),
    (re.compile(r"^(?P<p>.+\.self_attn)\.(?P<w>q_a|kv_a)_proj(_with_mqa)?\.weight$"),
     _mla_qkv_a),
    (re.compile(r"^.+\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"), _column),
    (re.compile(r"^(?P<p>.+\.mlp)\.experts\.(?P<e>\d+)\.(?P<w>gate|up)_proj\.weight$"),
     _expert_w13),
    (re.compile(r"^(?P<p>.+\.mlp)\.experts\.(?P<e>\d+)\.down_proj\.weight$"), _expert_w2),
    (re.compile(r"^(?P<p>.+\.block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<w>w1|w3)\.weight$"),
     _expert_w13),  # Mixtral's checkpoint names
    (re.compile(r"^(?P<p>.+\.block_sparse_moe)\.experts\.(?P<e>\d+)\.w2\.weight$"), _expert_w2),
    (re.compile(r"^(?P<p>.+\.mlp)\.experts\.gate_up_proj$"), _fused_w13),
    (re.compile(r"^(?P<p>.+\.mlp)\.experts\.down_proj$"), _fused_w2),
    (re.compile(r"^(?P<p>.+\.mlp(\.shared_experts?)?)\.(?P<w>gate|up)_proj\.(?P<kind>weight|bias)$"),
     _gate_up),
    (re.compile(r"^.+\.(o_proj|down_proj|out_proj)\.weight$"), _row),
    (re.compile(r"^.+\.(o_proj|down_proj)\.bias$"), _replicated),
    (re.compile(r"^(model\.embed_tokens|model\.embeddings|lm_head)\.weight$"), _vocab),
    (re.compile(r"^.+\.(q_norm|k_norm|q_a_layernorm|kv_a_layernorm|input_layernorm|"
                r"post_attention_layernorm|pre_feedforward_layernorm|"
                r"post_feedforward_layernorm)\.weight$"), _replicated),
    (re.compile(r"^model\.(norm|norm_f)\.weight$"), _replicated),
    (re.compile(r"^.+\.layers\.\d+\.norm\.weight$"), _replicated),  # NemotronH
    (re.compile(r"^(?P<p>.+\.mlp)\.gate\.weight$"), _router),  # MoE router
    (re.compile(r"^.+\.block_sparse_moe\.gate\.weight$"), _replicated),  # Mixtral's
    (re.compile(r"^.+\.mlp\.gate\.e_score_correction_bias$"), _float32_replicated),
]


# ------------------------------------------------------------------------------ mapping

class VllmMapping:
    """The mapping of one model at one tensor-parallel size (see the module docstring)."""

    def __init__(self, tensors: Mapping[str, MappedTensor],
                 param_shapes: Mapping[str, tuple[int, ...]], tp: int, dtype: str) -> None:
        self.tensors = dict(tensors)
        self.param_shapes = dict(param_shapes)  # vLLM param -> per-rank logical shape
        self.tp, self.dtype = tp, dtype
        #: vLLM param -> dtype of its logical tensor (the model dtype but for float32
        #: exceptions) and -> the conversion its commit applies (:data:`CONVERSIONS`)
        self.param_dtypes = {t.slot.param: t.layout.dtype for t in self.tensors.values()}
        self.converts = {t.slot.param: t.slot.convert for t in self.tensors.values()
                         if t.slot.convert}

    def __repr__(self) -> str:
        return (f"VllmMapping({len(self.tensors)} HF tensors -> {len(self.param_shapes)} "
                f"vLLM parameters, tp={self.tp}, {self.dtype})")

    @property
    def layouts(self) -> dict[str, Layout]:
        """HF name -> layout over the inference ranks (``RefitReceiver(layouts=...)``)."""
        return {n: t.layout for n, t in self.tensors.items()}

    def slots(self, rank: int) -> dict[str, Slot]:
        """HF name -> where it lands in ``rank``'s logical vLLM tensors."""
        self._check_rank(rank)
        return {n: t.slot for n, t in self.tensors.items()}

    def allocate(self, rank: int, *, like: Any = None, device: Any = None) -> dict[str, Any]:
        """Zero logical tensors (vLLM param -> tensor) for ``rank``: padding rows stay 0,
        as vLLM's loaders leave them."""
        import torch

        self._check_rank(rank)
        return {p: torch.zeros(s, device=device, dtype=like if like is not None else
                               getattr(torch, self.param_dtypes.get(p, self.dtype)))
                for p, s in self.param_shapes.items()}

    def targets(self, rank: int, params: Mapping[str, Any]) -> dict[str, Any]:
        """HF name -> view into ``params`` (vLLM param -> ``rank``'s logical tensor):
        ``RefitReceiver(targets=...)``."""
        out = {}
        for name, slot in self.slots(rank).items():
            base = params[slot.param]
            if tuple(base.shape) != self.param_shapes[slot.param]:
                raise MappingError(f"{slot.param}: logical tensor of shape {list(base.shape)}, "
                                   f"the mapping expects {list(self.param_shapes[slot.param])}")
            out[name] = slot.view(base)
        return out

    def load_full(self, state_dict: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """``rank``'s logical vLLM tensors built from a full HF state dict through the
        layouts (what a refit delivers); a reference, with no vLLM involved."""
        import torch

        params = self.allocate(rank)
        with torch.no_grad():
            for name, view in self.targets(rank, params).items():
                view.copy_(self.tensors[name].layout.shard(state_dict[name], rank))
        return params

    def shard_bytes(self, rank: int) -> int:
        """Bytes ``rank`` holds of the HF tensors: what a refit must deliver to it."""
        self._check_rank(rank)
        return sum(sum(p.numel for p in t.layout.view(rank).pieces)
                   * dtype_itemsize(t.layout.dtype) for t in self.tensors.values())

    def uncovered(self, logical_shapes: Iterable[str]) -> list[str]:
        """vLLM parameters that no HF tensor fills."""
        return sorted(set(logical_shapes) - set(self.param_shapes))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.tp:
            raise MappingError(f"rank {rank} is outside the inference ranks 0..{self.tp - 1}")


def _plain_dict(config: Any) -> dict[str, Any]:
    """A plain config dict from a dict, a :class:`reshard.sim.models.ModelSpec` or anything
    with ``to_dict()`` (a transformers config)."""
    if hasattr(config, "tensors") and hasattr(config, "config"):
        config = config.config
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return dict(config)


def _config_dict(config: Any) -> dict[str, Any]:
    """:func:`_plain_dict`, a multimodal ``text_config`` unwrapped."""
    cfg = _plain_dict(config)
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = dict(cfg["text_config"])
    if "num_experts" not in cfg and cfg.get("num_local_experts"):
        cfg["num_experts"] = cfg["num_local_experts"]  # transformers 5 writes this key
    return cfg


def _hf_tensors(config: Any, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from reshard.sim.models import model_from_config

    spec = config if hasattr(config, "tensors") else model_from_config(cfg)
    return {t.name: tuple(t.shape) for t in spec.tensors}


def hf_to_vllm(config: Any, tp: int, logical_shapes: Mapping[str, Sequence[int]] | None = None,
               *, hf_tensors: Mapping[str, Sequence[int]] | None = None,
               dtype: Any = "bfloat16", rules: Sequence[tuple[re.Pattern[str], Rule]] = RULES,
               ) -> VllmMapping:
    """The HF -> vLLM mapping of ``config`` at tensor-parallel size ``tp``.

    ``config``: an HF config dict, a transformers config or a ``ModelSpec``.
    ``logical_shapes``: vLLM's per-rank logical parameter shapes (vLLM name -> shape);
    when given, every shape the rules derive is checked against it and the vLLM names
    are picked from it. ``hf_tensors``: the HF names and global shapes the trainer holds
    (for example transformers 5's fused expert tensors); defaults to the checkpoint
    names of ``config`` (:func:`reshard.sim.models.model_from_config`). ``dtype``: vLLM's
    parameter dtype (the trainer may hold another one; the sender casts).
    """
    if tp < 1:
        raise MappingError(f"tp must be >= 1, got {tp}")
    cfg = _config_dict(config)
    names = ({n: tuple(s) for n, s in hf_tensors.items()} if hf_tensors is not None
             else _hf_tensors(config, cfg))
    logical = ({n: tuple(s) for n, s in logical_shapes.items()}
               if logical_shapes is not None else None)
    ctx = _Ctx(cfg, tp, dtype_name(dtype), logical)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in names:
        names.pop("lm_head.weight")  # tied: vLLM's lm_head is embed_tokens
    tensors: dict[str, MappedTensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in names.items():
        slot, layout, param_shape = _apply(rules, name, shape, ctx)
        if shapes.setdefault(slot.param, param_shape) != param_shape:
            raise MappingError(f"{name}: vLLM parameter {slot.param} would be "
                               f"{list(param_shape)} here but {list(shapes[slot.param])} for "
                               "another tensor")
        if slot.shape(param_shape) != layout.view(0).local_shape:
            raise MappingError(f"{name}: slot {slot} of {list(param_shape)} does not fit the "
                               f"rank-local shape {list(layout.view(0).local_shape)}")
        tensors[name] = MappedTensor(name, shape, slot, layout)
    if logical is not None:
        bad = [(p, s, logical.get(p)) for p, s in shapes.items() if logical.get(p) != s]
        if bad:
            p, s, got = bad[0]
            raise MappingError(f"vLLM parameter {p}: the mapping expects a per-rank logical "
                               f"shape {list(s)}, vLLM has "
                               f"{'none' if got is None else list(got)}"
                               f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}")
    _check_filled(tensors, shapes)
    return VllmMapping(tensors, shapes, tp, ctx.dtype)


def unmapped_sides(config: Any, tp: int, logical_shapes: Mapping[str, Sequence[int]],
                   hf_tensors: Mapping[str, Sequence[int]],
                   rules: Sequence[tuple[re.Pattern[str], Rule]] = RULES) -> str:
    """A clause naming, on each side, the first tensor the rules leave unmapped: trainer
    tensors no rule matches, vLLM parameters no mapped trainer tensor reaches."""
    cfg = _config_dict(config)
    ctx = _Ctx(cfg, tp, "float32", None)
    no_rule, reached = [], set()
    for name, shape in hf_tensors.items():
        if not any(p.match(name) for p, _ in rules):
            no_rule.append(name)
            continue
        with contextlib.suppress(MappingError, KeyError, ValueError):
            reached.add(_apply(rules, name, tuple(shape), ctx)[0].param)
    tied = cfg.get("tie_word_embeddings") and "model.embed_tokens.weight" in reached
    unreached = sorted(p for p in logical_shapes if p not in reached
                       and not (tied and p == "lm_head.weight"))
    parts = []
    if no_rule:
        parts.append(f"trainer tensors no rule maps: {len(no_rule)} (first: {no_rule[0]!r})")
    if unreached:
        parts.append(f"vLLM parameters no trainer tensor reaches: {len(unreached)} "
                     f"(first: {unreached[0]!r})")
    return ("; " + "; ".join(parts)) if parts else ""


def _apply(rules: Sequence[tuple[re.Pattern[str], Rule]], name: str, shape: tuple[int, ...],
           ctx: _Ctx) -> _RuleOut:
    for pattern, rule in rules:
        m = pattern.match(name)
        if m:
            return rule(m, shape, ctx)
    raise MappingError(f"no rule maps the Hugging Face tensor {name!r} (shape {list(shape)}) "
                       "to vLLM; add one to reshard.integrations.vllm_mapping.RULES")


def _check_filled(tensors: Mapping[str, MappedTensor],
                  shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every vLLM parameter is filled exactly once, apart from vocabulary padding."""
    filled = dict.fromkeys(shapes, 0)
    for t in tensors.values():
        s = t.slot.shape(shapes[t.slot.param])
        filled[t.slot.param] += prod(s)
    for param, shape in shapes.items():
        if filled[param] != prod(shape):
            raise MappingError(f"vLLM parameter {param} ({list(shape)}) is filled by "
                               f"{filled[param]} of its {prod(shape)} elements: a tensor of "
                               "the fused group is missing or given twice")
