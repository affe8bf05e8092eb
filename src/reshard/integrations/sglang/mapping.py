"""Hugging Face checkpoint names -> SGLang parameters, per tensor-parallel rank.

SGLang fuses, pads and shards as vLLM does, with the same names: ``qkv_proj`` (rows
``[q | k | v]`` of this rank's heads), ``gate_up_proj`` (``[gate | up]``), MoE
``w13_weight`` / ``w2_weight``, and a vocabulary padded to a multiple of 64 before it is
split over the ranks (``VocabParallelEmbedding``, ``ParallelLMHead``). So the table of
:mod:`reshard.integrations.vllm.rules` maps it; what differs is where the per-rank shapes
come from: SGLang's CPU parameters are the loaded tensors themselves (no repacking on a
host without AMX), so their ``named_parameters`` shapes are the logical shapes the rules
check. :func:`hf_to_sglang` is that mapping, every SGLang parameter filled, or a
:class:`MappingError` naming what is left on each side.

As for vLLM, a family can fill every parameter and still refit wrong; the refit accepts
only the families checked end to end against a fresh SGLang engine
(:data:`SGLANG_CHECKED_FAMILIES`) unless the caller opts in. Pure Python: no SGLang import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from reshard.errors import MappingError
from reshard.integrations.vllm.mapping import UNCHECKED_FAMILIES_ENV, VllmMapping, map_whole

__all__ = ["SGLANG_CHECKED_FAMILIES", "check_family", "hf_to_sglang"]

#: The ``model_type``s whose refit into SGLang was checked end to end, bit for bit against
#: a fresh SGLang engine of the same step (tests/integration/test_sglang_refit.py).
SGLANG_CHECKED_FAMILIES = frozenset({"llama", "qwen3"})


def _family(config: Any) -> tuple[str, dict[str, Any]]:
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return str(cfg.get("model_type") or ""), cfg


def check_family(config: Any, unchecked_ok: bool = False) -> str:
    """The config's ``model_type``, or a :class:`MappingError` when its refit into SGLang
    was never checked end to end (unless ``unchecked_ok`` or
    ``RESHARD_UNCHECKED_FAMILIES=1``), or when the checkpoint is quantized."""
    family, cfg = _family(config)
    if cfg.get("quantization_config"):
        raise MappingError(f"{family or 'this model'}: a quantized checkpoint "
                           "(quantization_config): the SGLang refit maps unquantized "
                           "weights only")
    opted_in = unchecked_ok or os.environ.get(UNCHECKED_FAMILIES_ENV) == "1"
    if family in SGLANG_CHECKED_FAMILIES or opted_in:
        return family
    raise MappingError(
        f"model_type {family or None!r} is not among the families whose refit into SGLang "
        f"was checked end to end ({', '.join(sorted(SGLANG_CHECKED_FAMILIES))}); to try it anyway, "
        f"pass unchecked_family_ok=True (or set {UNCHECKED_FAMILIES_ENV}=1 in the engine's "
        "environment) and check the refit against a fresh engine")


def hf_to_sglang(config: Any, tp: int, param_shapes: Mapping[str, Sequence[int]],
                 hf_tensors: Mapping[str, Sequence[int]], dtype: Any,
                 unchecked_family_ok: bool = False) -> VllmMapping:
    """The trainer's HF tensors onto SGLang's parameters (name -> per-rank shape) at
    tensor-parallel size ``tp``: every parameter filled exactly once, or a
    :class:`MappingError` naming the first unmapped tensor on each side."""
    check_family(config, unchecked_family_ok)
    return map_whole(config, tp, param_shapes, hf_tensors, dtype, engine="SGLang")
