"""Views of the regions one rank moves: into its source and destination tensors, and
into its staging arenas.

A refit passes the same parameters every step, and slicing hundreds of regions anew
each time costs more than the small messages themselves. So the geometry of every
region view (sizes, strides, offset from its tensor's start) is worked out once and
kept while the same tensors come back (same address, shape, strides, dtype); each run
rebuilds its views from it with one ``as_strided``. No view of a caller's tensor
outlives the run: between refits nothing here keeps a trainer's or an engine's memory
alive (a colocated trainer may offload its weights while the engine generates).
Views into the staging arenas, which are this rank's own, are kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from reshard.layout import box_slices
from reshard.schedule import DEST, Hop

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
        self.dst_names = sorted({h.name for h in hops if h.dst_rank == rank}
                                | {h.reads for h in hops
                                   if h.src_rank == rank and h.read_from == DEST})
        self.src: Mapping[str, torch.Tensor] = {}
        self.dst: Mapping[str, torch.Tensor] = {}
        self._bound: tuple | None = None  # what the kept geometry was worked out for
        self._geometry: dict[tuple, Any] = {}  # (kind, hop) -> sizes, strides, offset
        self._run: dict[tuple, Any] = {}  # this run's views of the caller's tensors
        self._slots: dict[tuple, torch.Tensor] = {}  # views into the arenas

    def bind(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> None:
        """Use these tensors for one run; keep the geometry if they are laid out as the
        last ones were. Tensors are looked up by name: a mapping may make them on
        demand."""
        self.src, self.dst, self._run = src, dst, {}
        try:
            key = (_tensors_key(src, self.src_names), _tensors_key(dst, self.dst_names))
        except Exception:  # the reads will meet it and report it; keep nothing
            key = None
        if key is None or key != self._bound:
            self._bound, self._geometry = key, {}

    def unbind(self) -> None:
        """End of a run: let go of the caller's tensors."""
        self.src, self.dst, self._run = {}, {}, {}

    @property
    def bound_key(self) -> tuple | None:
        """What the tensors of this run are (memory and layout), or None: equal keys,
        equal geometry."""
        return self._bound

    def clear(self) -> None:
        """Forget everything (the arenas were released)."""
        self._bound, self._geometry, self._run, self._slots = None, {}, {}, {}

    def clear_slots(self) -> None:
        """Forget the views into the arenas (they were re-made)."""
        self._slots = {}

    def read(self, h: Hop) -> torch.Tensor:
        """Where a hop's bytes come from: the sender's source tensor, or its destination
        tensor when it forwards."""
        view = self._run.get(("read", id(h)))
        if view is None:
            tensor = self.dst[h.reads] if h.read_from == DEST else self.src[h.name]
            view = self._run["read", id(h)] = self._view(tensor, "read", h, h.src_offset)
        return view

    def write(self, h: Hop) -> torch.Tensor:
        """Where a hop's bytes land in the receiver's destination tensor."""
        view = self._run.get(("write", id(h)))
        if view is None:
            view = self._view(self.dst[h.name], "write", h, h.dst_offset)
            self._run["write", id(h)] = view
        return view

    def _view(self, tensor: torch.Tensor, kind: str, h: Hop,
              offset: tuple[int, ...]) -> torch.Tensor:
        shape = self._geometry.get((kind, id(h)))
        if shape is not None:
            size, stride, delta = shape
            return tensor.as_strided(size, stride, tensor.storage_offset() + delta)
        view = tensor[box_slices(offset, h.size)]
        self._geometry[kind, id(h)] = (view.shape, view.stride(),
                                       view.storage_offset() - tensor.storage_offset())
        return view

    def slot(self, arena: torch.Tensor, kind: str, start: int, h: Hop) -> torch.Tensor:
        """A hop's place in a staging arena (``kind``: "send" or "recv"), typed and shaped
        like the region."""
        key = (kind, id(h), start)
        view = self._slots.get(key)
        if view is None:
            view = arena[start:start + h.nbytes].view(self.dtypes[h.name]).view(h.size)
            self._slots[key] = view
        return view

    def direct_src(self, hops: list[Hop]) -> torch.Tensor | None:
        """The source region itself as the message, when it alone makes the message and
        is contiguous in the destination dtype (no packing copy)."""
        if len(hops) != 1:
            return None
        got = self._run.get(("direct_src", id(hops[0])), _MISSING)
        if got is not _MISSING:
            return got
        try:
            view = self.read(hops[0])
        except Exception:
            return None  # not kept: packing will meet the error and report it
        ok = view.is_contiguous() and view.dtype == self.dtypes[hops[0].name]
        got = self._run["direct_src", id(hops[0])] = flat_bytes(view) if ok else None
        return got

    def direct_dst(self, hops: list[Hop]) -> torch.Tensor | None:
        """The destination region itself as the receive buffer, when it can be."""
        if len(hops) != 1:
            return None
        got = self._run.get(("direct_dst", id(hops[0])), _MISSING)
        if got is _MISSING:
            view = self.write(hops[0])
            got = flat_bytes(view) if view.is_contiguous() else None
            self._run["direct_dst", id(hops[0])] = got
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
