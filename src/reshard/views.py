"""Views of the regions one rank moves: into its source and destination tensors, and
into its staging arenas.

Made on first use and kept while the same tensors come back (same memory, shape,
strides, dtype): a refit passes the same parameters every step, and slicing hundreds of
regions anew each time would cost more than the small messages themselves. A cached
view keeps its tensor's memory alive, so no other tensor can take its address and be
mistaken for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .layout import box_slices
from .schedule import DEST, Hop

__all__ = ["RegionViews", "flat_bytes"]

_MISSING = object()


class RegionViews:
    """One rank's region views for the hops it takes part in."""

    def __init__(self, hops: Iterable[Hop], rank: int,
                 dtypes: Mapping[str, torch.dtype]) -> None:
        hops = list(hops)
        self.dtypes = dtypes
        self.src_names = sorted({h.name for h in hops
                                 if h.src_rank == rank and h.read_from != DEST})
        self.dst_names = sorted({h.name for h in hops if h.dst_rank == rank
                                 or (h.src_rank == rank and h.read_from == DEST)})
        self.src: Mapping[str, torch.Tensor] = {}
        self.dst: Mapping[str, torch.Tensor] = {}
        self._bound: tuple | None = None  # what the cached views were made from
        self._cache: dict[tuple, Any] = {}

    def bind(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> None:
        """Use these tensors; keep the cached views if they are the ones already bound.
        Tensors are looked up by name: a mapping may make them on demand."""
        self.src, self.dst = src, dst
        try:
            key = (_tensors_key(src, self.src_names), _tensors_key(dst, self.dst_names))
        except Exception:  # the reads will meet it and report it; cache nothing
            key = None
        if key is None or key != self._bound:
            self._bound, self._cache = key, {}

    def clear(self) -> None:
        """Forget every view (the arenas were re-made or released)."""
        self._bound, self._cache = None, {}

    def read(self, h: Hop) -> torch.Tensor:
        """Where a hop's bytes come from: the sender's source tensor, or its destination
        tensor when it forwards."""
        view = self._cache.get(("read", id(h)))
        if view is None:
            tensor = self.dst[h.name] if h.read_from == DEST else self.src[h.name]
            view = self._cache["read", id(h)] = tensor[box_slices(h.src_offset, h.size)]
        return view

    def write(self, h: Hop) -> torch.Tensor:
        """Where a hop's bytes land in the receiver's destination tensor."""
        view = self._cache.get(("write", id(h)))
        if view is None:
            view = self._cache["write", id(h)] = self.dst[h.name][
                box_slices(h.dst_offset, h.size)]
        return view

    def slot(self, arena: torch.Tensor, kind: str, start: int, h: Hop) -> torch.Tensor:
        """A hop's place in a staging arena (``kind``: "send" or "recv"), typed and shaped
        like the region."""
        key = (kind, id(h), start)
        view = self._cache.get(key)
        if view is None:
            view = arena[start:start + h.nbytes].view(self.dtypes[h.name]).view(h.size)
            self._cache[key] = view
        return view

    def direct_src(self, hops: list[Hop]) -> torch.Tensor | None:
        """The source region itself as the message, when it alone makes the message and
        is contiguous in the destination dtype (no packing copy)."""
        if len(hops) != 1:
            return None
        got = self._cache.get(("direct_src", id(hops[0])), _MISSING)
        if got is not _MISSING:
            return got
        try:
            view = self.read(hops[0])
        except Exception:
            return None  # not cached: packing will meet the error and report it
        ok = view.is_contiguous() and view.dtype == self.dtypes[hops[0].name]
        got = self._cache["direct_src", id(hops[0])] = flat_bytes(view) if ok else None
        return got

    def direct_dst(self, hops: list[Hop]) -> torch.Tensor | None:
        """The destination region itself as the receive buffer, when it can be."""
        if len(hops) != 1:
            return None
        got = self._cache.get(("direct_dst", id(hops[0])), _MISSING)
        if got is _MISSING:
            view = self.write(hops[0])
            got = flat_bytes(view) if view.is_contiguous() else None
            self._cache["direct_dst", id(hops[0])] = got
        return got


def _tensors_key(tensors: Mapping[str, Any], names: list[str]) -> tuple:
    """What views of these tensors depend on: which memory, laid out how."""
    out: list[Any] = []
    for name in names:
        t = tensors[name]
        out.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                   if isinstance(t, torch.Tensor) else id(t))
    return tuple(out)


def flat_bytes(view: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor. A size-1 dim may carry any
    stride and ``reshape(-1)`` keeps it, which a dtype view refuses: restride instead."""
    flat = view.reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)
