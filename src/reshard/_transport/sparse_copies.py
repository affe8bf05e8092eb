"""A sparse sender's engine-dtype copy of what it sent, region by region (private;
:class:`reshard._transport.sparse_runner.SparseRunner` reads and updates it,
:class:`reshard.refit.sparse.SparseRefits` keeps it across meetings of one group).

Each region is keyed by where its values come from, not by where they go: the source
tensor (the name of its data, so that an elastic group's replicas of one layout, which
are separate tensors of its plan, share it), the offset and size of the region in it,
and the engine dtype. Each copy says which committed version it holds whole (None while
a refit that changed it is in doubt): a region goes sparse to a receiver only when its
copy holds that receiver's base, so a copy left behind by a replica that went away, or
last written by a refit that failed, is never diffed against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Copies", "RegionCopy"]


@dataclass
class RegionCopy:
    values: torch.Tensor
    """Flat, in the engine dtype."""
    version: int | None = None
    """The committed version it holds whole; None before its first commit or after a
    refit that wrote it failed."""
    changed: float = 1.0
    """The fraction of it that changed at its last refit."""


class Copies:
    """Every region copy of one sender, and which of them the refit under way wrote."""

    def __init__(self) -> None:
        self.regions: dict[tuple, RegionCopy] = {}
        self.touched: set[tuple] = set()

    def get(self, key: tuple, n: int, dtype: torch.dtype, device: torch.device) -> RegionCopy:
        """Region ``key``'s copy (``n`` elements), made empty (no version) when missing
        or of another size or place; marked as written by this refit."""
        got = self.regions.get(key)
        if got is None or got.values.numel() != n or got.values.device != device:
            got = self.regions[key] = RegionCopy(torch.empty(n, dtype=dtype, device=device))
        self.touched.add(key)
        return got

    def commit(self, version: int) -> None:
        """Every rank confirmed ``version``: the copies this refit wrote hold it; those
        it did not write (regions no receiver needs any more) are let go."""
        self.regions = {k: c for k, c in self.regions.items() if k in self.touched}
        for c in self.regions.values():
            c.version = version
        self.touched = set()

    def fail(self) -> None:
        """The refit failed: what it wrote may be part new."""
        for key in self.touched:
            if key in self.regions:
                self.regions[key].version = None
        self.touched = set()

    @property
    def nbytes(self) -> int:
        return sum(c.values.numel() * c.values.element_size() for c in self.regions.values())
