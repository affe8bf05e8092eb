"""Run a schedule on one rank over torch.distributed point-to-point messages.

Per round, everything this rank sends to one peer is packed into one contiguous byte
buffer and everything it receives from one peer arrives in one; sends and receives of
the round are posted together (``batch_isend_irecv``), then received bytes are
unpacked straight into the destination tensors. Works on any backend and device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .comm import Comm
from .schedule import DEST, Hop, Schedule

_ALIGN = 16


@dataclass
class RunStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    num_messages: int = 0
    peak_staging_bytes: int = 0
    rounds: int = 0
    per_peer_sent: dict[int, int] = field(default_factory=dict)


def _box(offset, size) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offset, size))


def _layout_message(hops: list[Hop]) -> tuple[list[int], int]:
    """Byte offsets of each hop inside the packed message (aligned), and its length."""
    offsets, pos = [], 0
    for h in hops:
        offsets.append(pos)
        pos += -(-h.nbytes // _ALIGN) * _ALIGN
    return offsets, pos


class RankRunner:
    """Carries out one rank's part of a schedule against its local tensors."""

    def __init__(self, schedule: Schedule, comm: Comm, *,
                 dtypes: Mapping[str, torch.dtype]) -> None:
        self.comm, self.rank, self.dtypes = comm, comm.rank, dtypes
        rank = comm.rank
        self.rounds = [self._split_round(k, hops) for k, hops in _my_rounds(schedule, rank)]
        self.src: Mapping[str, torch.Tensor] = {}
        self.dst: Mapping[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.stats = RunStats()

    def _split_round(self, k: int, hops: list[Hop]):
        sends: dict[int, list[Hop]] = {}
        recvs: dict[int, list[Hop]] = {}
        local: list[Hop] = []
        for h in hops:
            if h.is_local:
                local.append(h)
            elif h.src_rank == self.rank:
                sends.setdefault(h.dst_rank, []).append(h)
            else:
                recvs.setdefault(h.src_rank, []).append(h)
        return k, local, sorted(sends.items()), sorted(recvs.items())

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> RunStats:
        """Move this rank's bytes: read ``src`` (name -> local tensor), write ``dst``."""
        self.src, self.dst, self.stats = src, dst, RunStats()
        self.device = _device_of(src, dst)
        for _, local, sends, recvs in self.rounds:
            self._run_round(local, sends, recvs)
        return self.stats

    def _run_round(self, local, sends, recvs) -> None:
        posted_recvs, posted_sends, unpack, staging = [], [], [], 0
        for peer, hops in recvs:
            offsets, nbytes = _layout_message(hops)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            posted_recvs.append((buf, peer))
            unpack.append((hops, offsets, buf))
            staging += nbytes
            self.stats.bytes_received += sum(h.nbytes for h in hops)
        for peer, hops in sends:
            buf = self._pack(hops)
            posted_sends.append((buf, peer))
            staging += buf.numel()
            sent = sum(h.nbytes for h in hops)
            self.stats.bytes_sent += sent
            self.stats.per_peer_sent[peer] = self.stats.per_peer_sent.get(peer, 0) + sent
        self.stats.num_messages += len(sends)
        works = self.comm.exchange(posted_sends, posted_recvs)
        for h in local:  # local copies overlap the messages in flight
            self._dst_view(h).copy_(self._read(h))
            self.stats.bytes_local += h.nbytes
        for w in works:
            w.wait()
        for hops, offsets, buf in unpack:
            for h, off in zip(hops, offsets):
                dst = self._dst_view(h)
                dst.copy_(buf[off:off + h.nbytes].view(dst.dtype).view(h.size))
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, staging)
        self.stats.rounds += 1

    def _pack(self, hops: list[Hop]) -> torch.Tensor:
        offsets, nbytes = _layout_message(hops)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        for h, off in zip(hops, offsets):
            dtype = self.dtypes[h.name]
            buf[off:off + h.nbytes].view(dtype).view(h.size).copy_(self._read(h))
        return buf

    def _read(self, h: Hop) -> torch.Tensor:
        tensor = self.dst[h.name] if h.read_from == DEST else self.src[h.name]
        return tensor[_box(h.src_offset, h.size)]

    def _dst_view(self, h: Hop) -> torch.Tensor:
        return self.dst[h.name][_box(h.dst_offset, h.size)]


def _my_rounds(schedule: Schedule, rank: int):
    for k, hops in enumerate(schedule.rounds):
        mine = [h for h in hops if rank in (h.src_rank, h.dst_rank)]
        if mine:
            yield k, mine


def _device_of(*maps: Mapping[str, torch.Tensor]) -> torch.device:
    for m in maps:
        for t in m.values():
            return t.device
    return torch.device("cpu")
