"""Run a schedule on one rank over torch.distributed point-to-point messages.

Per round, everything this rank sends to one peer is packed into one contiguous byte
buffer and everything it receives from one peer arrives in one; sends and receives of
the round are posted together (``batch_isend_irecv``), then received bytes are
unpacked straight into the destination tensors. Works on any backend and device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .comm import Comm
from .errors import TransferError
from .layout import box_slices
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



def _layout_message(hops: list[Hop]) -> tuple[list[int], int]:
    """Byte offsets of each hop inside the packed message (each aligned), and its length
    (a one-hop message is exactly the region's bytes)."""
    offsets, pos = [], 0
    for h in hops:
        pos = -(-pos // _ALIGN) * _ALIGN
        offsets.append(pos)
        pos += h.nbytes
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
        self.progress: Callable[[int, int], None] | None = None
        self.read_error: BaseException | None = None

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
        return k, local, _arena_layout(sends), _arena_layout(recvs)

    @property
    def staging_bytes(self) -> tuple[int, int]:
        """(send arena, receive arena) sizes: the most any round stages."""
        send = max((r[2][1] for r in self.rounds), default=0)
        recv = max((r[3][1] for r in self.rounds), default=0)
        return send, recv

    def _arenas(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging buffers, allocated once and reused by every round and every run."""
        key = self.device
        if getattr(self, "_arena_key", None) != key:
            send, recv = self.staging_bytes
            self._send_arena = torch.empty(send, dtype=torch.uint8, device=key)
            self._recv_arena = torch.empty(recv, dtype=torch.uint8, device=key)
            self._arena_key = key
        return self._send_arena, self._recv_arena

    def release(self) -> None:
        """Free the staging buffers (they are re-made on the next run)."""
        self._arena_key = None
        self._send_arena = self._recv_arena = None

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> RunStats:
        """Move this rank's bytes: read ``src`` (name -> local tensor), write ``dst``.

        Messages that need no packing (a lone contiguous region) are posted up front,
        each tagged with its round, exactly as the bare floor exchange does; packed
        messages go round by round through the staging arenas; forwards wait for the
        rounds that brought their bytes in."""
        self.src, self.dst, self.stats = src, dst, RunStats()
        self.device = _device_of(src, dst)
        self.read_error = None
        send_arena, recv_arena = self._arenas()
        self.stats.peak_staging_bytes = send_arena.numel() + recv_arena.numel()
        total = sum(h.nbytes for *_, sends, _ in self.rounds for *_, hops, _ in sends[0]
                    for h in hops)
        try:
            early = self._post_direct()
            for k, local, sends, recvs in self.rounds:
                self._run_round(k, local, sends[0], recvs[0], send_arena, recv_arena, early)
                self.stats.rounds += 1
                if self.progress is not None:
                    self.progress(self.stats.bytes_sent, total)
            for works in early.values():
                for w in works:
                    w.wait()
        except RuntimeError as e:  # a peer died or timed out
            raise TransferError(f"rank {self.rank}: transfer failed in round "
                                f"{self.stats.rounds}: {str(e).splitlines()[0]}") from e
        if self.read_error is not None:
            raise TransferError(f"rank {self.rank}: reading a source tensor failed midway "
                                f"({self.read_error!r}); its peers got placeholder bytes and "
                                "this refit must be discarded") from self.read_error
        return self.stats

    def _post_direct(self) -> dict[int, list[Any]]:
        """Post every unpacked receive, and every unpacked send that reads a source
        tensor, now; return the works by round."""
        self._direct: dict[tuple[int, str, int], torch.Tensor] = {}
        early: dict[int, list[Any]] = {}
        for k, _, sends, recvs in self.rounds:
            for peer, _, _, hops, _ in recvs[0]:
                buf = self._direct_dst(hops)
                if buf is not None:
                    self._direct[k, "recv", peer] = buf
                    early.setdefault(k, []).extend(self.comm.exchange((), [(buf, peer)], k))
                    self.stats.bytes_received += hops[0].nbytes
            for peer, _, _, hops, _ in sends[0]:
                if hops[0].read_from == DEST:
                    continue
                buf = self._direct_src(hops)
                if buf is not None:
                    self._direct[k, "send", peer] = buf
                    early.setdefault(k, []).extend(self.comm.exchange([(buf, peer)], (), k))
                    self._count_sent(peer, hops)
        return early

    def _count_sent(self, peer: int, hops: list[Hop]) -> None:
        sent = sum(h.nbytes for h in hops)
        self.stats.bytes_sent += sent
        self.stats.per_peer_sent[peer] = self.stats.per_peer_sent.get(peer, 0) + sent
        self.stats.num_messages += 1

    def _run_round(self, k, local, sends, recvs, send_arena, recv_arena, early) -> None:
        packed_recvs = [r for r in recvs if (k, "recv", r[0]) not in self._direct]
        recv_works = self.comm.exchange((), [(recv_arena[a:b], peer)
                                             for peer, a, b, _, _ in packed_recvs], k)
        send_works = []
        if any(hops[0].read_from == DEST for *_, hops, _ in sends):
            for j in [j for j in early if j < k]:  # forwards need their bytes in place
                for w in early.pop(j):
                    w.wait()
        for peer, a, b, hops, offsets in sends:  # pack one peer, post it, pack the next
            if (k, "send", peer) in self._direct:
                continue
            buf = self._direct_src(hops)
            if buf is None:
                buf = send_arena[a:b]
                try:
                    for h, off in zip(hops, offsets):
                        buf[off:off + h.nbytes].view(self.dtypes[h.name]).view(
                            h.size).copy_(self._read(h))
                except Exception as e:  # keep the protocol whole: peers get their bytes
                    self.read_error = self.read_error or e
                    buf.zero_()
            send_works += self.comm.exchange([(buf, peer)], (), k)
            self._count_sent(peer, hops)
        for h in local:  # local copies overlap the messages in flight
            try:
                self._dst_view(h).copy_(self._read(h))
            except Exception as e:
                self.read_error = self.read_error or e
            self.stats.bytes_local += h.nbytes
        for work, (_, a, _, hops, offsets) in zip(recv_works, packed_recvs):
            work.wait()
            buf = recv_arena[a:]
            for h, off in zip(hops, offsets):
                dst = self._dst_view(h)
                dst.copy_(buf[off:off + h.nbytes].view(dst.dtype).view(h.size))
                self.stats.bytes_received += h.nbytes
        for work in send_works:
            work.wait()

    def _direct_src(self, hops: list[Hop]) -> torch.Tensor | None:
        """The source region itself as the message, when it alone makes the message and
        is contiguous in the destination dtype (no packing copy)."""
        if len(hops) != 1:
            return None
        try:
            view = self._read(hops[0])
        except Exception:
            return None
        if not view.is_contiguous() or view.dtype != self.dtypes[hops[0].name]:
            return None
        return view.reshape(-1).view(torch.uint8)

    def _direct_dst(self, hops: list[Hop]) -> torch.Tensor | None:
        """The destination region itself as the receive buffer, when it can be."""
        if len(hops) != 1:
            return None
        view = self._dst_view(hops[0])
        return view.reshape(-1).view(torch.uint8) if view.is_contiguous() else None

    def _read(self, h: Hop) -> torch.Tensor:
        tensor = self.dst[h.name] if h.read_from == DEST else self.src[h.name]
        return tensor[box_slices(h.src_offset, h.size)]

    def _dst_view(self, h: Hop) -> torch.Tensor:
        return self.dst[h.name][box_slices(h.dst_offset, h.size)]


def _arena_layout(by_peer: dict[int, list[Hop]]):
    """[(peer, start, stop, hops, offsets within the message)] laid end to end, and the
    total length."""
    out, pos = [], 0
    for peer, hops in sorted(by_peer.items()):
        offsets, nbytes = _layout_message(hops)
        out.append((peer, pos, pos + nbytes, hops, offsets))
        pos = -(-(pos + nbytes) // _ALIGN) * _ALIGN
    return out, pos


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
