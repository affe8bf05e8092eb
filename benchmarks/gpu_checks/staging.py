"""Stagers: one rank's copies between its tensors and its staging arena, as the
executor makes them (:class:`LibraryStager`, ``RankRunner``'s own code driven without a
process group) or with plain slicing and ``copy_`` (:class:`PlainStager`), and the
helpers that run and verify them round by round."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reshard.layout import box_slices
from reshard.schedule import Schedule

from .results import one_line

ALIGN = 16  # bytes: where each region starts in a plain arena


class _NoComm:
    """What ``RankRunner`` reads from a communicator before any message: the rank."""

    matches_by_tag = True
    backend = "none"

    def __init__(self, rank: int) -> None:
        self.rank, self.size = rank, rank + 1


class LibraryStager:
    """The executor's own staging code driven without a process group: ``RankRunner``'s
    arena layout (messages end to end, round by round) and its ``_pack`` / ``_unpack``
    copies through ``RegionViews``."""

    name = "library"

    def __init__(self, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                 device: str) -> None:
        from reshard._transport.runner import RankRunner

        self.runner = RankRunner(schedule, _NoComm(rank), dtypes=dtypes)
        self.runner.device = torch.device(device)
        # every message staged, at its place in the full layout (a run stages only those
        # that cannot travel in place, RankRunner._staged)
        self.arenas = {side: torch.empty(n, dtype=torch.uint8, device=device)
                       for side, n in zip(("pack", "unpack"), self.runner.staging_bytes)}
        self._rounds = {side: [[(a, b, hops, offsets) for _, a, b, hops, offsets in r[i][0]]
                               for r in self.runner.rounds]
                        for side, i in (("pack", 2), ("unpack", 3))}

    def messages(self, side: str) -> list[list[tuple]]:
        """Per round with anything to copy: (start, stop, hops, offsets) per message."""
        return [msgs for msgs in self._rounds[side] if msgs]

    def bind(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.runner.views.bind(src, dst)

    def unbind(self) -> None:
        self.runner.views.unbind()

    def copy(self, side: str, msgs: list[tuple]) -> None:
        runner = self.runner
        for a, b, hops, offsets in msgs:
            if side == "pack":
                runner._pack(self.arenas["pack"], a, b, hops, offsets)
            else:
                runner._unpack(self.arenas["unpack"], a, hops, offsets)
        if runner.read_error is not None:  # _pack keeps the protocol whole; we may not
            raise runner.read_error


def lay_out(hops: list, peer_of: Callable[[Any], int]) -> list[tuple]:
    """Messages (start, stop, hops, offsets within the message), one per peer in peer
    order, end to end, every region at an ``ALIGN``-byte boundary."""
    by_peer: dict[int, list] = {}
    for h in hops:
        by_peer.setdefault(peer_of(h), []).append(h)
    out, pos = [], 0
    for peer in sorted(by_peer):
        start = pos = -(-pos // ALIGN) * ALIGN
        offsets = []
        for h in by_peer[peer]:
            pos = -(-pos // ALIGN) * ALIGN
            offsets.append(pos - start)
            pos += h.nbytes
        out.append((start, pos, by_peer[peer], offsets))
    return out


class PlainStager:
    """The same copies with plain slicing and ``copy_``, laid out by :func:`lay_out`: for
    when the library's staging code cannot be driven without a process group."""

    name = "plain"

    def __init__(self, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                 device: str) -> None:
        self.dtypes = dtypes
        remote = [[h for h in hops if not h.is_local] for hops in schedule.rounds]
        self._rounds = {
            "pack": [lay_out([h for h in r if h.src_rank == rank], lambda h: h.dst_rank)
                     for r in remote],
            "unpack": [lay_out([h for h in r if h.dst_rank == rank], lambda h: h.src_rank)
                       for r in remote]}
        self.arenas = {side: torch.empty(max((m[1] for ms in rounds for m in ms), default=0),
                                         dtype=torch.uint8, device=device)
                       for side, rounds in self._rounds.items()}
        self.src: dict[str, torch.Tensor] = {}
        self.dst: dict[str, torch.Tensor] = {}

    def messages(self, side: str) -> list[list[tuple]]:
        return [msgs for msgs in self._rounds[side] if msgs]

    def bind(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.src, self.dst = src, dst

    def unbind(self) -> None:
        self.src, self.dst = {}, {}

    def copy(self, side: str, msgs: list[tuple]) -> None:
        arena = self.arenas[side]
        for a, _, hops, offsets in msgs:
            for h, off in zip(hops, offsets):
                slot = arena[a + off:a + off + h.nbytes].view(self.dtypes[h.name]).view(h.size)
                if side == "pack":
                    slot.copy_(self.src[h.name][box_slices(h.src_offset, h.size)])
                else:
                    self.dst[h.name][box_slices(h.dst_offset, h.size)].copy_(slot)


def make_stager(kind: str, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                device: str):
    """The library's stager (``kind="library"``), or the plain one: when asked for, or
    when the library's cannot be driven (its name then says why)."""
    if kind == "library":
        try:
            return LibraryStager(schedule, rank, dtypes, device)
        except (ImportError, AttributeError, TypeError, ValueError, IndexError) as e:
            stager = PlainStager(schedule, rank, dtypes, device)
            stager.name = f"plain (library staging not reachable: {one_line(e)})"
            return stager
    return PlainStager(schedule, rank, dtypes, device)


def copy_all(stager, side: str, rounds: list[list[tuple]], src: dict, dst: dict) -> None:
    """One refit's worth of one side's copies: bind, every round, unbind."""
    stager.bind(src, dst)
    try:
        for msgs in rounds:
            stager.copy(side, msgs)
    finally:
        stager.unbind()


def region_bytes(tensors: dict[str, torch.Tensor], side: str, h) -> torch.Tensor:
    """The bytes of hop ``h``'s region in the rank's own tensor (source when packing,
    destination when unpacking), in row-major order."""
    offset = h.src_offset if side == "pack" else h.dst_offset
    region = tensors[h.name][box_slices(offset, h.size)]
    return region.contiguous().reshape(-1).view(torch.uint8)


def verify_copies(stager, side: str, rounds: list[list[tuple]], src: dict, dst: dict) -> bool:
    """Copy every round once and compare, region by region, the arena's bytes with the
    tensor's (before unpacking, the arena is filled with random bytes)."""
    tensors, arena, ok = (src if side == "pack" else dst), stager.arenas[side], True
    stager.bind(src, dst)
    try:
        for msgs in rounds:
            if side == "unpack":
                for a, b, _, _ in msgs:
                    arena[a:b].random_(0, 256)
            stager.copy(side, msgs)
            ok = ok and all(torch.equal(region_bytes(tensors, side, h),
                                        arena[a + off:a + off + h.nbytes])
                            for a, _, hops, offsets in msgs for h, off in zip(hops, offsets))
    finally:
        stager.unbind()
    return ok
