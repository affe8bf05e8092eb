"""Mesh: an N-d array of global ranks, with optional axis names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from reshard.errors import LayoutError

__all__ = ["Mesh"]


def _flatten(ranks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (shape, flat ranks) of a nested sequence of ints (or anything with tolist())."""
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    if isinstance(ranks, int):
        raise LayoutError(f"expected a (nested) sequence of ranks, got the int {ranks}")
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence) or not ranks:
        raise LayoutError(f"expected a non-empty (nested) sequence of ranks, got {ranks!r}")
    if all(isinstance(r, int) for r in ranks):
        return (len(ranks),), tuple(ranks)
    parts = [_flatten(r) for r in ranks]
    inner = parts[0][0]
    if any(shape != inner for shape, _ in parts):
        raise LayoutError(f"mesh rows must all have the same shape, got {ranks!r}")
    return (len(parts), *inner), tuple(r for _, flat in parts for r in flat)


@dataclass(frozen=True)
class Mesh:
    """An N-d array of global ranks; axis ``i`` has ``shape[i]`` coordinates.

    ``Mesh([[0, 1], [2, 3]], ("dp", "tp"))`` has rank 2 at coordinate (1, 0).
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dim_names: tuple[str, ...] | None = None

    def __init__(self, ranks: Any, dim_names: Sequence[str] | None = None) -> None:
        shape, flat = _flatten(ranks)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", flat)
        if dim_names and (isinstance(dim_names, str) or not isinstance(dim_names, Sequence)
                          or not all(isinstance(n, str) for n in dim_names)):
            raise LayoutError(f"mesh dim names must be a sequence of strings, got {dim_names!r}")
        object.__setattr__(self, "dim_names", tuple(dim_names) if dim_names else None)
        self._validate()

    def _validate(self) -> None:
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in self.ranks):
            raise LayoutError(f"mesh ranks must be ints >= 0, got {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            seen: set[int] = set()
            dup = next(r for r in self.ranks if r in seen or seen.add(r))
            raise LayoutError(f"mesh has rank {dup} more than once: {list(self.ranks)}")
        if self.dim_names is not None and len(self.dim_names) != len(self.shape):
            raise LayoutError(
                f"expected {len(self.shape)} mesh dim names, got {len(self.dim_names)}: "
                f"{self.dim_names}"
            )

    @classmethod
    def from_shape(cls, shape: Sequence[int], *, start: int = 0,
                   dim_names: Sequence[str] | None = None) -> Mesh:
        """Row-major mesh of ``prod(shape)`` consecutive ranks from ``start``."""
        if (isinstance(shape, str) or not isinstance(shape, Sequence)
                or not all(isinstance(n, int) and n > 0 for n in shape)
                or not isinstance(start, int)):
            raise LayoutError(f"expected a mesh shape of ints > 0 and an int start, got "
                              f"{shape!r}, {start!r}")
        flat = list(range(start, start + prod(shape)))
        for size in reversed(shape[1:]):
            flat = [flat[i:i + size] for i in range(0, len(flat), size)]
        return cls(flat, dim_names)

    @classmethod
    def from_device_mesh(cls, device_mesh: Any) -> Mesh:
        """The ranks and axis names of a ``torch.distributed.DeviceMesh``."""
        return cls(device_mesh.mesh.tolist(), getattr(device_mesh, "mesh_dim_names", None))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Coordinate of ``rank`` in the mesh, or None when it is not a member."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            return None
        return self.coordinate_of_slot(flat)

    def coordinate_of_slot(self, slot: int) -> tuple[int, ...]:
        """Coordinate of the ``slot``-th rank in row-major order."""
        coord = []
        for size in reversed(self.shape):
            coord.append(slot % size)
            slot //= size
        return tuple(reversed(coord))

    def __str__(self) -> str:
        names = self.dim_names or tuple(f"d{i}" for i in range(self.ndim))
        axes = ",".join(f"{n}={s}" for n, s in zip(names, self.shape))
        return f"Mesh({axes}; ranks {self.ranks[0]}..{self.ranks[-1]})"
