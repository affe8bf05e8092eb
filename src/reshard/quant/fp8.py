"""FP8 block quantization: the reference on a full tensor, and the same arithmetic shard
by shard, so that the shards put together are bit for bit the reference.

The formula is vLLM's ``per_block_cast_to_fp8`` (vllm/utils/deep_gemm.py, itself
DeepGEMM's), which is DeepSeek-V3's with a floor on the amax:

* ``amax`` = max |x| over the zero-padded block, taken in float32, floored at 1e-4
  (an all-zero block gets scale 1e-4 / 448 and codes 0);
* ``scale`` = amax / 448 in float32 (``weight_scale_inv`` stores it); with ``ue8m0`` the
  smallest power of two >= scale (vLLM writes it ``2 ** ceil(log2(scale))`` in float32;
  ours is exact, from the float's exponent bits, and the same wherever float32 ``log2``
  rounds correctly: they differ only for a scale a few ulps above a power of two);
* ``q`` = float8_e4m3fn(clamp(x * (1 / scale), -448, 448)): the reciprocal times x,
  as vLLM does, not DeepSeek's ``x / scale``, which rounds differently in the last bit.

Every step is elementwise or a max, so it does not matter which rank computes it: the
only thing a shard cannot compute alone is the amax of a block it holds in part, and
max is exact in any order. Torch loads inside the functions (the core stays
torch-free at import).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.errors import Fp8BlockError, TensorMismatchError
from reshard.layout import Layout, box_slices
from reshard.pieces import Piece
from reshard.quant.blocks import (
    BlockBox,
    BlockFormat,
    TensorBlocks,
    block_box,
    grid_shape,
    scale_layout,
)

__all__ = ["AMAX_FLOOR", "FP8_MAX", "Fp8Shard", "amax_grid", "assemble", "quantize_local",
           "quantize_reference", "quantize_shards", "scales_from_amax", "set_shared",
           "shared_amax"]

#: Largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: vLLM's floor on a block's amax (``per_block_cast_to_fp8``'s ``clamp(1e-4)``).
AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class Fp8Shard:
    """What one source yields for one tensor: its local tensor in FP8 (same shape and
    pieces as the input), the scales of the blocks each piece touches, and its local
    tensor of :func:`~reshard.quant.blocks.scale_layout` (the scales it sends on)."""

    qdata: Any
    scales: tuple[tuple[BlockBox, Any], ...]
    scale_local: Any = None


def scales_from_amax(amax: Any, fmt: BlockFormat) -> Any:
    """float32 scales (``weight_scale_inv``) from float32 block amaxes."""
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return _pow2_ceil(scale) if fmt.ue8m0 else scale


def _pow2_ceil(scale: Any) -> Any:
    """The smallest power of two >= each (positive, normal) float32 value, exactly."""
    import torch

    mantissa, exp = torch.frexp(scale)  # scale = mantissa * 2**exp, mantissa in [0.5, 1)
    k = torch.where(mantissa == 0.5, exp - 1, exp)
    return ((k + 127).to(torch.int32) << 23).view(torch.float32)


def _cast(blocks: Any, scale: Any) -> Any:
    """Blocks viewed (rows, block rows, cols, block cols) times 1/scale, to FP8."""
    import torch

    scaled = blocks * (1.0 / scale[:, None, :, None])
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def _padded(data: Any, p: Piece, box: BlockBox, block: tuple[int, int]) -> Any:
    """The piece's data inside zeros covering whole blocks of ``box``, viewed as blocks."""
    bm, bn = block
    out = data.new_zeros((box[1] * bm, box[3] * bn))
    r, c = p.offset[0] - box[0] * bm, p.offset[1] - box[2] * bn
    out[r:r + p.size[0], c:c + p.size[1]] = data
    return out.view(box[1], bm, box[3], bn)


def _block_amax(blocks: Any) -> Any:
    return blocks.abs().amax(dim=(1, 3)).float()  # exact: abs and max round nothing


def quantize_reference(x: Any, fmt: BlockFormat | None = None) -> tuple[Any, Any]:
    """The whole 2-D tensor quantized at once: (FP8 tensor, float32 scale grid)."""
    fmt = fmt or BlockFormat()
    if x.dim() != 2:
        raise Fp8BlockError(f"expected a 2-D tensor to quantize, got shape {list(x.shape)}")
    whole = Piece((0, 0), tuple(x.shape), (0, 0))
    rows, cols = grid_shape(tuple(x.shape), fmt.block)
    box = (0, rows, 0, cols)
    blocks = _padded(x, whole, box, fmt.block)
    scale = scales_from_amax(_block_amax(blocks), fmt)
    q = _cast(blocks, scale).view(box[1] * fmt.block[0], box[3] * fmt.block[1])
    return q[:x.shape[0], :x.shape[1]].contiguous(), scale


def amax_grid(local: Any, layout: Layout, rank: int, blocks: TensorBlocks,
              device: Any = None) -> Any:
    """This rank's partial amax of every block of the grid (0 where it holds nothing), on
    ``local``'s device (``device`` where it holds none of the tensor)."""
    import torch

    where = local.device if local is not None else device
    grid = torch.zeros(blocks.grid, dtype=torch.float32, device=where)
    if rank not in layout.rank_set:
        return grid
    _check_local(local, layout, rank, blocks.name)
    for p in layout.view(rank).pieces:
        box = block_box(p.offset, p.size, blocks.block)
        if not p.numel:
            continue
        part = _block_amax(_padded(local[box_slices(p.local_offset, p.size)], p, box,
                                   blocks.block))
        sub = grid[box[0]:box[0] + box[1], box[2]:box[2] + box[3]]
        torch.maximum(sub, part, out=sub)
    return grid


def _shared_index(blocks: TensorBlocks, device: Any) -> Any:
    import torch

    cols = blocks.grid[1]
    return torch.tensor([s.block[0] * cols + s.block[1] for s in blocks.shared],
                        dtype=torch.int64, device=device)


def shared_amax(grid: Any, blocks: TensorBlocks) -> Any:
    """This rank's partial amax of the tensor's shared blocks, in the plan's order."""
    return grid.flatten()[_shared_index(blocks, grid.device)]


def set_shared(grid: Any, blocks: TensorBlocks, values: Any) -> None:
    """Write the exchanged (final) amax of the shared blocks into ``grid``."""
    grid.view(-1)[_shared_index(blocks, grid.device)] = values


def quantize_local(local: Any, layout: Layout, rank: int, blocks: TensorBlocks,
                   scale: Any) -> Fp8Shard:
    """This rank's pieces quantized with the final ``scale`` grid (only the entries of
    blocks it touches are read)."""
    import torch

    _check_local(local, layout, rank, blocks.name)
    view = layout.view(rank)
    q = torch.zeros(view.local_shape, dtype=torch.float8_e4m3fn, device=local.device)
    scales = []
    for p in view.pieces:
        box = block_box(p.offset, p.size, blocks.block)
        sub = scale[box[0]:box[0] + box[1], box[2]:box[2] + box[3]]
        scales.append((box, sub.clone()))
        if not p.numel:
            continue
        padded = _padded(local[box_slices(p.local_offset, p.size)], p, box, blocks.block)
        codes = _cast(padded, sub).view(box[1] * blocks.block[0], box[3] * blocks.block[1])
        r, c = p.offset[0] - box[0] * blocks.block[0], p.offset[1] - box[2] * blocks.block[1]
        q[box_slices(p.local_offset, p.size)] = codes[r:r + p.size[0], c:c + p.size[1]]
    return Fp8Shard(q, tuple(scales), _owned_scales(layout, rank, blocks, scale))


def _owned_scales(layout: Layout, rank: int, blocks: TensorBlocks, scale: Any) -> Any:
    """This rank's local tensor of the scale layout (blocks it owns are blocks it
    touches, so their scales here are final)."""
    own = scale_layout(layout, blocks.block).view(rank)
    out = scale.new_zeros(own.local_shape)
    for p in own.pieces:
        out[box_slices(p.local_offset, p.size)] = scale[box_slices(p.offset, p.size)]
    return out


def quantize_shards(locals_: Mapping[int, Any], layout: Layout, blocks: TensorBlocks,
                    fmt: BlockFormat) -> dict[int, Fp8Shard]:
    """Every source in this process, the exchange a max over their shared vectors: the
    in-process twin of :func:`reshard.refit.amax.quantize_on_rank`."""
    import torch

    grids = {r: amax_grid(locals_[r], layout, r, blocks) for r in layout.ranks}
    if blocks.shared:
        final = torch.stack([shared_amax(g, blocks) for g in grids.values()]).amax(dim=0)
        for g in grids.values():
            set_shared(g, blocks, final)
    return {r: quantize_local(locals_[r], layout, r, blocks, scales_from_amax(grids[r], fmt))
            for r in layout.ranks}


def assemble(shards: Mapping[int, Fp8Shard], layout: Layout,
             blocks: TensorBlocks) -> tuple[Any, Any]:
    """The full FP8 tensor and scale grid put together from every source's shard (for
    checks; a refit sends each destination only its part). Sources that give the same
    element or scale must agree bit for bit."""
    import torch

    q = torch.zeros(layout.shape, dtype=torch.uint8)
    scale = torch.full(blocks.grid, float("nan"), dtype=torch.float32)
    for r, shard in shards.items():
        for p, (box, sub) in zip(layout.view(r).pieces, shard.scales):
            q[box_slices(p.offset, p.size)] = shard.qdata[box_slices(
                p.local_offset, p.size)].view(torch.uint8)
            _put_scales(scale, box, sub, blocks.name)
    return q.view(torch.float8_e4m3fn), scale


def _put_scales(scale: Any, box: BlockBox, sub: Any, name: str) -> None:
    import torch

    dst = scale[box[0]:box[0] + box[1], box[2]:box[2] + box[3]]
    seen = ~torch.isnan(dst)
    if not torch.equal(dst[seen].view(torch.int32), sub[seen].view(torch.int32)):
        raise TensorMismatchError(f"tensor {name!r}: two sources gave different scales for "
                                  f"the same block in block box {box}")
    dst.copy_(sub)


def _check_local(local: Any, layout: Layout, rank: int, name: str) -> None:
    if tuple(local.shape) != layout.local_shape(rank):
        raise TensorMismatchError(
            f"tensor {name!r}: rank {rank} expected a local tensor of shape "
            f"{list(layout.local_shape(rank))}, got {list(local.shape)}")
