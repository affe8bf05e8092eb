"""Run a schedule on one rank over torch.distributed point-to-point messages.

Per round, everything this rank sends to one peer is packed into one contiguous byte
buffer and everything it receives from one peer arrives in one; sends and receives of
the round are posted together (``batch_isend_irecv``), then received bytes are
unpacked straight into the destination tensors. Works on any backend and device.

A message that is one contiguous region in the right dtype travels without staging:
straight out of the source tensor, straight into the destination tensor. Only the
others take room in the staging arenas, which are laid out for them alone (per round,
end to end, from the tensors of the run): a receiver whose regions all arrive in place,
as an inference engine's logical buffers mostly do, holds next to no arena.

Gloo matches a pair's messages by tag, so messages that need no packing are posted up
front, tagged with their round. NCCL ignores tags and matches in posting order, and
two ranks exchanging both ways must post in one group call: on such backends each
round is posted whole (every send and receive of the round in one call), in round
order (``RankRunner.ordered``, chosen from :attr:`reshard.comm.Comm.matches_by_tag`).

Two options, both off by default: a ``deadline`` (every wait of a run ends by then, on
gloo; a lost peer is a :class:`TransferError`, not a hang) and a per-message
``checksum`` (every message's digest is sent after the data; a mismatch is a
``TransferError`` on the receiving rank once every message has arrived, so the protocol
stays whole and the group stays usable). See ``docs/reliability.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from reshard._transport.integrity import CHECKSUMS, digest
from reshard._transport.views import RegionViews
from reshard.comm import Comm
from reshard.errors import TransferError
from reshard.schedule import DEST, Hop, Schedule

_ALIGN = 16
_DIGEST_TAG = (1 << 30) + 7  # the checksum messages' tag, above any round number
__all__ = ["CHECKSUMS", "RankRunner", "RunStats", "digest"]


@dataclass
class RunStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    num_messages: int = 0
    direct_messages: int = 0  # sent or received with no staging copy on this rank
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
        self._total_sent = sum(h.nbytes for *_, sends, _ in self.rounds
                               for *_, hops, _ in sends[0] for h in hops)
        self.views = RegionViews((h for _, hops in _my_rounds(schedule, rank) for h in hops),
                                 rank, dtypes)
        self.device = torch.device("cpu")
        self.stats = RunStats()
        self.progress: Callable[[int, int], None] | None = None
        self.read_error: BaseException | None = None
        # reliability options (off by default; see the module docstring)
        self.deadline: float | None = None  # time.monotonic() by which every wait ends
        self.checksum: str | None = None  # None, "sum", "crc32" or "hmac"
        self.digest_key: bytes | None = None  # "hmac": the meeting's key
        self.digest_label = b""  # "hmac": what tells this runner's messages from others'
        self._runs = 0  # "hmac": a message of an earlier run does not pass in this one
        self.on_receive: Callable[[int, int, torch.Tensor], None] | None = None  # test hook
        self.broken = False  # the last run failed in the transport: the group is unusable
        # NCCL matches messages only by posting order: post each round whole, in order
        self.ordered = not getattr(comm, "matches_by_tag", False)

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
        """(send arena, receive arena) sizes if every message were staged: the most any
        round would stage (a run stages only the messages that cannot travel in place,
        :meth:`_staged`)."""
        send = max((r[2][1] for r in self.rounds), default=0)
        recv = max((r[3][1] for r in self.rounds), default=0)
        return send, recv

    def _staged(self) -> tuple[dict[tuple[int, str, int], tuple[int, int]], int, int]:
        """Where each message that needs staging goes in its arena, for the tensors now
        bound: ``{(round, "send"|"recv", peer): (start, stop)}`` and the two arena sizes.
        A receive lands in place when its one region is contiguous in the destination,
        a send leaves from the source when its one region is contiguous in the sent
        dtype; the rest are laid end to end per round (:func:`_arena_layout`). Kept while
        the same tensors come back (the views' geometry key)."""
        key = self.views.bound_key
        if key is not None and getattr(self, "_staged_key", None) == key:
            return self._staged_layout
        where: dict[tuple[int, str, int], tuple[int, int]] = {}
        sizes = {"send": 0, "recv": 0}
        for k, _, sends, recvs in self.rounds:
            for kind, messages, in_place in (("send", sends[0], self.views.direct_src),
                                             ("recv", recvs[0], self.views.direct_dst)):
                staged, total = _arena_layout({peer: hops for peer, _, _, hops, _ in messages
                                               if in_place(hops) is None})
                where.update({(k, kind, peer): (a, b) for peer, a, b, _, _ in staged})
                sizes[kind] = max(sizes[kind], total)
        self._staged_key = key
        self._staged_layout = (where, sizes["send"], sizes["recv"])
        return self._staged_layout

    def _arenas(self, send: int, recv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Staging buffers of at least these sizes, reused by every round and every run
        while they are large enough."""
        key = self.device
        if (getattr(self, "_arena_key", None) != key or self._send_arena.numel() < send
                or self._recv_arena.numel() < recv):
            self._send_arena = self._recv_arena = None  # the old ones go first
            self._send_arena = torch.empty(send, dtype=torch.uint8, device=key)
            self._recv_arena = torch.empty(recv, dtype=torch.uint8, device=key)
            self._arena_key = key
            self.views.clear_slots()  # views into the old arenas
        return self._send_arena, self._recv_arena

    def release(self) -> None:
        """Free the staging buffers (they are re-made on the next run)."""
        self._arena_key = self._staged_key = None
        self._send_arena = self._recv_arena = None
        self.views.clear()

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> RunStats:
        """Move this rank's bytes: read ``src`` (name -> local tensor), write ``dst``.

        Messages that need no packing (a lone contiguous region) are posted up front,
        each tagged with its round, exactly as the bare floor exchange does; packed
        messages go round by round through the staging arenas; forwards wait for the
        rounds that brought their bytes in."""
        self.stats = RunStats()
        self._runs += 1
        self.device = _device_of(src, dst)
        self.read_error = None
        self.broken = False
        self._digests: dict[tuple[str, int], dict[int, int]] = {}  # (send|recv, peer) -> k -> d
        self._early_meta: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        self.views.bind(src, dst)
        self._where, send, recv = self._staged()
        send_arena, recv_arena = self._arenas(send, recv)
        self.stats.peak_staging_bytes = send_arena.numel() + recv_arena.numel()
        self._direct: dict[tuple[int, str, int], torch.Tensor] = {}
        try:
            return self._run_all(send_arena, recv_arena)
        finally:  # keep none of the caller's tensors past the run
            self.views.unbind()
            self._direct, self._early_meta, self._where = {}, {}, {}

    def _run_all(self, send_arena: torch.Tensor, recv_arena: torch.Tensor) -> RunStats:
        try:
            early = {} if self.ordered else self._post_direct()
            for k, local, sends, recvs in self.rounds:
                if self.ordered:
                    self._run_round_ordered(k, local, sends[0], recvs[0], send_arena,
                                            recv_arena)
                else:
                    self._run_round(k, local, sends[0], recvs[0], send_arena, recv_arena,
                                    early)
                self.stats.rounds += 1
                if self.progress is not None:
                    self.progress(self.stats.bytes_sent, self._total_sent)
            for k, works in early.items():
                self._finish_early(k, works)
            mismatch = self._exchange_digests() if self.checksum else None
        except RuntimeError as e:  # a peer died or timed out
            self.broken = True
            raise TransferError(f"rank {self.rank}: transfer failed in round "
                                f"{self.stats.rounds}: {str(e).splitlines()[0]}") from e
        if mismatch:
            raise TransferError(f"rank {self.rank}: {mismatch}; the received data is corrupt "
                                "and this refit must be discarded")
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
                buf = self.views.direct_dst(hops)
                if buf is not None:
                    self.stats.direct_messages += 1
                    self._direct[k, "recv", peer] = buf
                    early.setdefault(k, []).extend(self.comm.exchange((), [(buf, peer)], k))
                    self._early_meta.setdefault(k, []).append(("recv", peer, buf))
                    self.stats.bytes_received += hops[0].nbytes
            for peer, _, _, hops, _ in sends[0]:
                if hops[0].read_from == DEST:
                    continue
                buf = self.views.direct_src(hops)
                if buf is not None:
                    self.stats.direct_messages += 1
                    self._direct[k, "send", peer] = buf
                    early.setdefault(k, []).extend(self.comm.exchange([(buf, peer)], (), k))
                    self._early_meta.setdefault(k, []).append(("send", peer, buf))
                    if self.checksum:
                        self._note("send", k, peer, buf)
                    self._count_sent(peer, hops)
        return early

    def _count_sent(self, peer: int, hops: list[Hop]) -> None:
        sent = sum(h.nbytes for h in hops)
        self.stats.bytes_sent += sent
        self.stats.per_peer_sent[peer] = self.stats.per_peer_sent.get(peer, 0) + sent
        self.stats.num_messages += 1

    def _run_round(self, k, local, sends, recvs, send_arena, recv_arena, early) -> None:
        packed_recvs = [(peer, *self._where[k, "recv", peer], hops, offsets)
                        for peer, _, _, hops, offsets in recvs
                        if (k, "recv", peer) not in self._direct]
        recv_works = self.comm.exchange((), [(recv_arena[a:b], peer)
                                             for peer, a, b, _, _ in packed_recvs], k)
        send_works = []
        if any(hops[0].read_from == DEST for *_, hops, _ in sends):
            for j in [j for j in early if j < k]:  # forwards need their bytes in place
                self._finish_early(j, early.pop(j))
        for peer, a, b, hops, offsets in sends:  # pack one peer, post it, pack the next
            if (k, "send", peer) in self._direct:
                continue
            # source reads were tried for the unpacked path up front; forwards only now
            buf = self.views.direct_src(hops) if hops[0].read_from == DEST else None
            if buf is None:
                a, b = self._where[k, "send", peer]
                buf = self._pack(send_arena, a, b, hops, offsets)
            else:
                self.stats.direct_messages += 1
            send_works += self.comm.exchange([(buf, peer)], (), k)
            if self.checksum:  # while it travels (the buffer is only read)
                self._note("send", k, peer, buf)
            self._count_sent(peer, hops)
        self._copy_local(local)
        if len(recv_works) != len(packed_recvs):  # one coalesced work for all (NCCL)
            for work in recv_works:
                self._wait(work)
            recv_works = [None] * len(packed_recvs)
        for work, (peer, a, b, hops, offsets) in zip(recv_works, packed_recvs):
            if work is not None:
                self._wait(work)
            if self.on_receive is not None or self.checksum:
                self._arrived(k, peer, recv_arena[a:b])
            self._unpack(recv_arena, a, hops, offsets)
        for work in send_works:
            self._wait(work)

    def _run_round_ordered(self, k, local, sends, recvs, send_arena, recv_arena) -> None:
        """One round for a backend that matches messages by order only (NCCL): pack
        every send, post all of the round's sends and receives in one group call, copy
        the local regions, wait, unpack. Every earlier round is complete by then, so
        forwards read bytes already in place, and each pair's messages go in round
        order on both ends whatever each end packs."""
        incoming = []
        for peer, a, b, hops, offsets in recvs:
            buf = self.views.direct_dst(hops)
            if buf is not None:
                self.stats.direct_messages += 1
            else:
                a, b = self._where[k, "recv", peer]
            incoming.append((peer, buf, a, b, hops, offsets))
        outgoing = []
        for peer, a, b, hops, offsets in sends:
            buf = self.views.direct_src(hops)
            if buf is None:
                a, b = self._where[k, "send", peer]
                buf = self._pack(send_arena, a, b, hops, offsets)
            else:
                self.stats.direct_messages += 1
            outgoing.append((buf, peer))
            if self.checksum:
                self._note("send", k, peer, buf)
            self._count_sent(peer, hops)
        works = self.comm.exchange(
            outgoing, [(recv_arena[a:b] if buf is None else buf, peer)
                       for peer, buf, a, b, _, _ in incoming], k)
        self._copy_local(local)
        for work in works:
            self._wait(work)
        for peer, buf, a, b, hops, offsets in incoming:
            if self.on_receive is not None or self.checksum:
                self._arrived(k, peer, recv_arena[a:b] if buf is None else buf)
            if buf is not None:  # it arrived in place
                self.stats.bytes_received += hops[0].nbytes
            else:
                self._unpack(recv_arena, a, hops, offsets)

    def _pack(self, send_arena: torch.Tensor, a: int, b: int, hops: list[Hop],
              offsets: list[int]) -> torch.Tensor:
        """Copy one message's regions into ``send_arena[a:b]`` and return that slice."""
        try:
            for h, off in zip(hops, offsets):
                self.views.slot(send_arena, "send", a + off, h).copy_(self.views.read(h))
        except Exception as e:  # keep the protocol whole: peers get their bytes
            self.read_error = self.read_error or e
            send_arena[a:b].zero_()
        return send_arena[a:b]

    def _unpack(self, recv_arena: torch.Tensor, a: int, hops: list[Hop],
                offsets: list[int]) -> None:
        for h, off in zip(hops, offsets):
            self.views.write(h).copy_(self.views.slot(recv_arena, "recv", a + off, h))
            self.stats.bytes_received += h.nbytes

    def _copy_local(self, local: list[Hop]) -> None:
        for h in local:  # local copies overlap the messages in flight
            try:
                self.views.write(h).copy_(self.views.read(h))
            except Exception as e:
                self.read_error = self.read_error or e
            self.stats.bytes_local += h.nbytes

    # -- deadline and checksums ----------------------------------------------------------
    def _wait(self, work: Any) -> None:
        wait_for(work, self.deadline, self.comm.backend)

    def _finish_early(self, k: int, works: list[Any]) -> None:
        meta = self._early_meta.get(k, [])
        for i, w in enumerate(works):
            self._wait(w)
            if i < len(meta) and meta[i][0] == "recv" and (self.on_receive is not None
                                                           or self.checksum):
                self._arrived(k, meta[i][1], meta[i][2])

    def _arrived(self, k: int, peer: int, buf: torch.Tensor) -> None:
        if self.on_receive is not None:
            self.on_receive(k, peer, buf)
        if self.checksum:
            self._note("recv", k, peer, buf)

    def _note(self, kind: str, k: int, peer: int, buf: torch.Tensor) -> None:
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        context = b"%s|%d|%d|%d|%d" % (self.digest_label, self._runs, k, src, dst)
        self._digests.setdefault((kind, peer), {})[k] = digest(
            buf, self.checksum or "sum", key=self.digest_key, context=context)

    def _exchange_digests(self) -> str | None:
        """Send every peer the digests of the messages sent to it, in round order; compare
        those received with the digests of what arrived. Returns the first mismatch."""
        sends, recvs, theirs = [], [], {}
        for (kind, peer), by_round in sorted(self._digests.items()):
            values = [by_round[k] for k in sorted(by_round)]
            if kind == "send":
                sends.append((torch.tensor(values, dtype=torch.int64, device=self.device), peer))
            else:
                theirs[peer] = torch.empty(len(values), dtype=torch.int64, device=self.device)
                recvs.append((theirs[peer], peer))
        works = self.comm.exchange(sends, recvs, _DIGEST_TAG)
        for w in works:
            self._wait(w)
        for peer, got in theirs.items():
            mine = self._digests["recv", peer]
            for k, expected in zip(sorted(mine), got.tolist()):
                if mine[k] != expected:
                    return (f"checksum mismatch on the message from rank {peer} in round {k} "
                            f"({self.checksum}: sent {expected:#x}, received {mine[k]:#x})")
        return None

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


def wait_for(work: Any, deadline: float | None, backend: str) -> None:
    """Wait for one message; with a deadline (``time.monotonic()``, gloo), never past it."""
    if deadline is None:
        work.wait()
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise RuntimeError("the refit deadline passed while waiting for a message")
    if backend == "gloo":
        work.wait(timedelta(seconds=left))
    else:  # NCCL: wait() only orders streams; its watchdog enforces the group timeout
        work.wait()
