"""What one rank holds of a tensor: :class:`Piece` records (a global box stored at an
offset of the local tensor) in a :class:`LocalView`. Every layout reduces to one
``LocalView`` per rank (:mod:`reshard.layout`); the planner only ever looks at those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from reshard.errors import LayoutError

__all__ = ["LocalView", "Piece"]


@dataclass(frozen=True)
class Piece:
    """A global box ``[offset, offset + size)`` stored at ``local_offset`` of a local tensor."""

    offset: tuple[int, ...]
    size: tuple[int, ...]
    local_offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.size)


@dataclass(frozen=True)
class LocalView:
    """What one rank holds: its local tensor's shape and the pieces laid out in it."""

    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @classmethod
    def of(cls, local_shape: Sequence[int], pieces: Sequence[Any]) -> LocalView:
        """Build from tuples ``(offset, size, local_offset)`` or :class:`Piece` objects."""
        try:
            made = tuple(p if isinstance(p, Piece) else Piece(*map(tuple, p)) for p in pieces)
            return cls(tuple(local_shape), made)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"expected a local shape and pieces (offset, size, "
                              f"local_offset), got {local_shape!r}, {pieces!r} ({e})") from None
