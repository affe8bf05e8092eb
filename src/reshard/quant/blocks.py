"""The FP8 block grid of a sharded tensor, as plain data: which blocks each source rank
touches, and which blocks are split across sources and so need their amax exchanged.

A 2-D tensor is cut into ``block`` = (rows, cols) blocks (128 x 128 for DeepSeek-V3,
Qwen3 and Kimi-K2 FP8 checkpoints), the last row and column of blocks ragged. Every
block gets one scale from the largest magnitude of its elements. A source that holds
only part of a block (an FSDP2 row shard ending mid-block, a Megatron row-parallel
column split, a query group of a fused QKV) cannot know that amax alone: those blocks,
and only those, are listed in :attr:`TensorBlocks.shared` with the ranks that touch
them. Torch-free, like the planner; :mod:`reshard.quant.fp8` does the arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from reshard.errors import Fp8BlockError, LayoutError
from reshard.layout import Layout, dtype_itemsize
from reshard.pieces import Piece

__all__ = ["BlockBox", "BlockFormat", "Fp8Bytes", "Fp8Plan", "SharedBlock", "TensorBlocks",
           "block_box", "check_engine_split", "fp8_bytes", "grid_shape", "plan_fp8",
           "scale_layout"]

#: A box of the block grid: (first block row, block rows, first block col, block cols).
BlockBox = tuple[int, int, int, int]


@dataclass(frozen=True)
class BlockFormat:
    """How a tensor is block-quantized to float8_e4m3fn."""

    block: tuple[int, int] = (128, 128)
    """(rows, cols) of one block: the checkpoint's ``weight_block_size``."""
    ue8m0: bool = False
    """Round every scale up to a power of two (DeepGEMM's UE8M0 scale format)."""

    def __post_init__(self) -> None:
        b = self.block
        if (not isinstance(b, tuple) or len(b) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in b)):
            raise LayoutError(f"expected block = (rows, cols), two ints > 0, got {b!r}")

    def __str__(self) -> str:
        return f"fp8[{self.block[0]}x{self.block[1]}{',ue8m0' if self.ue8m0 else ''}]"


@dataclass(frozen=True)
class SharedBlock:
    """A block whose elements live on several sources: ``ranks`` exchange its amax."""

    block: tuple[int, int]
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class TensorBlocks:
    """One tensor's grid: the block box each piece of each source touches, and the
    blocks split across sources (in row-major block order)."""

    name: str
    shape: tuple[int, int]
    block: tuple[int, int]
    boxes: tuple[tuple[int, tuple[BlockBox, ...]], ...]  # (rank, one box per piece)
    shared: tuple[SharedBlock, ...]

    @property
    def grid(self) -> tuple[int, int]:
        return grid_shape(self.shape, self.block)

    def boxes_of(self, rank: int) -> tuple[BlockBox, ...]:
        return dict(self.boxes).get(rank, ())

    def shared_of(self, rank: int) -> tuple[int, ...]:
        """Indices into :attr:`shared` of the blocks ``rank`` touches."""
        return tuple(i for i, s in enumerate(self.shared) if rank in s.ranks)


@dataclass(frozen=True)
class Fp8Plan:
    """The grids of a set of tensors and the one amax exchange they need: the shared
    blocks of every tensor, in tensor order, make one vector of floats."""

    fmt: BlockFormat
    tensors: tuple[TensorBlocks, ...]

    def __getitem__(self, name: str) -> TensorBlocks:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor {name!r} in this FP8 plan of {len(self.tensors)} tensors")

    @property
    def num_shared(self) -> int:
        return sum(len(t.shared) for t in self.tensors)

    @property
    def exchange_bytes(self) -> int:
        """Bytes of the amax vector each rank contributes (float32 per shared block)."""
        return 4 * self.num_shared

    def exchange_offsets(self) -> dict[str, int]:
        """Where each tensor's shared blocks start in the exchanged vector."""
        out, pos = {}, 0
        for t in self.tensors:
            out[t.name] = pos
            pos += len(t.shared)
        return out

    def __repr__(self) -> str:
        return f"Fp8Plan({len(self.tensors)} tensors, {self.fmt}, {self.num_shared} shared blocks)"


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Blocks per column and per row: ceil division, the last ones ragged."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def block_box(offset: tuple[int, ...], size: tuple[int, ...], block: tuple[int, int]) -> BlockBox:
    """The box of blocks a global box ``[offset, offset + size)`` touches (empty if empty)."""
    if not prod(size):
        return (offset[0] // block[0], 0, offset[1] // block[1], 0)
    r0, c0 = offset[0] // block[0], offset[1] // block[1]
    r1 = -(-(offset[0] + size[0]) // block[0])
    c1 = -(-(offset[1] + size[1]) // block[1])
    return (r0, r1 - r0, c0, c1 - c0)


@lru_cache(maxsize=4096)  # a model repeats a few layouts (every layer, every expert)
def scale_layout(layout: Layout, block: tuple[int, int]) -> Layout:
    """Who holds which scales, as a float32 layout of the scale grid: each rank the
    blocks whose first element it holds (one owner per block, or replicas of one; a
    box per piece, so the ordinary planner moves scales). On an engine split on block
    boundaries these are the scale rows vLLM's loader narrows to each rank."""
    views = {}
    for r in layout.ranks:
        boxes = [_owned(p, block) for p in layout.view(r).pieces]
        boxes = [b for b in boxes if b[1] and b[3]]
        rows = sum(b[1] for b in boxes)
        cols = max((b[3] for b in boxes), default=0)
        pieces, at = [], 0
        for b in boxes:
            pieces.append(((b[0], b[2]), (b[1], b[3]), (at, 0)))
            at += b[1]
        views[r] = ((rows, cols), pieces)
    return Layout.explicit(grid_shape(layout.shape, block), views, "float32")


def _owned(p: Piece, block: tuple[int, int]) -> BlockBox:
    """The blocks whose first element lies in the piece."""
    r0, c0 = -(-p.offset[0] // block[0]), -(-p.offset[1] // block[1])
    r1 = -(-(p.offset[0] + p.size[0]) // block[0]) if p.numel else r0
    c1 = -(-(p.offset[1] + p.size[1]) // block[1]) if p.numel else c0
    return (r0, r1 - r0, c0, c1 - c0)


def plan_fp8(layouts: Layout | Mapping[str, Layout], fmt: BlockFormat | None = None) -> Fp8Plan:
    """The block grids of 2-D source layouts (one, or a name -> layout map)."""
    fmt = fmt or BlockFormat()
    if isinstance(layouts, Layout):
        layouts = {"tensor": layouts}
    return Fp8Plan(fmt, tuple(_tensor_blocks(n, lay, fmt.block) for n, lay in layouts.items()))


def _tensor_blocks(name: str, layout: Layout, block: tuple[int, int]) -> TensorBlocks:
    if len(layout.shape) != 2:
        raise Fp8BlockError(f"tensor {name!r}: FP8 block quantization needs a 2-D tensor, got "
                            f"shape {list(layout.shape)}")
    return TensorBlocks(name, layout.shape, block, *_grid_parts(layout, block))


@lru_cache(maxsize=4096)
def _grid_parts(layout: Layout, block: tuple[int, int]):
    """(the block box of each piece of each rank, the shared blocks) of a layout."""
    boxes = tuple((r, tuple(block_box(p.offset, p.size, block) for p in layout.view(r).pieces))
                  for r in layout.ranks)
    return boxes, _shared(layout, block)


def _shared(layout: Layout, block: tuple[int, int]) -> tuple[SharedBlock, ...]:
    """Blocks touched by two or more ranks, one of which holds only part of the block.
    Only blocks on a piece's edge can be held in part, so only those are looked at, and
    for each only the pieces whose block box holds it."""
    pieces = [(r, p) for r in layout.ranks for p in layout.view(r).pieces if p.numel]
    edges = sorted({b for _, p in pieces for b in _edge_blocks(p, layout.shape, block)})
    by_row: dict[int, list] = {}
    for r, p in pieces:
        br0, nbr, _, _ = block_box(p.offset, p.size, block)
        for i in range(br0, br0 + nbr):
            by_row.setdefault(i, []).append((r, p))
    out = []
    for b in edges:
        parts: dict[int, set] = {}
        for r, p in by_row.get(b[0], ()):
            part = _part(p, b, block)
            if part is not None:
                parts.setdefault(r, set()).add(part)
        whole = _block_numel(b, layout.shape, block)
        if len(parts) > 1 and any(_area(boxes) < whole for boxes in parts.values()):
            out.append(SharedBlock(b, tuple(sorted(parts))))
    return tuple(out)


def _whole(start: int, stop: int, i: int, n: int, total: int) -> bool:
    """Whether ``[start, stop)`` holds all of block ``i`` (size ``n``, the last one
    clipped) of a dim of ``total`` elements."""
    return max(start, i * n) == i * n and min(stop, (i + 1) * n) == min(total, (i + 1) * n)


def _edge_blocks(p: Piece, shape: tuple[int, ...], block: tuple[int, int]):
    """The blocks a piece holds only part of: its first and last block rows and cols."""
    br0, nbr, bc0, nbc = block_box(p.offset, p.size, block)
    rows = range(br0, br0 + nbr)
    cols = range(bc0, bc0 + nbc)
    stop = (p.offset[0] + p.size[0], p.offset[1] + p.size[1])
    part_rows = [i for i in {rows[0], rows[-1]}
                 if not _whole(p.offset[0], stop[0], i, block[0], shape[0])]
    part_cols = [j for j in {cols[0], cols[-1]}
                 if not _whole(p.offset[1], stop[1], j, block[1], shape[1])]
    yield from ((i, j) for i in part_rows for j in cols)
    yield from ((i, j) for i in rows for j in part_cols)


def _part(p: Piece, b: tuple[int, int], block: tuple[int, int]):
    """The global box ((r0, r1), (c0, c1)) of block ``b`` that the piece holds, or None."""
    r0, r1 = max(p.offset[0], b[0] * block[0]), min(p.offset[0] + p.size[0], (b[0] + 1) * block[0])
    c0, c1 = max(p.offset[1], b[1] * block[1]), min(p.offset[1] + p.size[1], (b[1] + 1) * block[1])
    return ((r0, r1), (c0, c1)) if r0 < r1 and c0 < c1 else None


def _area(parts: set) -> int:
    """Elements of distinct boxes of one rank (a layout's distinct boxes never overlap)."""
    return sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in parts)


def _block_numel(b: tuple[int, int], shape: tuple[int, ...], block: tuple[int, int]) -> int:
    rows = min(shape[0], (b[0] + 1) * block[0]) - b[0] * block[0]
    cols = min(shape[1], (b[1] + 1) * block[1]) - b[1] * block[1]
    return rows * cols


@dataclass(frozen=True)
class Fp8Bytes:
    """Bytes of one tensor: in FP8 with its float32 scales, against the source dtype."""

    shape: tuple[int, int]
    fp8: int
    scales: int
    source: int

    @property
    def total(self) -> int:
        return self.fp8 + self.scales

    @property
    def ratio(self) -> float:
        """FP8 plus scales over the source bytes (about 0.5 against bf16)."""
        return self.total / self.source if self.source else 0.0


def fp8_bytes(shape: tuple[int, int], block: tuple[int, int] = (128, 128),
              source_dtype: str = "bfloat16") -> Fp8Bytes:
    """FP8 bytes plus one float32 scale per block, against ``source_dtype``."""
    numel = prod(shape)
    return Fp8Bytes(tuple(shape), numel, 4 * prod(grid_shape(shape, block)),
                    numel * dtype_itemsize(source_dtype))


def check_engine_split(name: str, layout: Layout, block: tuple[int, int] = (128, 128)) -> None:
    """Refuse what vLLM refuses when it loads an FP8 block checkpoint TP-split: a rank's
    output size (rows) or input size (cols) that is split and not a multiple of the
    block (``validate_fp8_block_shape``)."""
    bad = _bad_split(layout, block)
    if bad is not None:
        r, dim, local = bad
        what = ("output size (rows)", "input size (cols)")[dim]
        raise Fp8BlockError(
            f"tensor {name!r}: engine rank {r} holds an {what} of {local} of "
            f"{layout.shape[dim]}, not a multiple of the FP8 block's {block[dim]}; "
            f"vLLM refuses such a split of a linear layer, and loads MoE experts split so "
            f"onto a finer scale grid that reshard does not build (block {list(block)}, "
            f"shape {list(layout.shape)})")


@lru_cache(maxsize=4096)
def _bad_split(layout: Layout, block: tuple[int, int]) -> tuple[int, int, int] | None:
    """(rank, dim, its size) of the first split vLLM refuses, or None."""
    for r in layout.ranks:
        local = layout.view(r).local_shape
        for dim in (0, 1):
            if local[dim] != layout.shape[dim] and local[dim] % block[dim]:
                return r, dim, local[dim]
    return None
