"""Schedules: a plan's transfers as hops, grouped into rounds that fit a staging budget.

A :class:`Hop` moves one box from a rank's source tensor (or, when forwarding inside a
fast domain, from its already-written destination tensor) to another rank's
destination tensor. A :class:`Schedule` is a list of rounds; inside a round every rank
packs all hops to one peer into one message. Rounds are a pure function of the plan, so
both ends of every pair agree on them without talking.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from math import prod

from reshard.planner import Plan
from reshard.tensor_plan import Transfer

__all__ = ["Hop", "Schedule", "flat_schedule", "split_hop"]

SOURCE, DEST = 0, 1  # where a hop reads from: the sender's source or destination tensor


@dataclass(frozen=True)
class Hop(Transfer):
    """A :class:`Transfer` as scheduled: where the sender reads it from, the round
    whose arrival a forward waits for, and (a relay between replicas) the tensor a
    forward reads when it is not the one it writes."""

    read_from: int = SOURCE
    after: int = -1
    read_name: str = ""

    @property
    def reads(self) -> str:
        """The name of the tensor the sender reads."""
        return self.read_name or self.name


@dataclass(frozen=True)
class Schedule:
    rounds: tuple[tuple[Hop, ...], ...]
    method: str
    budget_bytes: int
    fanout: str = "direct"
    """How domains that need the same region were fed: ``direct`` or ``relay``
    (:mod:`reshard.fanout`)."""

    def hops(self, rank: int | None = None) -> Iterator[tuple[int, Hop]]:
        """(round, hop) of every hop, or of those ``rank`` sends or receives."""
        for k, hops in enumerate(self.rounds):
            for h in hops:
                if rank is None or rank in (h.src_rank, h.dst_rank):
                    yield k, h

    def bytes_by_pair(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for _, h in self.hops():
            if not h.is_local:
                out[h.src_rank, h.dst_rank] = out.get((h.src_rank, h.dst_rank), 0) + h.nbytes
        return out


def split_hop(hop: Hop, max_bytes: int) -> list[Hop]:
    """Cut a hop into boxes of at most ``max_bytes`` (along its outermost dims)."""
    if hop.nbytes <= max_bytes or prod(hop.size) <= 1:
        return [hop]
    item = hop.nbytes // prod(hop.size)
    d = next(i for i, n in enumerate(hop.size) if n > 1)
    per_row = item * prod(hop.size[d + 1:])
    rows = max(1, max_bytes // per_row)
    out: list[Hop] = []
    for start in range(0, hop.size[d], rows):
        n = min(rows, hop.size[d] - start)
        size = hop.size[:d] + (n,) + hop.size[d + 1:]
        part = replace(hop, src_offset=_bump(hop.src_offset, d, start),
                       dst_offset=_bump(hop.dst_offset, d, start), size=size,
                       nbytes=per_row * n)
        out.extend(split_hop(part, max_bytes))
    return out


def _bump(offset: tuple[int, ...], d: int, by: int) -> tuple[int, ...]:
    return offset[:d] + (offset[d] + by,) + offset[d + 1:]


class RoundPacker:
    """First fit of hops into rounds: a hop goes to the earliest round (after the one it
    waits for) where neither end's staging (bytes sent + received in that round) would
    exceed the budget. Hops marked ``network`` also respect a smaller per-round cap, so
    that a round keeps room to forward what the previous round brought in: that is what
    makes the network stage and the forwarding stage overlap. The cap holds each way
    apart (links are full duplex): a relay receives a chunk and sends one per round."""

    def __init__(self, budget_bytes: int, network_cap: int | None = None,
                 staging_cap: int | None = None) -> None:
        self.budget = budget_bytes
        self.network_cap = network_cap or budget_bytes
        self.staging_cap = staging_cap or budget_bytes
        self.rounds: list[list[Hop]] = []
        self.used: list[dict[int, int]] = []
        self.net_used: list[dict[int, int]] = []
        self.staged: list[dict[int, int]] = []  # bytes a receiver stages, per round
        self.pairs: list[dict[tuple[int, int], bool]] = []
        self.first_free: dict[int, int] = {}

    def add(self, hop: Hop, *, network: bool = False, solo: bool = False,
            staged: bool = False) -> int:
        """Place one hop (no larger than the budget); return its round. A ``solo`` hop is
        the only one between its two ranks in its round, so its message is the region
        itself and can travel without packing when it is contiguous in memory. A
        ``staged`` hop lands in its receiver's staging arena (it is packed with others,
        or not contiguous there): a round stages at most the staging cap per receiver."""
        k = self._fit(hop, network, solo, staged)
        while len(self.rounds) <= k:
            self.rounds.append([])
            self.used.append({})
            self.net_used.append({})
            self.staged.append({})
            self.pairs.append({})
        self.rounds[k].append(hop)
        if not hop.is_local:
            self.pairs[k][hop.src_rank, hop.dst_rank] = solo
            if staged:
                self.staged[k][hop.dst_rank] = self.staged[k].get(hop.dst_rank, 0) + hop.nbytes
            for end in ((hop.src_rank, "out"), (hop.dst_rank, "in")):
                r = end[0]
                self.used[k][r] = self.used[k].get(r, 0) + hop.nbytes
                if network:
                    self.net_used[k][end] = self.net_used[k].get(end, 0) + hop.nbytes
                self._advance(r)
        return k

    def _advance(self, r: int) -> None:
        k = self.first_free.get(r, 0)
        while k < len(self.used) and self.used[k].get(r, 0) >= self.budget:
            k += 1
        self.first_free[r] = k

    def _fits(self, k: int, end: tuple[int, str], nbytes: int, network: bool) -> bool:
        if self.used[k].get(end[0], 0) + nbytes > self.budget:
            return False
        return not network or self.net_used[k].get(end, 0) + nbytes <= self.network_cap

    def _pair_free(self, k: int, hop: Hop, solo: bool) -> bool:
        pair = self.pairs[k].get((hop.src_rank, hop.dst_rank))
        return pair is None if solo else pair is not True

    def _fit(self, hop: Hop, network: bool, solo: bool, staged: bool = False) -> int:
        k = hop.after + 1
        if hop.is_local:
            return k
        ends = ((hop.src_rank, "out"), (hop.dst_rank, "in"))
        k = max(k, *(self.first_free.get(r, 0) for r, _ in ends))
        while k < len(self.used) and not (
                self._pair_free(k, hop, solo)
                and all(self._fits(k, r, hop.nbytes, network) for r in ends)
                and (not staged or self._stage_fits(k, hop))):
            k += 1
        return k

    def _stage_fits(self, k: int, hop: Hop) -> bool:
        return self.staged[k].get(hop.dst_rank, 0) + hop.nbytes <= self.staging_cap

    def result(self) -> tuple[tuple[Hop, ...], ...]:
        return tuple(tuple(r) for r in self.rounds)


SOLO_MIN_BYTES = 256 << 10
"""Regions at least this large that are contiguous in memory on one side travel alone in
their round (no packing copy on that side); smaller ones are packed together. 256 KiB
(was 1 MiB): an engine rank's k or v projection at Qwen2.5-1.5B shapes (2 kv heads,
one a rank: 384 KiB in bf16) then lands in place instead of in the receive arena
(22 MB of them at 28 layers), at the cost of a few more, smaller rounds."""


def contiguous_box(offset: tuple[int, ...], size: tuple[int, ...],
                   shape: tuple[int, ...]) -> bool:
    """Whether a box of a row-major tensor of ``shape`` is one contiguous memory range."""
    first = next((i for i, n in enumerate(size) if n != 1), len(size))
    return all(size[i] == shape[i] for i in range(first + 1, len(size)))


def contiguous_run(hop: Hop, shape: tuple[int, ...]) -> int:
    """Bytes of the largest parts :func:`split_hop` can cut ``hop`` into that each lie
    contiguous in a row-major tensor of ``shape`` (its box one row of its outer dims)."""
    inner = len(shape)
    while inner > 0 and hop.size[inner - 1] == shape[inner - 1]:
        inner -= 1
    return hop.nbytes // prod(hop.size[:max(inner - 1, 0)] or (1,))


def is_solo(hop: Hop, plan: Plan) -> bool:
    """Large, not a local copy, and contiguous at its source or its destination."""
    if hop.is_local or hop.nbytes < SOLO_MIN_BYTES:
        return False
    t = plan[hop.name]
    reader = plan[hop.reads].dst if hop.read_from == DEST else t.src
    return (contiguous_box(hop.src_offset, hop.size, reader.local_shape(hop.src_rank))
            or contiguous_box(hop.dst_offset, hop.size, t.dst.local_shape(hop.dst_rank)))


def lands_in_place(hop: Hop, plan: Plan, solo: bool) -> bool:
    """Whether a hop's message is its region alone, contiguous in the receiver's tensor:
    it arrives with no staging copy there."""
    return solo and contiguous_box(hop.dst_offset, hop.size,
                                   plan[hop.name].dst.local_shape(hop.dst_rank))


def pack_rounds(hops: Iterable[Hop], budget_bytes: int, plan: Plan | None = None,
                staging_bytes: int | None = None) -> tuple[tuple[Hop, ...], ...]:
    """Rounds for hops that depend on nothing (the flat schedule). ``staging_bytes``
    (with a plan): at most this many bytes a round lands in a receiver's staging arena.
    A hop that would be staged there (strided in the receiver's tensor, or packed with
    others) is cut (:func:`split_hop`) into parts that each lie contiguous there where
    those are large enough to travel alone (:data:`SOLO_MIN_BYTES`: they land in place,
    staged nowhere), else into parts of at most the cap."""
    packer = RoundPacker(budget_bytes, staging_cap=staging_bytes)
    for hop in hops:
        for part in split_hop(hop, max(1, budget_bytes // 2)):
            if plan is None:
                packer.add(part)
            else:
                add_capped(packer, part, plan, staging_bytes)
    return packer.result()


def add_capped(packer: RoundPacker, hop: Hop, plan: Plan, staging_bytes: int | None) -> None:
    """Place a hop of no dependency, cut where it would be staged on its receiver
    (:func:`pack_rounds`); a local copy stages nothing and goes whole."""
    solo = is_solo(hop, plan)
    if not staging_bytes or hop.is_local or lands_in_place(hop, plan, solo):
        packer.add(hop, solo=solo)
        return
    run = contiguous_run(hop, plan[hop.name].dst.local_shape(hop.dst_rank))
    if SOLO_MIN_BYTES <= run < hop.nbytes:  # parts that land in place, alone
        pieces = split_hop(hop, min(run, staging_bytes))
    elif hop.nbytes > staging_bytes:
        pieces = split_hop(hop, staging_bytes)
    else:
        packer.add(hop, solo=solo, staged=True)
        return
    for piece in pieces:
        solo = is_solo(piece, plan)
        packer.add(piece, solo=solo, staged=not lands_in_place(piece, plan, solo))


def _plan_hops(plan: Plan) -> Iterator[Hop]:
    for t in plan.transfers():
        yield Hop(t.name, t.src_rank, t.dst_rank, t.src_offset, t.dst_offset, t.size, t.nbytes)


def flat_schedule(plan: Plan, budget_bytes: int, staging_bytes: int | None = None) -> Schedule:
    """Every transfer straight from its chosen sender to its destination (``p2p``);
    ``staging_bytes``: see :func:`pack_rounds`."""
    return Schedule(pack_rounds(_plan_hops(plan), budget_bytes, plan, staging_bytes), "p2p",
                    budget_bytes)
