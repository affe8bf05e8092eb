"""Sparse refits: after a committed version, send only the engine-dtype values that
changed, region by region, and commit as every refit does (``docs/sparse.md``).

Trainer side: each rank keeps, for every region it sends (the planned transfers of the
flat schedule, cut to the staging budget), the engine-dtype values it sent at the last
committed version: one copy of its shard in the engine's dtype
(:attr:`SparseRefits.state_bytes`). At a refit it compares what it would send now with
that copy, bit for bit, and sends each region in its cheapest exact encoding
(:mod:`reshard._transport.sparse`): dense, a bitmap and the values, or sorted offsets
and the values; never a delta. No gather: each rank encodes only its own shard; a
replicated region is sent by the one sender the plan chose, as in a dense refit.

Receiver side: the changed values land in the receiver's staging (its shadow, or the
caller's direct buffers), which holds the last version received whole; then the refit
commits as every refit does (never torn). A sparse region is only valid on top of the
version it was computed from: every rank says, in the refit's first collective, which
version its copy or staging holds whole (its *base*), and a sender encodes sparse only
to receivers whose base equals its own; the others get their regions dense in the same
refit. A sender's copy is updated as it encodes (no second copy, nothing to do at the
commit); its base advances only once every rank of both jobs confirmed the commit. A
failed refit leaves every rank without a base (a receiver's staging, like the sender's
copy, may hold part of the failed version), so the next refit comes dense.

Per round and per rank pair, two messages: a header (each region's encoding and
count, the payload's length and, with a checksum option, its digest), then the payload.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from reshard.defaults import DEFAULT_SPARSE
from reshard.errors import ConfigError
from reshard.executor import Copies, SparseStats

__all__ = ["DEFAULT_SPARSE", "SPARSE_MODES", "SparseRefits", "SparseStats", "free_bytes",
           "sparse_summary"]

log = logging.getLogger("reshard.sparse")

SPARSE_MODES = ("auto", "on", "off")
SPARSE_METHODS = ("reshard", "p2p")  # the executors whose tensors a sparse refit carries
AUTO_DENSE_ABOVE = 0.5
"""``sparse="auto"``: a sparse refit whose wire bytes exceeded this fraction of the dense
bytes on a trainer rank (both without the regions it sent dense to peers without its
base), or that took that rank longer than its last dense refit, makes
that rank send dense for a while ..."""
AUTO_BACKOFF = 4
"""... for this many refits, then it tries sparse again; each try in a row that does not
pay doubles the next wait, up to :data:`AUTO_BACKOFF_MAX` (one that pays sets it back).
While it waits its refits are plain dense ones and its copy is left as it was (its
regions keep the older version they hold, so none is diffed against the new base); the
last refit of the wait goes through the sparse transport, every region dense, cast
straight into the copy and sent from there, so the try after it has its base whole at
no extra pass."""
AUTO_BACKOFF_MAX = 32
AUTO_SLOWER = 1.0
"""A sparse refit is slower than dense when it took this rank more than this times its
last dense refit's time."""
AUTO_MEMORY_FRACTION = 0.5
"""``sparse="auto"`` keeps its engine-dtype copy on a trainer rank only where the copy
takes at most this fraction of the memory free on the device it lives on (what
:func:`free_bytes` finds there when the copy would first be made); else that rank stays
dense for the meeting, and says why (``SparseStats.declined``, a warning)."""


def free_bytes(device: torch.device) -> int | None:
    """Memory a new tensor could take on ``device``: on a GPU what the driver has free
    plus what torch's allocator holds unused; on the host what the kernel reports
    available (``MemAvailable``); None where neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


class SparseRefits:
    """One rank's sparse-refit state across refits: its mode, its base, a transport
    per executor that carries sparse refits (made when first needed)."""

    def __init__(self, mode: str | None) -> None:
        if mode is not None and mode not in SPARSE_MODES:
            raise ConfigError(f"sparse must be one of {SPARSE_MODES}, got {mode!r}")
        self.mode = mode  # None on a receiver: it follows the senders
        self.force_dense = False  # the next refit dense (RefitSender.refit(dense=True))
        self.reset()

    def reset(self) -> None:
        """A new meeting: no base, no copy."""
        self.base: int | None = None
        self.copies = Copies()  # a sender's region copies, shared by its executors
        self.transports: dict[int, Any] = {}  # executor -> its sparse runner
        self._ran: set[int] = set()  # executors this refit ran sparse (copy kept as sent)
        self._skip = 0  # auto: dense refits left before it tries sparse again
        self._backoff = AUTO_BACKOFF  # auto: the next wait, if the next try does not pay
        self._encoded_sparse = False  # this refit sent some peer sparse regions
        self._dense_seconds: float | None = None  # the last dense refit's time (auto)
        self.last_ratio: float | None = None
        self.declined: str | None = None  # auto: why this rank keeps no copy (memory)

    def view(self) -> tuple[int | None, bool, bool]:
        """What this rank says in the refit's first collective: its base, (a trainer
        rank) whether it asks for a sparse refit (auto, waiting: not until the last
        refit of its wait, which rebuilds its copy through the sparse transport), and
        whether it declined to keep a copy (auto, short of memory)."""
        return (self.base, not self.force_dense and self.keeps_copy and not self._waiting,
                self.declined is not None)

    @property
    def _waiting(self) -> bool:
        """Auto, backing off, with more than this refit to wait: a plain dense refit,
        and no copy kept of it."""
        return self.mode == "auto" and self._skip > 1

    @staticmethod
    def decide(views: list[tuple[int | None, bool, bool] | None]
               ) -> dict[int, int | None] | None:
        """Every rank's base if this refit goes sparse, else None (alike on every rank):
        sparse when a trainer rank that asks for it shares its base with a receiver,
        and no trainer rank declined to keep a copy (a sparse refit would make one)."""
        if any(v is not None and v[2] for v in views):
            return None
        asked = {v[0] for v in views if v is not None and v[1] and v[0] is not None}
        if not any(v is not None and not v[1] and v[0] in asked for v in views):
            return None
        return {r: v[0] for r, v in enumerate(views) if v is not None}

    def heard(self, views: list[tuple[int | None, bool, bool] | None]) -> None:
        """The refit's first collective: where another trainer rank declined to keep a
        copy (auto, short of memory), this one lets its own go too, since no refit of
        this meeting goes sparse."""
        short = [r for r, v in enumerate(views) if v is not None and v[2]]
        if short and self.mode == "auto" and self.declined is None:
            self.declined = (f"sparse='auto' keeps no copy: rank {short[0]} had no room "
                             "for its own, so every rank sends dense")
            self.copies.regions.clear()

    def new_group(self) -> None:
        """The same ranks (and new ones) meet in a new group with new plans (an elastic
        group's next membership epoch): the base and the copies stay, each copy
        diffed only against a receiver whose base it holds; the runners go."""
        self.transports = {}
        self._ran.clear()

    def transport(self, ex) -> Any:
        """``ex``'s sparse runner, kept here so that :meth:`reset` lets go of it."""
        self.transports[id(ex)] = tr = ex.sparse_runner(self.copies)
        return tr

    def run(self, ex, src, dst, bases: dict[int, int | None], deadline: float | None
            ) -> SparseStats:
        tr = self.transport(ex)
        tr.deadline = deadline
        me = bases.get(ex.comm.rank)
        sparse_to = {p for p, b in bases.items() if me is not None and b == me}
        if self.mode == "auto" and self._skip:  # backing off: every region dense
            sparse_to = set()
        self._encoded_sparse = self._encoded_sparse or bool(sparse_to)
        self._ran.add(id(ex))
        return tr.run(src, dst, sparse_to=sparse_to, base=me, bases=bases)

    @property
    def keeps_copy(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and self.declined is None)

    def _room(self, src, executors) -> bool:
        """Auto, before its copy is first made: whether it fits (:data:`AUTO_MEMORY_FRACTION`
        of the memory free where it would live); if not, this rank keeps none."""
        if self.mode != "auto" or self.copies.regions:
            return True
        need, device = 0, None
        for ex in executors:
            if ex.method in SPARSE_METHODS:
                tr = self.transport(ex)
                need += tr.copy_bytes
                device = device or tr.copy_device(src)
        if not need or device is None:
            return True
        free = free_bytes(device)
        if free is None or need <= AUTO_MEMORY_FRACTION * free:
            return True
        self.declined = (f"sparse='auto' keeps no copy on this rank: it would take "
                         f"{need / 2**20:.1f} MiB on {device}, more than "
                         f"{AUTO_MEMORY_FRACTION:.0%} of the {free / 2**20:.1f} MiB free "
                         "there; its refits stay dense (sparse='on' keeps it anyway)")
        log.warning("%s", self.declined)
        return False

    def committed(self, version: int, src, executors, stats: SparseStats | None,
                  seconds: float = 0.0) -> None:
        """Every rank confirmed ``version`` (its refit took this rank ``seconds``): the
        copy (sender) and the base advance."""
        if self.mode is None:  # a receiver: its staging holds the version whole
            self.base = version
            return
        if not self.keeps_copy or not self._room(src, executors):
            if stats is not None:
                stats.declined = self.declined
            return
        t0 = time.perf_counter()
        if self._ran or not self._waiting:
            for ex in executors:
                if ex.method in SPARSE_METHODS and id(ex) not in self._ran:
                    self.transport(ex).refresh(src)  # a dense refit: its copy made now
            self.copies.commit(version)
        # else auto waiting, nothing sent through the sparse transport: the copies keep
        # the older versions they hold (never diffed against this base), rebuilt at the
        # last refit of the wait
        self._ran.clear()
        self.base = version
        self._auto(stats if self._encoded_sparse else None, seconds)
        self._encoded_sparse = False
        if stats is not None:
            stats.state_bytes = self.state_bytes()
            stats.copy_seconds = time.perf_counter() - t0

    def _auto(self, sparse: SparseStats | None, seconds: float) -> None:
        """After a committed refit (``sparse``: its stats if it sent sparse regions):
        back off when sparse did not pay, in bytes or in this rank's time."""
        if sparse is None or not sparse.dense_bytes:
            self._dense_seconds = seconds
            self._skip = max(0, self._skip - 1)
            return
        # what went dense to peers without the base (a joiner) could not have been spared
        based = sparse.dense_bytes - sparse.unbased_bytes
        self.last_ratio = (sparse.wire_bytes - sparse.unbased_bytes) / based if based else 0.0
        slower = (self._dense_seconds is not None
                  and seconds > AUTO_SLOWER * self._dense_seconds)
        if self.mode == "auto" and (self.last_ratio > AUTO_DENSE_ABOVE or slower):
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff, AUTO_BACKOFF_MAX)
        else:
            self._backoff = AUTO_BACKOFF

    def failed(self) -> None:
        """The refit failed: a receiver's staging and a sender's copy may hold part of
        the failed version, so neither has a base until a refit lands whole."""
        self._ran.clear()
        self._encoded_sparse = False
        self.copies.fail()
        self.base = None

    def state_bytes(self) -> int:
        return self.copies.nbytes


def sparse_summary(stats: SparseStats | None) -> dict[str, Any] | None:
    """A refit's :class:`SparseStats` as plain data (an engine's ``reshard_last``), or
    None when the refit was dense."""
    if stats is None or not stats.used:
        return None
    return {"changed_fraction": stats.changed_fraction, "elements": stats.elements,
            "changed": stats.changed, "dense_bytes": stats.dense_bytes,
            "wire_bytes": stats.wire_bytes, "bytes_by_encoding": dict(stats.bytes_by_encoding),
            "regions_by_encoding": dict(stats.regions_by_encoding),
            "dense_peers": list(stats.dense_peers), "dense_methods": list(stats.dense_methods),
            "seconds": stats.detect_seconds}
