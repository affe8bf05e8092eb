"""Checks of explicit layouts: pieces inside their tensors, no overlaps, full coverage."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from reshard.errors import LayoutError
from reshard.pieces import LocalView, Piece


def _overlaps(a_off, a_size, b_off, b_size) -> bool:
    return all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(a_off, a_size, b_off, b_size))


def _inside(offset, size, shape) -> bool:
    return len(offset) == len(shape) == len(size) and all(
        o >= 0 and s >= 0 and o + s <= n for o, s, n in zip(offset, size, shape))


def check_explicit(shape: tuple[int, ...], views: Mapping[int, LocalView]) -> None:
    """Raise LayoutError unless every rank's pieces fit in the tensor of ``shape`` and in
    their local tensor, and the distinct boxes tile the tensor."""
    boxes: dict[tuple, int] = {}
    for rank, view in views.items():
        _check_rank(shape, rank, view.local_shape, view.pieces)
        for p in view.pieces:
            if p.numel:
                boxes.setdefault((p.offset, p.size), rank)
    _check_tiling(shape, boxes)


def _check_rank(shape: tuple[int, ...], rank: int, local_shape,
                pieces: tuple[Piece, ...]) -> None:
    if len(local_shape) != len(shape):
        raise LayoutError(
            f"rank {rank}: local shape {list(local_shape)} has {len(local_shape)} dims, the "
            f"tensor {list(shape)} has {len(shape)}")
    for p in pieces:
        if not _inside(p.offset, p.size, shape):
            raise LayoutError(f"rank {rank}: piece at {list(p.offset)} of size {list(p.size)} "
                              f"lies outside the tensor of shape {list(shape)}")
        if not _inside(p.local_offset, p.size, local_shape):
            raise LayoutError(
                f"rank {rank}: piece at local offset {list(p.local_offset)} of size "
                f"{list(p.size)} lies outside its local shape {list(local_shape)}")
    for i, a in enumerate(pieces):
        for b in pieces[i + 1:]:
            if a.numel and b.numel and _overlaps(a.local_offset, a.size, b.local_offset, b.size):
                raise LayoutError(f"rank {rank}: pieces at local offsets {list(a.local_offset)} "
                                  f"and {list(b.local_offset)} overlap in the local tensor")


def _check_tiling(shape: tuple[int, ...], boxes: dict[tuple, int]) -> None:
    items = sorted(boxes.items())
    for i, ((a_off, a_size), ra) in enumerate(items):
        for (b_off, b_size), rb in items[i + 1:]:
            if b_off[:1] and a_off[:1] and b_off[0] >= a_off[0] + a_size[0]:
                break
            if _overlaps(a_off, a_size, b_off, b_size):
                raise LayoutError(
                    f"explicit boxes overlap without being equal: rank {ra} holds "
                    f"{list(a_off)}+{list(a_size)}, rank {rb} holds {list(b_off)}+{list(b_size)}")
    covered = sum(prod(size) for _, size in boxes)
    if covered != prod(shape):
        raise LayoutError(f"explicit boxes cover {covered} of the {prod(shape)} elements of "
                          f"the tensor of shape {list(shape)}: every element must be "
                          "held by at least one rank")
