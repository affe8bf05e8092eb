"""vLLM engines loaded from an FP8 block checkpoint (DeepSeek-V3, Qwen3 and Kimi-K2
FP8): which Hugging Face tensors the engine holds in FP8, and the ``weight_scale_inv``
slot and layout beside each of them.

Such a checkpoint says ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``: every linear
layer's ``weight`` is ``float8_e4m3fn`` and its ``weight_scale_inv`` is a float32 grid
of one scale per block. vLLM keeps both in checkpoint form per rank: a fused
``qkv_proj`` / ``gate_up_proj`` (or an expert's ``w13``) holds its parts' scale rows one
after another, each part starting at ``offset / block`` rows
(``adjust_block_scale_shard``). So a part's scale rows are its own only when it starts
on a block row; vLLM lets a fused part's size be ragged (then two parts share a scale
row and the engine serves one part with the other's scale, vllm#52915): reshard refuses
that, by name, rather than send scales that cannot be right. Norms, embeddings, the LM
head and MoE routers stay in the model dtype. Pure Python: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.errors import Fp8BlockError, MappingError
from reshard.integrations.vllm.rules import Slot
from reshard.layout import Layout
from reshard.quant.blocks import BlockFormat, check_engine_split, grid_shape, scale_layout
from reshard.quant.targets import FP8, FP8_WEIGHTS, scale_name

__all__ = ["FP8_WEIGHTS", "FP8_BLOCK_CONFIG", "fp8_format", "fp8_scale_entry", "fp8_state",
           "is_fp8_block"]

#: The ``quantization_config`` of a DeepSeek-V3 / Qwen3 FP8 block checkpoint.
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128],
                    "activation_scheme": "dynamic"}


def is_fp8_block(quant: Any) -> bool:
    """Whether a ``quantization_config`` is FP8 with block scales and dynamic
    activations (what reshard refits into)."""
    return (isinstance(quant, Mapping) and quant.get("quant_method") == "fp8"
            and bool(quant.get("weight_block_size"))
            and quant.get("activation_scheme", "dynamic") == "dynamic")


def fp8_format(quant: Any) -> BlockFormat | None:
    """The block format of a config's ``quantization_config`` (None without one)."""
    if not quant:
        return None
    if not is_fp8_block(quant):
        raise MappingError(f"quantization_config {dict(quant)!r}: reshard refits FP8 block "
                           "checkpoints only (quant_method 'fp8', weight_block_size, "
                           "activation_scheme 'dynamic')")
    block = tuple(int(n) for n in quant["weight_block_size"])
    return BlockFormat(block)  # vLLM on CPU keeps float32 scales (no UE8M0)


def fp8_scale_entry(name: str, slot: Slot, layout: Layout, param_shape: tuple[int, ...],
                    fmt: BlockFormat, logical: Mapping[str, tuple[int, ...]] | None,
                    ) -> tuple[Layout, tuple[str, Slot, Layout, tuple[int, ...]]] | None:
    """For a weight the engine holds in FP8: ``(its FP8 layout, (scale tensor name,
    scale slot, scale layout, scale parameter shape))``; None for a weight it does not.
    Raises :class:`~reshard.errors.Fp8BlockError` / :class:`MappingError` for what
    vLLM refuses or would serve wrong."""
    scale_param = scale_name(slot.param)
    if logical is not None:
        if scale_param not in logical:
            return None
    elif not FP8_WEIGHTS.match(name):
        return None
    if len(layout.shape) != 2:
        raise Fp8BlockError(
            f"tensor {name!r}: the engine holds {slot.param} in FP8 blocks, but the trainer "
            f"sends it as one {len(layout.shape)}-D tensor {list(layout.shape)} (fused "
            "experts); FP8 block quantization is built for 2-D tensors: send each expert "
            "under its checkpoint name (experts.{e}.gate_proj.weight, ...)")
    check_engine_split(name, layout, fmt.block)
    scale_shape = (*param_shape[:-2], *grid_shape(param_shape[-2:], fmt.block))
    scale_slot = Slot(scale_param, expert=slot.expert,
                            rows=_scale_rows(name, slot, param_shape, fmt.block[0]))
    return layout.with_dtype(FP8), (scale_name(name), scale_slot,
                                    scale_layout(layout, fmt.block), scale_shape)


def _scale_rows(name: str, slot: Slot, param_shape: tuple[int, ...],
                block_rows: int) -> tuple[int, int] | None:
    if slot.rows is None:
        return None
    start, stop = slot.rows
    total = param_shape[-2]
    if start % block_rows or (stop - start) % block_rows and stop != total:
        raise MappingError(
            f"{name}: it fills rows {start}..{stop} of {slot.param} (of {total} a rank), "
            f"not whole blocks of {block_rows} rows: its scale rows would be shared with "
            "another part of the fused parameter, which vLLM then serves with the wrong "
            "scale (vllm#52915); reshard refuses such a checkpoint")
    return start // block_rows, -(-stop // block_rows)


def fp8_state(state: Mapping[str, Any], fmt: BlockFormat | None = None) -> dict[str, Any]:
    """A full state dict as an FP8 block checkpoint holds it: each weight of
    :data:`FP8_WEIGHTS` quantized with the reference formula
    (:func:`reshard.quant.quantize_reference`) beside its ``weight_scale_inv``, the rest
    as given. A reference for checks (a refit never builds it)."""
    from reshard.quant.fp8 import quantize_reference

    fmt = fmt or BlockFormat()
    out = {}
    for name, x in state.items():
        if FP8_WEIGHTS.match(name):
            out[name], out[scale_name(name)] = quantize_reference(x, fmt)
        else:
            out[name] = x
    return out
