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

The mapping is a table of ``(regex, rule)`` pairs (:data:`RULES`); the table and the
families it covers are in :mod:`reshard.integrations.vllm.rules`, where a new family or
tensor kind is one more row.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from reshard.errors import MappingError
from reshard.integrations.vllm.fp8 import fp8_format, fp8_scale_entry, is_fp8_block
from reshard.integrations.vllm.rules import (
    CONVERSIONS,
    MOE_BLOCKS,
    RULES,
    VOCAB_PADDING,
    Rule,
    RuleContext,
    RuleOut,
    Slot,
    expert_count,
    padded_vocab,
)
from reshard.layout import Layout, dtype_itemsize, dtype_name
from reshard.quant.blocks import BlockFormat
from reshard.quant.targets import scale_name

__all__ = [
    "CHECKED_FAMILIES", "CONVERSIONS", "MOE_BLOCKS", "RULES", "UNCHECKED_FAMILIES_ENV",
    "UNMODELLED_CONFIG_FIELDS", "MappedTensor", "MappingError", "Slot", "VllmMapping",
    "check_family", "hf_to_vllm", "map_whole", "padded_vocab", "quant_format", "unmapped_sides",
    "VOCAB_PADDING",
]

#: The ``model_type``s whose refit into vLLM was checked end to end, bit for bit against a
#: fresh engine of the same step (tests/integration/test_vllm_families.py,
#: test_vllm_refit.py, test_megatron_refit.py): the rules are known to be whole for them.
CHECKED_FAMILIES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text",
    "deepseek_v3", "nemotron_h", "mixtral"})

#: The environment variable that, set to ``1``, lets a family outside
#: :data:`CHECKED_FAMILIES` be refitted (as ``unchecked_family_ok=True`` does).
UNCHECKED_FAMILIES_ENV = "RESHARD_UNCHECKED_FAMILIES"

ENGINE_INITIALISED = re.compile(r".*\.attn\.(q|k|v|prob)_scale$")
"""vLLM parameters the engine sets itself when the checkpoint has none: the attention
scales a quantized model's attention layers carry (KV-cache and FP8-attention scales),
1.0 unless a checkpoint gives them. With no trainer tensor for them a refit leaves them
as a fresh engine loaded from the trainer's checkpoint has them; one that the trainer
does send is mapped like any other tensor."""

#: Config fields under which vLLM's loader makes something else of the checkpoint than
#: the rules model, whatever the family (field -> why): refused even with the opt-in.
#: One value is modelled: an FP8 block ``quantization_config``
#: (:mod:`reshard.integrations.vllm.fp8`).
UNMODELLED_CONFIG_FIELDS = {
    "quantization_config": "a quantized checkpoint other than FP8 blocks: vLLM's loader "
                           "keeps quantized weights and scales the rules do not model",
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
        value = outer.get(field) or cfg.get(field)
        if value and not (field == "quantization_config" and is_fp8_block(value)):
            raise MappingError(f"{family or 'this model'}: the config sets {field} ({why}); "
                               "reshard cannot refit it")
    opted_in = unchecked_ok or os.environ.get(UNCHECKED_FAMILIES_ENV) == "1"
    quant = outer.get("quantization_config") or cfg.get("quantization_config")
    if quant and expert_count(cfg) and not opted_in:  # FP8 blocks ran end to end on a dense model
        raise MappingError(
            f"{family or 'this model'}: an FP8 block checkpoint with experts, whose refit "
            "into vLLM's FP8 MoE kernels was never checked end to end (the dense FP8 "
            "refit is: tests/integration/test_vllm_fp8.py, on a host with AMX); its "
            "mapping is checked against vLLM's FusedMoE loader. To refit it anyway, pass "
            f"unchecked_family_ok=True (or set {UNCHECKED_FAMILIES_ENV}=1) and check every "
            "refit with reshard_verify and against a fresh engine")
    if family in CHECKED_FAMILIES or opted_in:
        return family
    raise MappingError(
        f"model_type {family or None!r} is not among the families whose refit into vLLM "
        f"was checked end to end ({', '.join(sorted(CHECKED_FAMILIES))}): its names and "
        "shapes may all map while vLLM reads a weight through a copy or a transform the "
        "rules do not model, and the refit would land wrong without a word. To try it "
        "anyway, pass unchecked_family_ok=True to reshard_init (or ReshardInitInfo) or "
        f"set {UNCHECKED_FAMILIES_ENV}=1 in the engine's environment, then check every "
        "refit with reshard_verify and against a fresh engine")



@dataclass(frozen=True)
class MappedTensor:
    """One Hugging Face tensor: its global shape, its slot (the same on every rank under
    tensor parallelism) and its layout over the inference ranks."""

    name: str
    shape: tuple[int, ...]
    slot: Slot
    layout: Layout




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

    def allocate(self, rank: int, names: Iterable[str] | None = None, *, like: Any = None,
                 device: Any = None) -> dict[str, Any]:
        """Zero logical tensors (vLLM param -> tensor) for ``rank``, of every parameter or
        of ``names``: padding rows stay 0, as vLLM's loaders leave them."""
        import torch

        self._check_rank(rank)
        wanted = self.param_shapes if names is None else {p: self.param_shapes[p]
                                                          for p in names}
        return {p: torch.zeros(s, device=device, dtype=like if like is not None else
                               getattr(torch, self.param_dtypes.get(p, self.dtype)))
                for p, s in wanted.items()}

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
        """vLLM parameters that no HF tensor fills (but the ones the engine sets itself
        when no checkpoint tensor does, :data:`ENGINE_INITIALISED`)."""
        return sorted(p for p in set(logical_shapes) - set(self.param_shapes)
                      if not ENGINE_INITIALISED.match(p))

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
    ctx = RuleContext(cfg, tp, dtype_name(dtype), logical)
    fmt = quant_format(config)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in names:
        names.pop("lm_head.weight")  # tied: vLLM's lm_head is embed_tokens
    tensors: dict[str, MappedTensor] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in names.items():
        slot, layout, param_shape = _apply(rules, name, shape, ctx)
        fp8 = fmt and fp8_scale_entry(name, slot, layout, param_shape, fmt, logical)
        if fp8:  # the weight in FP8, and its weight_scale_inv beside it
            layout, (scale, scale_slot, scale_layout, scale_shape) = fp8
            _add(tensors, shapes, MappedTensor(scale, scale_layout.shape, scale_slot,
                                               scale_layout), scale_shape)
        _add(tensors, shapes, MappedTensor(name, shape, slot, layout), param_shape)
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


def map_whole(config: Any, tp: int, logical_shapes: Mapping[str, Sequence[int]],
              hf_tensors: Mapping[str, Sequence[int]], dtype: Any,
              engine: str = "vLLM") -> VllmMapping:
    """:func:`hf_to_vllm` of the trainer's tensors with every engine parameter filled;
    or a :class:`MappingError` naming the first unmapped tensor on each side (``engine``
    names the parameters' side: vLLM, or SGLang, whose parameters are vLLM's)."""
    try:
        mapping = hf_to_vllm(config, tp, logical_shapes, hf_tensors=hf_tensors, dtype=dtype)
    except MappingError as e:
        raise MappingError(f"{e}{unmapped_sides(config, tp, logical_shapes, hf_tensors)}"
                           ) from None
    uncovered = mapping.uncovered(logical_shapes)
    if uncovered:
        raise MappingError(f"{engine} parameters that no trainer tensor fills: {uncovered[:8]} "
                           f"(first: {uncovered[0]!r}); a refit would leave them unset"
                           f"{unmapped_sides(config, tp, logical_shapes, hf_tensors)}")
    return mapping


def quant_format(config: Any) -> BlockFormat | None:
    """The FP8 block format of an FP8 block checkpoint's config (None for an unquantized
    one): the engine's tensors the trainer quantizes on the way (``docs/fp8.md``)."""
    cfg = _plain_dict(config)
    return fp8_format(cfg.get("quantization_config")
                      or _config_dict(cfg).get("quantization_config"))


def _add(tensors: dict[str, MappedTensor], shapes: dict[str, tuple[int, ...]],
         t: MappedTensor, param_shape: tuple[int, ...]) -> None:
    slot, layout = t.slot, t.layout
    if shapes.setdefault(slot.param, param_shape) != param_shape:
        raise MappingError(f"{t.name}: vLLM parameter {slot.param} would be "
                           f"{list(param_shape)} here but {list(shapes[slot.param])} for "
                           "another tensor")
    if slot.shape(param_shape) != layout.view(0).local_shape:
        raise MappingError(f"{t.name}: slot {slot} of {list(param_shape)} does not fit the "
                           f"rank-local shape {list(layout.view(0).local_shape)}")
    tensors[t.name] = t


def unmapped_sides(config: Any, tp: int, logical_shapes: Mapping[str, Sequence[int]],
                   hf_tensors: Mapping[str, Sequence[int]],
                   rules: Sequence[tuple[re.Pattern[str], Rule]] = RULES) -> str:
    """A clause naming, on each side, the first tensor the rules leave unmapped: trainer
    tensors no rule matches, vLLM parameters no mapped trainer tensor reaches."""
    cfg = _config_dict(config)
    ctx = RuleContext(cfg, tp, "float32", None)
    quantized = quant_format(config) is not None
    no_rule, reached = [], set()
    for name, shape in hf_tensors.items():
        if not any(p.match(name) for p, _ in rules):
            no_rule.append(name)
            continue
        with contextlib.suppress(MappingError, KeyError, ValueError):
            param = _apply(rules, name, tuple(shape), ctx)[0].param
            reached.add(param)
            if quantized:  # an FP8 weight's scale travels with it
                reached.add(scale_name(param))
    tied = cfg.get("tie_word_embeddings") and "model.embed_tokens.weight" in reached
    unreached = sorted(p for p in logical_shapes if p not in reached
                       and not (tied and p == "lm_head.weight")
                       and not ENGINE_INITIALISED.match(p))
    parts = []
    if no_rule:
        parts.append(f"trainer tensors no rule maps: {len(no_rule)} (first: {no_rule[0]!r})")
    if unreached:
        parts.append(f"vLLM parameters no trainer tensor reaches: {len(unreached)} "
                     f"(first: {unreached[0]!r})")
    return ("; " + "; ".join(parts)) if parts else ""


def _apply(rules: Sequence[tuple[re.Pattern[str], Rule]], name: str, shape: tuple[int, ...],
           ctx: RuleContext) -> RuleOut:
    for pattern, rule in rules:
        m = pattern.match(name)
        if m:
            return rule(m, shape, ctx)
    raise MappingError(f"no rule maps the Hugging Face tensor {name!r} (shape {list(shape)}) "
                       "to vLLM; add one to reshard.integrations.vllm.mapping.RULES")


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
