"""The plan of one tensor (:class:`TensorPlan`: a shared template bound to this
tensor's layouts and its chosen senders) and the region copies it expands into
(:class:`Transfer`). :class:`reshard.planner.Plan` holds one per tensor;
:mod:`reshard.stats` counts them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from reshard._template import Template
from reshard.layout import Layout

__all__ = ["TensorPlan", "Transfer"]


@dataclass(frozen=True)
class Transfer:
    """Copy ``size`` elements from ``src_rank``'s local tensor at ``src_offset`` to
    ``dst_rank``'s local tensor at ``dst_offset`` (a local copy when the ranks match)."""

    name: str
    src_rank: int
    dst_rank: int
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    size: tuple[int, ...]
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class TensorPlan:
    """The plan of one tensor: a shared template plus this tensor's ranks and senders."""

    name: str
    src: Layout
    dst: Layout
    template: Template
    senders: tuple[tuple[int, tuple[int, ...]], ...]  # (unit index, src slot per remote needer)

    def transfers(self, rank: int | None = None) -> Iterator[Transfer]:
        """Transfers of this tensor, all of them or those that ``rank`` sends or receives."""
        if rank is not None and rank not in self.src.rank_set and rank not in self.dst.rank_set:
            return
        chosen = dict(self.senders)
        src_ranks, dst_ranks = self.src.ranks, self.dst.ranks
        for i, u in enumerate(self.template.units):
            holders = u.holders
            for k, dst_slot, dst_off in u.local:
                r = dst_ranks[dst_slot]
                if rank is None or rank == r:
                    yield Transfer(self.name, r, r, holders[k][1], dst_off, u.size, u.nbytes)
            picks = chosen.get(i)
            for j, (dst_slot, dst_off) in enumerate(u.remote):
                src_slot = picks[j] if picks else holders[0][0]
                s, d = src_ranks[src_slot], dst_ranks[dst_slot]
                if rank is None or rank in (s, d):
                    src_off = next(o for slot, o in holders if slot == src_slot)
                    yield Transfer(self.name, s, d, src_off, dst_off, u.size, u.nbytes)
