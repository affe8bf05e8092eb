"""Layouts: which box of the global tensor each rank holds, and where in its local tensor.

A :class:`Layout` is either *placement-based* (a mesh plus one DTensor placement per
mesh axis, torch.chunk semantics, strided shards included) or *explicit* (each rank
lists the global boxes it holds and where each sits in its local tensor). Both reduce
to the same thing: per rank, a :class:`LocalView` of :class:`Piece` records. The
planner only ever looks at that.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from functools import cached_property
from itertools import product
from math import prod
from typing import Any

from reshard._validate import check_explicit
from reshard.errors import LayoutError, TensorMismatchError
from reshard.mesh import Mesh
from reshard.pieces import LocalView, Piece
from reshard.placement import Placement, Replicate, Shard, StridedShard, as_placement, chunk_bounds

__all__ = ["Layout", "box_slices", "dtype_itemsize", "dtype_name"]

_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8,
}


def dtype_name(dtype: Any) -> str:
    """Canonical short name of a dtype given as ``torch.float32`` or ``"float32"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise LayoutError(f"unsupported dtype {dtype!r}; expected one of {sorted(_ITEMSIZE)}")
    return name


def dtype_itemsize(dtype: Any) -> int:
    return _ITEMSIZE[dtype_name(dtype)]


Segments = tuple[tuple[int, int], ...]  # (global start, length) runs, in local order


def _take(segs: Segments, start: int, stop: int) -> Segments:
    """The runs covering local positions ``[start, stop)`` of a dim made of ``segs``."""
    out: list[tuple[int, int]] = []
    pos = 0
    for gstart, length in segs:
        lo, hi = max(start, pos), min(stop, pos + length)
        if lo < hi:
            out.append((gstart + lo - pos, hi - lo))
        pos += length
    return tuple(out)


def _merge(segs: list[tuple[int, int]]) -> Segments:
    """Join runs that are contiguous both locally and globally."""
    out: list[tuple[int, int]] = []
    for gstart, length in segs:
        if out and out[-1][0] + out[-1][1] == gstart:
            out[-1] = (out[-1][0], out[-1][1] + length)
        elif length:
            out.append((gstart, length))
    return tuple(out)


def _split(segs: Segments, placement: Placement, num: int, coord: int) -> Segments:
    """Apply one mesh axis's split to a dim, exactly as ``distribute_tensor`` does."""
    total = sum(length for _, length in segs)
    if isinstance(placement, Shard):
        return _take(segs, *chunk_bounds(total, num, coord))
    runs: list[tuple[int, int]] = []
    assert isinstance(placement, StridedShard)
    for j in range(placement.split_factor):
        lo, hi = chunk_bounds(total, placement.split_factor, j)
        a, b = chunk_bounds(hi - lo, num, coord)
        runs.extend(_take(segs, lo + a, lo + b))
    return _merge(runs)


def _grid_view(per_dim: Sequence[Segments]) -> LocalView:
    """The pieces of a local tensor that is the product of per-dim runs."""
    local_shape = tuple(sum(length for _, length in segs) for segs in per_dim)
    axes = []
    for segs in per_dim:
        pos, runs = 0, []
        for gstart, length in segs:
            runs.append((gstart, length, pos))
            pos += length
        axes.append(runs)
    pieces = tuple(
        Piece(tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        for combo in product(*axes)
    )
    return LocalView(local_shape, pieces)


class Layout:
    """How a tensor of ``shape`` is spread over ranks.

    ``Layout(shape, mesh, placements, dtype="float32")`` follows DTensor: placements
    apply left to right over the mesh axes, several axes may shard one tensor dim,
    uneven sizes follow ``torch.chunk``. ``Layout.explicit`` covers what placements
    cannot say (fused parameters, padded vocabularies, ragged expert splits).
    """

    def __init__(self, shape: Sequence[int], mesh: Mesh | Any, placements: Sequence[Any],
                 dtype: Any = "float32") -> None:
        self.shape = _check_shape(shape)
        self.dtype = dtype_name(dtype)
        self.mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
        if isinstance(placements, str) or not hasattr(placements, "__iter__"):
            raise LayoutError(f"expected a sequence of placements (one per mesh dim), got "
                              f"{placements!r}")
        self.placements = tuple(as_placement(p) for p in placements)
        self._explicit: tuple[LocalView, ...] | None = None
        self._check_placements()

    @classmethod
    def explicit(cls, shape: Sequence[int], views: Mapping[int, LocalView | tuple],
                 dtype: Any = "float32") -> Layout:
        """Each rank's :class:`LocalView` (or ``(local_shape, pieces)``) given directly."""
        if not isinstance(views, Mapping):
            raise LayoutError(f"expected a mapping rank -> LocalView or (local_shape, pieces), "
                              f"got {type(views).__name__}")
        if not views:
            raise LayoutError("an explicit layout needs at least one rank")
        self = cls.__new__(cls)
        self.shape = _check_shape(shape)
        self.dtype = dtype_name(dtype)
        if not all(isinstance(r, int) for r in views):
            raise LayoutError(f"explicit layout ranks must be ints, got {list(views)!r}")
        ranks = sorted(views)
        self.mesh = Mesh(ranks)
        self.placements = None
        self._explicit = tuple(_as_view(r, views[r]) for r in ranks)
        check_explicit(self.shape, dict(zip(ranks, self._explicit)))
        return self

    @classmethod
    def from_dtensor(cls, dt: Any) -> Layout:
        """The layout of a ``torch.distributed.tensor.DTensor``."""
        return cls(tuple(dt.shape), Mesh.from_device_mesh(dt.device_mesh), dt.placements,
                   dt.dtype)

    def shifted(self, offset: int) -> Layout:
        """The same layout on ranks ``r + offset`` (a side's local ranks -> group ranks)."""
        if self._explicit is not None:
            return Layout.explicit(self.shape, {r + offset: v for r, v in
                                                zip(self.ranks, self._explicit)}, self.dtype)
        mesh = Mesh(_nest([r + offset for r in self.ranks], self.mesh.shape),
                    self.mesh.dim_names)
        return Layout(self.shape, mesh, self.placements, self.dtype)

    def with_dtype(self, dtype: Any) -> Layout:
        """The same layout of another dtype (the pieces do not change)."""
        if self._explicit is not None:
            return Layout.explicit(self.shape, dict(zip(self.ranks, self._explicit)), dtype)
        return Layout(self.shape, self.mesh, self.placements, dtype)

    # -- identity ---------------------------------------------------------------------
    @cached_property
    def structure(self) -> tuple:
        """Everything but the rank numbers: two layouts with equal structure differ only
        in which ranks play each slot, so one plan template serves both."""
        if self._explicit is not None:
            return ("explicit", self.shape, self.dtype, self._explicit)
        return ("placed", self.shape, self.dtype, self.mesh.shape, self.placements)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The member ranks, in slot order (row-major over the mesh)."""
        return self.mesh.ranks

    @cached_property
    def rank_set(self) -> frozenset[int]:
        return frozenset(self.mesh.ranks)

    @cached_property
    def _slot_of(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.mesh.ranks)}

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Layout) and self.structure == other.structure
                and self.ranks == other.ranks)

    def __hash__(self) -> int:
        return hash((self.structure, self.ranks))

    def __repr__(self) -> str:
        if self._explicit is not None:
            return f"Layout.explicit({list(self.shape)}, {self.dtype}, ranks={list(self.ranks)})"
        places = ",".join(map(str, self.placements))
        return f"Layout({list(self.shape)}, {self.dtype}, {self.mesh}, [{places}])"

    # -- sizes ------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    # -- per-rank views ---------------------------------------------------------------
    def view_of_slot(self, slot: int) -> LocalView:
        views = self.__dict__.setdefault("_views", {})
        view = views.get(slot)
        if view is None:
            view = views[slot] = (self._explicit[slot] if self._explicit is not None
                                  else self._placed_view(slot))
        return view

    def view(self, rank: int) -> LocalView:
        """The :class:`LocalView` of ``rank``; a LayoutError when it holds nothing here."""
        slot = self._slot_of.get(rank)
        if slot is None:
            raise LayoutError(f"rank {rank} is not in this layout's ranks {list(self.ranks)}")
        return self.view_of_slot(slot)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of the local tensor ``rank`` holds (what DTensor's ``to_local()`` holds)."""
        return self.view(rank).local_shape

    def shard(self, full: Any, rank: int) -> Any:
        """The local tensor ``rank`` holds when the global tensor is ``full``."""
        if tuple(full.shape) != self.shape:
            raise TensorMismatchError(
                f"expected a full tensor of shape {list(self.shape)}, got {list(full.shape)}")
        view = self.view(rank)
        local = full.new_zeros(view.local_shape)
        for piece in view.pieces:
            local[box_slices(piece.local_offset, piece.size)] = full[
                box_slices(piece.offset, piece.size)]
        return local

    def _placed_view(self, slot: int) -> LocalView:
        coord = self.mesh.coordinate_of_slot(slot)
        per_dim: list[Segments] = [((0, n),) if n else () for n in self.shape]
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Replicate):
                continue
            d = placement.dim
            per_dim[d] = _split(per_dim[d], placement, self.mesh.shape[axis], coord[axis])
        return _grid_view(per_dim)

    def _check_placements(self) -> None:
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"expected {self.mesh.ndim} placements (one per mesh dim), "
                f"got {len(self.placements)}: {[str(p) for p in self.placements]}")
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard | StridedShard) and p.dim >= len(self.shape):
                raise LayoutError(
                    f"placement {p} on mesh dim {axis} shards tensor dim {p.dim}, but the "
                    f"tensor of shape {list(self.shape)} has {len(self.shape)} dims")


def _as_view(rank: int, v: Any) -> LocalView:
    """A LocalView from what the caller gave, or a LayoutError saying what is wrong."""
    if not isinstance(v, LocalView):
        try:
            local_shape, pieces = v
            v = LocalView.of(local_shape, pieces)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"rank {rank}: expected a LocalView or (local_shape, [(offset, "
                              f"size, local_offset), ...]), got {v!r} ({e})") from None
    fields = [v.local_shape] + [f for p in v.pieces if isinstance(p, Piece)
                                for f in (p.offset, p.size, p.local_offset)]
    if not all(isinstance(p, Piece) for p in v.pieces) or not all(
            isinstance(f, tuple) and all(isinstance(n, int) and not isinstance(n, bool)
                                         and n >= 0 for n in f)
            for f in fields):
        raise LayoutError(f"rank {rank}: local shapes, offsets and sizes must be tuples of "
                          f"ints >= 0, got {v!r}")
    return v


def _nest(flat: Sequence[int], shape: Sequence[int]) -> list:
    out: list = list(flat)
    for size in reversed(shape[1:]):
        out = [out[i:i + size] for i in range(0, len(out), size)]
    return out


def box_slices(offset: Sequence[int], size: Sequence[int]) -> tuple[slice, ...]:
    """Index of the box ``[offset, offset + size)`` of a tensor."""
    return tuple(slice(o, o + s) for o, s in zip(offset, size))


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    if hasattr(shape, "__iter__"):
        with suppress(TypeError):
            shape = tuple(shape)
    if not isinstance(shape, tuple) or any(not isinstance(n, int) or isinstance(n, bool)
                                           or n < 0 for n in shape):
        raise LayoutError(f"expected a shape of ints >= 0, got {shape!r}")
    return shape
