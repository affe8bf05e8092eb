"""Plan templates: the intersection of two layouts in slot space (ranks by mesh position).

A template depends only on the two layouts' structures and on which slots of the two
sides are the same rank, so every tensor with the same shapes and placements (all the
experts of a layer, all the layers of a model) shares one. The work is proportional to
the number of overlapping pieces, found per dimension with a sorted index.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.layout import Layout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offset, size)


@dataclass(frozen=True)
class Unit:
    """One global region: who holds it (source slots) and who needs it (destination slots).

    Offsets are already those of the region inside each local tensor.
    """

    offset: tuple[int, ...]
    size: tuple[int, ...]
    nbytes: int
    holders: tuple[tuple[int, tuple[int, ...]], ...]  # (src slot, src local offset)
    local: tuple[tuple[int, int, tuple[int, ...]], ...]  # (holder index, dst slot, dst offset)
    remote: tuple[tuple[int, tuple[int, ...]], ...]  # (dst slot, dst local offset)


@dataclass(frozen=True)
class Template:
    units: tuple[Unit, ...]
    forced_send: tuple[tuple[int, int], ...]  # (src slot, bytes) of single-holder units
    recv: tuple[tuple[int, int], ...]  # (dst slot, remote bytes received)
    multi: tuple[int, ...]  # units with several holders and remote needers
    remote_bytes: int
    local_bytes: int
    num_remote: int


def _distinct_boxes(layout: Layout) -> dict[Box, list[tuple[int, tuple[int, ...]]]]:
    """Every non-empty global box of a layout -> [(slot, local offset)] of its holders."""
    boxes: dict[Box, list[tuple[int, tuple[int, ...]]]] = {}
    for slot in range(len(layout.ranks)):
        for p in layout.view_of_slot(slot).pieces:
            if p.numel:
                boxes.setdefault((p.offset, p.size), []).append((slot, p.local_offset))
    return boxes


class _BoxIndex:
    """Finds the source boxes overlapping a query box, using the most selective dim."""

    def __init__(self, boxes: list[Box], ndim: int) -> None:
        self.boxes = boxes
        self.dim = None
        best = 1
        for d in range(ndim):
            n = len({(o[d], s[d]) for o, s in boxes})
            if n > best:
                self.dim, best = d, n
        if self.dim is None:
            return
        d = self.dim
        intervals: dict[tuple[int, int], list[int]] = {}
        for i, (o, s) in enumerate(boxes):
            intervals.setdefault((o[d], o[d] + s[d]), []).append(i)
        self.keys = sorted(intervals)
        self.starts = [k[0] for k in self.keys]
        self.ids = [intervals[k] for k in self.keys]
        self.disjoint = all(a[1] <= b[0] for a, b in zip(self.keys, self.keys[1:]))

    def candidates(self, offset: tuple[int, ...], size: tuple[int, ...]) -> list[int]:
        if self.dim is None:
            return list(range(len(self.boxes)))
        lo, hi = offset[self.dim], offset[self.dim] + size[self.dim]
        first = max(bisect_left(self.starts, lo) - 1, 0) if self.disjoint else 0
        out: list[int] = []
        for k in range(first, len(self.keys)):
            a, b = self.keys[k]
            if a >= hi and self.disjoint:
                break
            if a < hi and lo < b:
                out.extend(self.ids[k])
        return out


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(h <= lo_ for lo_, h in zip(lo, hi)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi))


def _shift(base: tuple[int, ...], box_off: tuple[int, ...], region_off: tuple[int, ...]):
    return tuple(b + r - o for b, o, r in zip(base, box_off, region_off))


def build_template(src: Layout, dst: Layout, same_rank: dict[int, int], itemsize: int) -> Template:
    """Intersect ``src`` and ``dst``; ``same_rank`` maps dst slot -> src slot of one rank."""
    src_boxes = _distinct_boxes(src)
    src_keys = list(src_boxes)
    index = _BoxIndex(src_keys, len(src.shape))
    units: list[Unit] = []
    for dbox, needers in _distinct_boxes(dst).items():
        for i in index.candidates(*dbox):
            region = _intersect(src_keys[i], dbox)
            if region is not None:
                units.append(_unit(region, src_keys[i], src_boxes[src_keys[i]], dbox, needers,
                                   same_rank, itemsize))
    return _summarise(units)


def _unit(region: Box, sbox: Box, holders, dbox: Box, needers, same_rank, itemsize) -> Unit:
    off, size = region
    held = tuple((slot, _shift(loc, sbox[0], off)) for slot, loc in holders)
    holder_index = {slot: k for k, (slot, _) in enumerate(held)}
    local, remote = [], []
    for slot, loc in needers:
        dst_off = _shift(loc, dbox[0], off)
        k = holder_index.get(same_rank.get(slot, -1))
        if k is None:
            remote.append((slot, dst_off))
        else:
            local.append((k, slot, dst_off))
    return Unit(off, size, prod(size) * itemsize, held, tuple(local), tuple(remote))


def _summarise(units: list[Unit]) -> Template:
    forced: dict[int, int] = {}
    recv: dict[int, int] = {}
    multi, remote_bytes, local_bytes, num_remote = [], 0, 0, 0
    for i, u in enumerate(units):
        local_bytes += u.nbytes * len(u.local)
        if not u.remote:
            continue
        num_remote += len(u.remote)
        remote_bytes += u.nbytes * len(u.remote)
        for slot, _ in u.remote:
            recv[slot] = recv.get(slot, 0) + u.nbytes
        if len(u.holders) == 1:
            slot = u.holders[0][0]
            forced[slot] = forced.get(slot, 0) + u.nbytes * len(u.remote)
        else:
            multi.append(i)
    return Template(tuple(units), tuple(sorted(forced.items())), tuple(sorted(recv.items())),
                    tuple(multi), remote_bytes, local_bytes, num_remote)
