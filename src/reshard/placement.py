"""Placements: how one mesh axis splits (or does not split) a tensor.

Tiny frozen value classes with DTensor's meaning. PyTorch's own placement objects
are accepted too (recognised by class name, so torch is not imported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reshard.errors import LayoutError

__all__ = ["Placement", "Replicate", "Shard", "StridedShard", "as_placement", "chunk_bounds"]


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``torch.chunk`` splits ``size`` in ``num_chunks``.

    Chunks are ceil-sized; trailing chunks may be short or empty, exactly as DTensor
    fills them.
    """
    chunk = -(-size // num_chunks) if size else 0
    start = min(index * chunk, size)
    return start, min(start + chunk, size)


@dataclass(frozen=True)
class Replicate:
    """Every coordinate along the mesh axis holds the whole (current) tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """The mesh axis splits tensor dim ``dim`` with ``torch.chunk`` semantics."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise LayoutError(f"Shard dim must be an int >= 0, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class StridedShard:
    """PyTorch's ``_StridedShard``: right-to-left sharding written left to right.

    The dim is first chunked into ``split_factor`` pieces, each piece is chunked over
    the mesh axis, and coordinate ``i`` holds the ``i``-th chunk of every piece,
    concatenated (FSDP2 on top of tensor parallelism).
    """

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise LayoutError(f"StridedShard dim must be an int >= 0, got {self.dim!r}")
        if (not isinstance(self.split_factor, int) or isinstance(self.split_factor, bool)
                or self.split_factor < 1):
            raise LayoutError(
                f"StridedShard split_factor must be an int >= 1, got {self.split_factor!r}"
            )

    def __str__(self) -> str:
        return f"_S({self.dim},{self.split_factor})"


Placement = Replicate | Shard | StridedShard


def as_placement(obj: Any) -> Placement:
    """Return our placement for ``obj`` (ours, PyTorch's, or a short string like ``"S(0)"``)."""
    if isinstance(obj, Replicate | Shard | StridedShard):
        return obj
    kind = type(obj).__name__
    if kind == "Replicate":
        return Replicate()
    if kind == "_StridedShard":
        return StridedShard(int(obj.dim), int(obj.split_factor))
    if kind == "Shard":
        return Shard(int(obj.dim))
    if kind in ("Partial", "_Partial", "_NormPartial", "MaskPartial"):
        raise LayoutError(
            f"Partial placements are not supported: reduce the tensor first (got {obj!r})"
        )
    if isinstance(obj, str):
        return _parse(obj)
    raise LayoutError(f"expected a placement (Shard, Replicate, StridedShard), got {obj!r}")


def _parse(text: str) -> Placement:
    t = text.replace(" ", "")
    try:
        if t == "R":
            return Replicate()
        if t.startswith("S(") and t.endswith(")"):
            return Shard(int(t[2:-1]))
        if t.startswith("_S(") and t.endswith(")"):
            dim, factor = t[3:-1].split(",")
            return StridedShard(int(dim), int(factor))
    except ValueError:
        pass
    raise LayoutError(f"expected a placement string like 'R', 'S(0)' or '_S(0,2)', got {text!r}")
