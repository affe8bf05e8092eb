"""The rules of the Hugging Face -> vLLM mapping
(:mod:`reshard.integrations.vllm.mapping`): for one Hugging Face tensor, its
:class:`Slot` in a rank's logical vLLM tensor, its layout over the inference ranks and
that logical tensor's per-rank shape, each rule reading the config's sizes from a
:class:`RuleContext`.

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
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import MappingError
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.pieces import LocalView, Piece
from reshard.placement import Replicate, Shard, StridedShard

__all__ = [
    "CONVERSIONS", "MOE_BLOCKS", "RULES", "VOCAB_PADDING", "Rule", "RuleContext", "RuleOut",
    "Slot", "expert_count", "padded_vocab",
]


#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the vocabulary is padded to a multiple of it.
VOCAB_PADDING = 64


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING) -> int:
    """``ceil(vocab / padding) * padding`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab // padding) * padding


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
class RuleContext:
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


RuleOut = tuple[Slot, Layout, tuple[int, ...]]  # slot, layout, per-rank logical param shape
Rule = Callable[[re.Match, tuple[int, ...], RuleContext], RuleOut]


# --------------------------------------------------------------------------------- rules

def _qkv(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
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


def _gate_up(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """Dense gate/up weight or bias -> rows of ``gate_up_proj``: [gate | up]."""
    inter = c.per_rank(shape[0], f"{m['w']}_proj rows")
    start = 0 if m["w"] == "gate" else inter
    param = f"{m['p']}.gate_up_proj.{m['kind']}"
    return (Slot(param, rows=(start, start + inter)), c.sharded(shape, 0, "rows"),
            (2 * inter, *shape[1:]))


def _column(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """A column-parallel weight kept under its own name (output dim split)."""
    local = c.per_rank(shape[0], f"{m[0]} rows")
    return Slot(m[0]), c.sharded(shape, 0, "rows"), (local, *shape[1:])


def _row(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """A row-parallel weight (input dim split): o_proj, down_proj."""
    local = c.per_rank(shape[1], f"{m[0]} columns")
    return Slot(m[0]), c.sharded(shape, 1, "columns"), (shape[0], local)


def _replicated(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """Norms, routers, row-parallel biases: every rank holds the whole tensor."""
    return Slot(m[0]), c.replicated(shape), shape


def _float32_replicated(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """A replicated tensor vLLM keeps in float32 whatever the model dtype (DeepSeek-V3's
    router ``e_score_correction_bias``)."""
    return Slot(m[0]), Layout(tuple(shape), c.mesh, [Replicate()], "float32"), shape


def _vocab(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
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


def _moe_block(p: str, c: RuleContext) -> str:
    """vLLM's name of the MoE block HF calls ``p`` (``...mlp``; see :data:`MOE_BLOCKS`)."""
    block = MOE_BLOCKS.get(str(c.cfg.get("model_type")))
    return f"{p[:-len('.mlp')]}.{block}" if block and p.endswith(".mlp") else p


def _experts_params(p: str, c: RuleContext) -> tuple[str, str]:
    p = _moe_block(p, c)
    base = (f"{p}.experts.routed_experts", f"{p}.experts")  # vLLM 0.32 / older vLLM
    return (c.pick(*(f"{b}.w13_weight" for b in base)),
            c.pick(*(f"{b}.w2_weight" for b in base)))


def expert_count(cfg: Mapping[str, Any]) -> int | None:
    """The routed experts a (text) config names, under any family's key; None for a
    dense model."""
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    return int(n) if n else None


def _num_experts(c: RuleContext) -> int:
    n = expert_count(c.cfg)
    if not n:
        raise MappingError("the config names no expert count (num_experts)")
    return n


def _expert_w13(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """experts.{e}.gate_proj / up_proj (Mixtral's checkpoint: w1 / w3) -> w13[e] rows
    [gate | up] of this rank."""
    inter = c.per_rank(shape[0], "moe_intermediate_size")
    start = 0 if m["w"] in ("gate", "w1") else inter
    w13, _ = _experts_params(m["p"], c)
    return (Slot(w13, expert=int(m["e"]), rows=(start, start + inter)),
            c.sharded(shape, 0, "moe_intermediate_size"),
            (_num_experts(c), 2 * inter, shape[1]))


def _expert_w2(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """experts.{e}.down_proj (Mixtral's checkpoint: w2) -> w2[e] (its intermediate
    columns split)."""
    inter = c.per_rank(shape[1], "moe_intermediate_size")
    _, w2 = _experts_params(m["p"], c)
    return (Slot(w2, expert=int(m["e"])), c.sharded(shape, 1, "moe_intermediate_size"),
            (_num_experts(c), shape[0], inter))


def _fused_w13(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """transformers-5 ``experts.gate_up_proj`` [E, 2I, H] -> the whole w13 [E, 2I/tp, H]:
    each half (gate, up) split over the ranks, the two pieces stacked (a strided shard)."""
    e, two_i, h = shape
    inter = c.per_rank(two_i // 2, "moe_intermediate_size")
    w13, _ = _experts_params(m["p"], c)
    layout = Layout(shape, c.mesh, [StridedShard(1, 2) if c.tp > 1 else Replicate()],
                    c.dtype)
    return Slot(w13), layout, (e, 2 * inter, h)


def _fused_w2(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """transformers-5 ``experts.down_proj`` [E, H, I] -> the whole w2 [E, H, I/tp]."""
    e, h, i = shape
    _, w2 = _experts_params(m["p"], c)
    return Slot(w2), c.sharded(shape, 2, "moe_intermediate_size"), (e, h, c.per_rank(i, "I"))


def _router(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """A MoE router (``mlp.gate``), replicated, in vLLM's MoE block (:func:`_moe_block`)."""
    return Slot(f"{_moe_block(m['p'], c)}.gate.weight"), c.replicated(shape), shape


def _mla_qkv_a(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
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


def _q_proj(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """``q_proj``: into the fused ``qkv_proj``, or (MLA, no q low rank) column-parallel."""
    if m["w"] == "q" and c.cfg.get("kv_lora_rank"):
        return _column(m, shape, c)
    return _qkv(m, shape, c)


def _blocks_layout(shape: tuple[int, ...], sizes: Sequence[int], c: RuleContext, what: str
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


def _mamba_sizes(c: RuleContext) -> tuple[int, int, int]:
    """(intermediate size, B or C rows = groups x state, heads) of a Mamba2 mixer."""
    heads = int(c.cfg["mamba_num_heads"])
    inner = heads * int(c.cfg["mamba_head_dim"])
    groups = int(c.cfg["n_groups"])
    if groups % c.tp:
        raise MappingError(f"n_groups ({groups}) is not divisible by the tensor-parallel "
                           f"size {c.tp}: vLLM then replicates the groups (not mapped)")
    return inner, groups * int(c.cfg["ssm_state_size"]), heads


def _mamba_in_proj(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """Mamba2 ``in_proj`` rows [z | x | B | C | dt], each block split over the ranks."""
    inner, bc, heads = _mamba_sizes(c)
    layout = _blocks_layout(shape, (inner, inner, bc, bc, heads), c, "in_proj blocks")
    return Slot(m[0]), layout, layout.view(0).local_shape


def _mamba_conv(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
    """Mamba2 ``conv1d`` weight / bias over the channels [x | B | C], each split."""
    inner, bc, _ = _mamba_sizes(c)
    layout = _blocks_layout(shape, (inner, bc, bc), c, "conv1d channels")
    return Slot(m[0]), layout, layout.view(0).local_shape


def _mamba_a(m: re.Match, shape: tuple[int, ...], c: RuleContext) -> RuleOut:
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
