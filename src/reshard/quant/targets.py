"""FP8 destinations of a refit: what both jobs agree at the meeting, as plain data.

An engine that serves a tensor in FP8 blocks gives its layout in ``float8_e4m3fn`` and,
beside it, the layout of its float32 scale grid under :func:`scale_name` (``weight`` ->
``weight_scale_inv``, the checkpoints' name). The trainer sends bf16/fp32. At the
meeting every rank of both jobs turns that into the same two things:

* the source layouts the transfer is planned from: each quantized tensor in FP8 with the
  trainer's own pieces, and its scales as :func:`~reshard.quant.blocks.scale_layout` of
  the trainer's layout (each block's scale sent by the source that holds its first
  element), so the ordinary planner moves codes and scales to the engine ranks;
* an :class:`Fp8Refit`: the block grids over the trainer's ranks (:class:`Fp8Plan`,
  which blocks need their amax exchanged) and the ranks that exchange them.

What vLLM would refuse to load (an engine rank's split that is not a multiple of the
block) is refused here, as :class:`~reshard.errors.Fp8BlockError`, before the group
moves a byte. Torch-free, like the planner.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from reshard.errors import Fp8BlockError
from reshard.layout import Layout
from reshard.quant.blocks import (
    BlockFormat,
    Fp8Plan,
    check_engine_split,
    grid_shape,
    plan_fp8,
    scale_layout,
)

__all__ = ["FP8", "FP8_WEIGHTS", "SCALE_SUFFIX", "Fp8Refit", "fp8_engine_layouts",
           "plan_fp8_refit", "scale_name"]

FP8 = "float8_e4m3fn"
#: A quantized tensor's scales are named after it: ``...weight`` -> ``...weight_scale_inv``.
SCALE_SUFFIX = "_scale_inv"


#: The Hugging Face weights an FP8 block checkpoint (DeepSeek-V3, Qwen3 FP8) holds in FP8:
#: attention and MLP linears, MLA projections, shared and routed experts; embeddings, the
#: LM head, norms and routers stay in the model dtype.
FP8_WEIGHTS = re.compile(
    r"^.+\.(self_attn\.(q|k|v|o|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?"
    r"|mlp(\.shared_experts?)?\.(gate|up|down)_proj"
    r"|mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])"
    r"\.weight$")


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def fp8_engine_layouts(layouts: Mapping[str, Layout], fmt: BlockFormat | None = None,
                       ) -> dict[str, Layout]:
    """An engine's layouts as an FP8 block checkpoint serves them: each weight of
    :data:`FP8_WEIGHTS` in FP8 with its scale layout beside it (what the engine's ranks
    hold of the scale grid: :func:`~reshard.quant.blocks.scale_layout`), the rest as
    given. For the simulator, benchmarks and tests; the vLLM integration maps its own."""
    fmt = fmt or BlockFormat()
    out = dict(layouts)
    for name, lay in layouts.items():
        if FP8_WEIGHTS.match(name) and len(lay.shape) == 2:
            out[name] = lay.with_dtype(FP8)
            out[scale_name(name)] = scale_layout(lay, fmt.block)
    return out


@dataclass(frozen=True, eq=False)
class Fp8Refit:
    """The FP8 part of a refit's plan: the tensors quantized on the way (their block
    grids over the sources), the sources' own layouts of them, and the group ranks that
    exchange amax (the trainer job's)."""

    plan: Fp8Plan
    layouts: Mapping[str, Layout]
    """The trainer's layouts of the quantized tensors, in its own dtype."""
    sources: tuple[int, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.plan.tensors)

    def source_checks(self) -> dict[str, Layout | None]:
        """What a source's tensors are checked against before a refit: a quantized
        tensor against the trainer's layout (not the FP8 one it is sent in), its scales
        not at all (the sender makes them)."""
        out: dict[str, Layout | None] = dict(self.layouts)
        out.update({scale_name(n): None for n in self.names})
        return out

    def __repr__(self) -> str:
        return f"Fp8Refit({self.plan!r}, sources {list(self.sources)})"


def plan_fp8_refit(src: Mapping[str, Layout], dst: Mapping[str, Layout],
                   fmt: BlockFormat | None, sources: tuple[int, ...], dst_offset: int = 0,
                   ) -> tuple[dict[str, Layout], Fp8Refit | None]:
    """``(source layouts to plan the transfer from, Fp8Refit or None)``. With ``fmt``
    None (an engine that asked for no block quantization) nothing changes.
    ``dst_offset``: the engine's first group rank (errors name engine ranks)."""
    names = [n for n, d in dst.items()
             if d.dtype == FP8 and n in src and src[n].dtype != FP8]
    if fmt is None or not names:
        return dict(src), None
    out = dict(src)
    for n in names:
        _check_pair(n, src, dst, fmt)
        check_engine_split(n, dst[n].shifted(-dst_offset), fmt.block)
        out[n] = src[n].with_dtype(FP8)
        out[scale_name(n)] = scale_layout(src[n], fmt.block)
    layouts = {n: src[n] for n in names}
    return out, Fp8Refit(plan_fp8(layouts, fmt), layouts, tuple(sources))


def _check_pair(name: str, src: Mapping[str, Layout], dst: Mapping[str, Layout],
                fmt: BlockFormat) -> None:
    scale = scale_name(name)
    if len(src[name].shape) != 2:
        raise Fp8BlockError(f"tensor {name!r}: the engine takes it in FP8 blocks, which "
                            f"needs a 2-D tensor, got shape {list(src[name].shape)}")
    if scale in src:
        raise Fp8BlockError(f"tensor {scale!r}: the trainer sends it, but it names the "
                            f"scales of {name!r}, which is quantized on the way")
    if scale not in dst:
        raise Fp8BlockError(f"tensor {name!r}: the engine takes it in FP8 but gives no "
                            f"layout for its scales {scale!r}")
    grid = grid_shape(src[name].shape, fmt.block)
    if dst[scale].shape != grid or dst[scale].dtype != "float32":
        raise Fp8BlockError(
            f"tensor {scale!r}: expected a float32 scale grid of shape {list(grid)} "
            f"(blocks {list(fmt.block)} of {list(src[name].shape)}), the engine gives "
            f"{dst[scale].dtype} {list(dst[scale].shape)}")
