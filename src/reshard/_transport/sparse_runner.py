"""The transport of a sparse refit (private; :mod:`reshard.refit.sparse` drives it
through :meth:`reshard.executor.Executor.sparse_runner`): one rank's regions of a plan
(the flat schedule's hops, cut to the staging budget), the sender's engine-dtype copy of
what it sent at the last committed version, and the messages. Per round and per rank
pair, two: a header (each region's encoding and count, the payload's length and, with a
checksum option, its digest), then the payload (:mod:`reshard._transport.sparse`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard._transport import sparse as codec
from reshard._transport.integrity import digest
from reshard._transport.runner import wait_for
from reshard._transport.views import RegionViews
from reshard.errors import TransferError
from reshard.schedule import Hop, flat_schedule

__all__ = ["SparseRunner", "SparseStats"]

_TAG = 1 << 28  # above any round number of the dense runner, below its digest tag


@dataclass
class SparseStats:
    """One rank's share of a refit, as :class:`reshard.refit.RefitStats.sparse` reports
    it. A sender counts what it sent, a receiver what it received."""

    used: bool = False
    """Whether the refit went through the sparse transport (else dense, as ever)."""
    elements: int = 0
    """Elements of the regions compared (sender) or received (receiver)."""
    changed: int = 0
    """Of them, the changed ones (regions sent dense to a peer without the base count
    whole)."""
    dense_bytes: int = 0
    """What a dense refit moves for the same regions: the bytes this refit replaced."""
    wire_sent: int = 0
    """Payloads and headers this rank sent."""
    wire_received: int = 0
    """Payloads and headers this rank received."""
    rounds: int = 0
    bytes_by_encoding: dict[str, int] = field(default_factory=dict)
    regions_by_encoding: dict[str, int] = field(default_factory=dict)
    dense_peers: tuple[int, ...] = ()
    """Sender: the receiving ranks sent dense because their base was not this rank's."""
    detect_seconds: float = 0.0
    """Sender: comparing and encoding. Receiver: decoding and applying."""
    state_bytes: int = 0
    """Sender: the engine-dtype copy it keeps to detect changes."""
    copy_seconds: float = 0.0
    """Sender: keeping that copy once the version was committed (applying the changes,
    or copying whole after a dense refit)."""

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def wire_bytes(self) -> int:
        """Payloads and headers on the wire, sent and received."""
        return self.wire_sent + self.wire_received

    def merge(self, other: SparseStats) -> None:
        """Add another executor's share of the same refit."""
        for name in ("elements", "changed", "dense_bytes", "wire_sent", "wire_received",
                     "rounds", "detect_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.bytes_by_encoding, other.bytes_by_encoding),
                             (self.regions_by_encoding, other.regions_by_encoding)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        self.dense_peers = tuple(sorted(set(self.dense_peers) | set(other.dense_peers)))
        self.used = self.used or other.used

    def add(self, kind: int, nbytes: int, count: int, elements: int) -> None:
        name = codec.ENCODINGS[kind]
        self.bytes_by_encoding[name] = self.bytes_by_encoding.get(name, 0) + nbytes
        self.regions_by_encoding[name] = self.regions_by_encoding.get(name, 0) + 1
        self.elements += elements
        self.changed += count


class SparseRunner:
    """One rank's sparse refits of one plan: the regions it sends and receives (the
    flat schedule's hops), the copy of what it sent, the messages."""

    def __init__(self, plan, comm, *, budget_bytes: int, staging_bytes: int | None,
                 checksum: str | None = None, digest_key: bytes | None = None) -> None:
        self.comm, self.rank = comm, comm.rank
        self.dtypes = {t.name: getattr(torch, t.dst.dtype) for t in plan.tensors}
        schedule = flat_schedule(plan, budget_bytes, staging_bytes)
        mine = [(k, [h for h in hops if self.rank in (h.src_rank, h.dst_rank)])
                for k, hops in enumerate(schedule.rounds)]
        self.rounds = [(k, hops) for k, hops in mine if hops]
        self.views = RegionViews((h for _, hops in self.rounds for h in hops), self.rank,
                                 self.dtypes)
        self.sends = [h for _, hops in self.rounds for h in hops
                      if h.src_rank == self.rank and not h.is_local]
        self._slot = {id(h): i for i, h in enumerate(self.sends)}
        self.last: list[torch.Tensor | None] = [None] * len(self.sends)
        self.checksum, self.digest_key = checksum, digest_key
        self.deadline: float | None = None
        self.broken = False  # the last run failed in the transport
        self.read_error: BaseException | None = None
        self.corrupt: str | None = None
        self._runs = 0

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.last if t is not None)

    # -- the sender's copy -------------------------------------------------------------
    def _new(self, h: Hop) -> torch.Tensor:
        """What this rank sends for ``h`` now, flat, in the engine's dtype."""
        flat = self.views.read(h).to(self.dtypes[h.name]).contiguous().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:  # a size-1 dim may carry any stride
            flat = flat.as_strided((flat.numel(),), (1,))
        return flat

    def refresh(self, src) -> None:
        """Copy every region this rank sends, as it is now (after a dense refit)."""
        self.views.bind(src, {})
        try:
            with torch.no_grad():
                for i, h in enumerate(self.sends):
                    new = self._new(h)
                    if self.last[i] is None or self.last[i].numel() != new.numel():
                        self.last[i] = new.clone()
                    else:
                        self.last[i].copy_(new)
        finally:
            self.views.unbind()

    def advance(self, src, pending: list[tuple[int, Any, Any]]) -> None:
        """The refit whose ``pending`` changes :meth:`run` returned was committed
        everywhere: apply them to the copy (regions sent dense are read again)."""
        self.views.bind(src, {})
        try:
            with torch.no_grad():
                for i, index, values in pending:
                    if index is None:
                        self.last[i].copy_(self._new(self.sends[i]))
                    elif index.numel():
                        self.last[i][index.to(torch.int64)] = values
        finally:
            self.views.unbind()

    # -- one refit ---------------------------------------------------------------------
    def run(self, src, dst, *, sparse_to: set[int]) -> tuple[SparseStats, list]:
        """Move this rank's regions, sparse to the peers in ``sparse_to`` (whose base is
        this rank's), dense to the others. Returns the stats and the changes to apply to
        the copy once the refit is committed (:meth:`advance`)."""
        self._runs += 1
        self.broken, self.read_error, self.corrupt = False, None, None
        stats, pending = SparseStats(used=True), []
        self.views.bind(src, dst)
        try:
            for k, hops in self.rounds:
                self._round(k, hops, sparse_to, stats, pending)
                stats.rounds += 1
        except RuntimeError as e:  # a peer died or timed out
            self.broken = True
            raise TransferError(f"rank {self.rank}: sparse transfer failed in round "
                                f"{stats.rounds}: {str(e).splitlines()[0]}") from e
        finally:
            self.views.unbind()
        if self.corrupt:
            raise TransferError(f"rank {self.rank}: {self.corrupt}; the received data is "
                                "corrupt and this refit must be discarded")
        if self.read_error is not None:
            raise TransferError(f"rank {self.rank}: reading a source tensor failed midway "
                                f"({self.read_error!r}); its peers got placeholder bytes and "
                                "this refit must be discarded") from self.read_error
        stats.dense_peers = tuple(sorted({h.dst_rank for h in self.sends} - sparse_to))
        return stats, pending

    def _round(self, k: int, hops: list[Hop], sparse_to: set[int], stats: SparseStats,
               pending: list) -> None:
        sends: dict[int, list[Hop]] = {}
        recvs: dict[int, list[Hop]] = {}
        for h in hops:
            if h.is_local:
                self.views.write(h).copy_(self.views.read(h))
            elif h.src_rank == self.rank:
                sends.setdefault(h.dst_rank, []).append(h)
            else:
                recvs.setdefault(h.src_rank, []).append(h)
        device = self._device()
        outgoing = {p: self._encode(k, p, hs, p in sparse_to, stats, pending, device)
                    for p, hs in sorted(sends.items())}
        heads = {p: torch.empty(2 + 2 * len(hs), dtype=torch.int64, device=device)
                 for p, hs in sorted(recvs.items())}
        for w in self.comm.exchange([(head, p) for p, (head, _) in outgoing.items()],
                                    [(t, p) for p, t in heads.items()], _TAG + 2 * k):
            self._wait(w)
        payloads = {p: torch.empty(int(t[0]), dtype=torch.uint8, device=device)
                    for p, t in heads.items()}
        for w in self.comm.exchange(
                [(body, p) for p, (_, body) in outgoing.items() if body.numel()],
                [(t, p) for p, t in payloads.items() if t.numel()], _TAG + 2 * k + 1):
            self._wait(w)
        for p, head in heads.items():
            self._apply(k, p, recvs[p], head.tolist(), payloads[p], stats)

    def _encode(self, k: int, peer: int, hops: list[Hop], sparse: bool, stats: SparseStats,
                pending: list, device) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        encs = []
        for h in hops:
            i = self._slot[id(h)]
            try:
                new = self._new(h)
            except Exception as e:  # keep the protocol whole: the peer gets placeholders
                self.read_error = self.read_error or e
                new = torch.zeros(h.nbytes // self.dtypes[h.name].itemsize,
                                  dtype=self.dtypes[h.name], device=device)
            old = self.last[i]
            if old is None or old.numel() != new.numel() or self.read_error is not None:
                enc = codec.Encoded(codec.DENSE, new.numel(), h.nbytes,
                                    [new.view(torch.uint8)], None, new)
            else:
                enc = codec.encode(new, old, sparse=sparse)
            encs.append(enc)
            pending.append((i, None if enc.index is None else enc.index.to(torch.int32),
                            None if enc.index is None else enc.values))
            stats.add(enc.kind, enc.nbytes, enc.count, new.numel())
            stats.dense_bytes += h.nbytes
        offsets, pos = [], 0
        for enc in encs:
            pos = -(-pos // 8) * 8
            offsets.append(pos)
            pos += enc.nbytes
        body = torch.empty(pos, dtype=torch.uint8, device=device)
        for enc, off in zip(encs, offsets):
            codec.write_payload(enc, body[off:off + enc.nbytes])
        items = [x for enc in encs for x in (enc.kind, enc.count)]
        head = torch.tensor([pos, self._digest(k, self.rank, peer, items, body), *items],
                            dtype=torch.int64, device=device)
        stats.wire_sent += pos + head.numel() * 8
        stats.detect_seconds += time.perf_counter() - t0
        return head, body

    def _apply(self, k: int, peer: int, hops: list[Hop], head: list[int],
               body: torch.Tensor, stats: SparseStats) -> None:
        t0 = time.perf_counter()
        items = head[2:]
        if self.checksum and head[1] != self._digest(k, peer, self.rank, items, body):
            self.corrupt = self.corrupt or (f"checksum mismatch on the sparse message from "
                                            f"rank {peer} in round {k} ({self.checksum})")
            return
        pos = 0
        for j, h in enumerate(hops):
            kind, count = items[2 * j], items[2 * j + 1]
            dtype = self.dtypes[h.name]
            itemsize = dtype.itemsize
            n = h.nbytes // itemsize
            size = codec.payload_nbytes(kind, n, count, itemsize)
            pos = -(-pos // 8) * 8
            index, values = codec.decode(kind, n, count, body[pos:pos + size], dtype)
            codec.apply(self.views.write(h), index, values)
            pos += size
            stats.add(kind, size, count, n)
            stats.dense_bytes += h.nbytes
        stats.wire_received += body.numel() + len(head) * 8
        stats.detect_seconds += time.perf_counter() - t0

    def _digest(self, k: int, src: int, dst: int, items: list[int],
                body: torch.Tensor) -> int:
        if not self.checksum:
            return 0
        context = b"sparse|%d|%d|%d|%d" % (self._runs, k, src, dst)
        head = torch.tensor(items, dtype=torch.int64)
        return (digest(body, self.checksum, key=self.digest_key, context=context)
                ^ digest(head, self.checksum, key=self.digest_key, context=context + b"|h"))

    def _device(self) -> torch.device:
        for names, tensors in ((self.views.src_names, self.views.src),
                               (self.views.dst_names, self.views.dst)):
            for name in names:
                return tensors[name].device
        return torch.device("cpu")

    def _wait(self, work: Any) -> None:
        wait_for(work, self.deadline, self.comm.backend)
