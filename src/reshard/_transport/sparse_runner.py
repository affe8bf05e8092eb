"""The transport of a sparse refit (private; :mod:`reshard.refit.sparse` drives it
through :meth:`reshard.executor.Executor.sparse_runner`): one rank's regions of a plan
(the flat schedule's hops, cut to the staging budget), the sender's engine-dtype copy of
what it sent at the last committed version, and the messages. Per round and per rank
pair, two: a header (each region's encoding and count, the payload's length and, with a
checksum option, its digest), then the payload (:mod:`reshard._transport.sparse`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard._transport import native
from reshard._transport import sparse as codec
from reshard._transport.integrity import digest
from reshard._transport.runner import wait_for
from reshard._transport.sparse_copies import Copies, RegionCopy
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
    unbased_bytes: int = 0
    """Sender: the bytes of the regions it sent those ranks (in ``wire_sent`` and
    ``dense_bytes`` too): a sparse refit could not have spared them."""
    dense_methods: tuple[str, ...] = ()
    """The policies whose tensors went as in a dense refit, in the same refit
    (``colocated``, ``gather_broadcast``: a sparse refit carries ``reshard`` and
    ``p2p`` only)."""
    detect_seconds: float = 0.0
    """Sender: comparing and encoding. Receiver: decoding and applying."""
    state_bytes: int = 0
    """Sender: the engine-dtype copy it keeps to detect changes."""
    copy_seconds: float = 0.0
    """Sender: keeping that copy after a dense refit (each region cast into it once the
    version was committed); a sparse refit updates it as it encodes."""
    declined: str | None = None
    """Sender, ``sparse="auto"``: why it keeps no copy (it would not fit), so sends dense."""

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
                     "rounds", "detect_seconds", "unbased_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.bytes_by_encoding, other.bytes_by_encoding),
                             (self.regions_by_encoding, other.regions_by_encoding)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        self.dense_peers = tuple(sorted(set(self.dense_peers) | set(other.dense_peers)))
        self.dense_methods = tuple(sorted(set(self.dense_methods) | set(other.dense_methods)))
        self.used = self.used or other.used

    def add(self, kind: int, nbytes: int, count: int, elements: int) -> None:
        name = codec.ENCODINGS[kind]
        self.bytes_by_encoding[name] = self.bytes_by_encoding.get(name, 0) + nbytes
        self.regions_by_encoding[name] = self.regions_by_encoding.get(name, 0) + 1
        self.elements += elements
        self.changed += count


_KINDS = frozenset(range(len(codec.ENCODINGS)))

SMALL_DENSE = 64 << 10
"""A region sent dense travels in its round's body below this many bytes; from it up,
as a message of its own, straight from the sender's copy into the receiver's region
(when contiguous), with no packing copy on either side."""
SAMPLE_ABOVE = 0.5
"""A region more than this fraction of which changed at the last refit is first
compared on one row in :data:`SAMPLE_EVERY` ..."""
SAMPLE_EVERY = 64
DENSE_SAMPLED = 0.9
"""... and sent dense, without the full comparison, when more than this fraction of the
sample changed (exact either way: a dense region is all its values)."""


class SparseRunner:
    """One rank's sparse refits of one plan: the regions it sends and receives (the
    flat schedule's hops), the copy of what it sent, the messages.

    The copy is updated as each region is encoded (the changed values written into it,
    or, for a region sent dense, the new values cast straight into it and sent from
    there), so a committed refit leaves nothing to do, and a refit that fails leaves the
    copy part new: the caller drops its base then (:meth:`SparseRefits.failed`)."""

    def __init__(self, plan, comm, *, budget_bytes: int, staging_bytes: int | None,
                 checksum: str | None = None, digest_key: bytes | None = None,
                 copies: Copies | None = None, same_source: dict[str, str] | None = None,
                 relay: bool = False) -> None:
        """``copies``: the sender's region copies (kept by the caller across plans);
        ``same_source``: tensor name -> the name of its data (replicas that are separate
        tensors of the plan share their copies); ``relay``: receivers that need the same
        regions from a sender, on the same base, are fed as a chain (:meth:`run`)."""
        self.comm, self.rank = comm, comm.rank
        self.dtypes = {t.name: getattr(torch, t.dst.dtype) for t in plan.tensors}
        schedule = flat_schedule(plan, budget_bytes, staging_bytes)
        self.budget = budget_bytes
        mine = [[h for h in hops if self.rank in (h.src_rank, h.dst_rank)]
                for hops in schedule.rounds]
        self.views = RegionViews((h for hops in mine for h in hops), self.rank, self.dtypes)
        self.local = [h for hops in mine for h in hops if h.is_local]
        # per peer, the schedule's rounds of hops to it (from it): a step of a refit
        # carries as many of them as fit the budget once encoded
        self.out_units = _units(mine, lambda h: h.src_rank == self.rank, lambda h: h.dst_rank)
        self.in_units = _units(mine, lambda h: h.dst_rank == self.rank, lambda h: h.src_rank)
        self.sends = [h for p in sorted(self.out_units) for u in self.out_units[p] for h in u]
        self._slot = {id(h): i for i, h in enumerate(self.sends)}
        same = self._same = same_source or {}
        self.keys = [(same.get(h.name, h.name), h.src_offset, h.size, str(self.dtypes[h.name]))
                     for h in self.sends]
        self._uses: dict[tuple, int] = {}  # how many sends read each copy (replicas: > 1)
        for key in self.keys:
            self._uses[key] = self._uses.get(key, 0) + 1
        self._memo: dict[tuple, list] = {}  # this run: a shared copy's encoding, uses left
        self._ready: dict[int, codec.Encoded] = {}  # this step, compared ahead: id(hop) -> it
        self.copies = copies if copies is not None else Copies()
        self.base: int | None = None  # the version the copies must hold to go sparse
        self._work: dict[tuple, torch.Tensor] = {}  # scratch: (dtype, device) -> buffer
        self.checksum, self.digest_key = checksum, digest_key
        self.deadline: float | None = None
        #: called as each step ends with (wire bytes sent so far, the dense bytes this rank
        #: sends per run), as the dense runner's ``progress`` is (the executor's)
        self.progress: Callable[[int, int], None] | None = None
        self._dense_total = sum(h.nbytes for h in self.sends)
        self.relay = relay
        if relay:  # every pair's hops (a chain is agreed from them on every rank)
            self._pairs = _pair_units(schedule.rounds)
            self._sig = {pair: frozenset(self._key(h) for u in units for h in u)
                         for pair, units in self._pairs.items()}
        self._in_streams: dict[tuple[int, int], _InStream] = {}
        self._forwards: dict[tuple[int, int], tuple[int, int]] = {}
        self._heads: set[tuple[int, int]] = set()
        self.broken = False  # the last run failed in the transport
        self.read_error: BaseException | None = None
        self.corrupt: str | None = None
        self._runs = 0
        #: test hook, as the dense runner's: (step, peer, each received part) before the
        #: checksum is checked
        self.on_receive: Callable[[int, int, torch.Tensor], None] | None = None

    @property
    def state_bytes(self) -> int:
        return self.copies.nbytes

    @property
    def copy_bytes(self) -> int:
        """What the copy of every region this rank sends takes (replicas of one layout
        share theirs)."""
        return sum(dict(zip(self.keys, (h.nbytes for h in self.sends))).values())

    def copy_device(self, src) -> torch.device | None:
        """Where that copy lives: the device of what this rank sends from (None: it
        sends nothing)."""
        return _device_of(src, self.views.src_names) if self.sends else None

    def _key(self, h: Hop) -> tuple:
        """A region as its source and place say, whichever replica's tensor it lands in."""
        return (self._same.get(h.name, h.name), h.src_offset, h.size, h.dst_offset,
                h.nbytes, str(self.dtypes[h.name]))

    # -- relayed streams ----------------------------------------------------------------
    def chains(self, bases: dict[int, int | None]) -> list[tuple[int, list[int]]]:
        """This run's chains, alike on every rank: (sender, [receivers]) where the
        receivers need the same regions from that sender (the same sources, at the same
        places: ranks of replicas of one layout) and hold its base; the sender sends to
        the first, each forwards what it received to the next, one step later."""
        if not self.relay:
            return []
        out = []
        for t in sorted({t for t, _ in self._pairs}):
            base = bases.get(t)
            if base is None:
                continue
            groups: dict[frozenset, list[int]] = {}
            for (src, d), sig in sorted(self._sig.items()):
                if src == t and bases.get(d) == base:
                    groups.setdefault(sig, []).append(d)
            out.extend((t, ranks) for _, ranks in sorted(groups.items(), key=lambda g: g[1])
                       if len(ranks) > 1)
        return out

    def _streams(self, bases: dict[int, int | None] | None) -> None:
        """What this rank sends and receives this run, per stream (peer, origin): its own
        regions to each peer but a chain's later links, and a chain's forwards."""
        self._out = {(p, self.rank): units for p, units in self.out_units.items()}
        self._in_streams = {(p, p): _InStream(units, p, self.rank, 0)
                            for p, units in self.in_units.items()}
        self._forwards = {}  # (next, origin) -> the in-stream it passes on
        self._heads: set[tuple[int, int]] = set()  # this rank's streams to a chain's head
        for t, chain in self.chains(bases or {}):
            if t == self.rank:
                self._heads.add((chain[0], t))
            for i, d in enumerate(chain):
                if i and t == self.rank:
                    del self._out[(d, t)]
                if d == self.rank:
                    if i:  # from the one before, as the sender's stream to the head
                        own = {self._key(h): h for u in self.in_units[t] for h in u}
                        units = [[own[self._key(h)] for h in u]
                                 for u in self._pairs[(t, chain[0])]]
                        del self._in_streams[(t, t)]
                        self._in_streams[(chain[i - 1], t)] = _InStream(units, t, chain[0], i)
                    if i + 1 < len(chain):
                        self._forwards[(chain[i + 1], t)] = (chain[i - 1] if i else t, t)

    # -- the sender's copy -------------------------------------------------------------
    def _copy(self, i: int, like: torch.Tensor) -> RegionCopy:
        """Region ``i``'s copy."""
        h = self.sends[i]
        dtype = self.dtypes[h.name]
        return self.copies.get(self.keys[i], h.nbytes // dtype.itemsize, dtype, like.device)

    def refresh(self, src) -> None:
        """Copy every region this rank sends, as it is now (after a dense refit): each
        cast straight into the copy."""
        self.views.bind(src, {})
        try:
            with torch.no_grad():
                for i, h in enumerate(self.sends):
                    read = self.views.read(h)
                    copy = self._copy(i, read)
                    copy.values.view(h.size).copy_(read)
                    copy.changed = 1.0
        finally:
            self.views.unbind()

    def _scratch(self, dtype: torch.dtype, device, n: int) -> torch.Tensor:
        key = (dtype, device)
        buf = self._work.get(key)
        if buf is None or buf.numel() < n:
            buf = self._work[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n]

    def _likely_dense(self, h: Hop, read: torch.Tensor, copy: RegionCopy) -> bool:
        """The region changed mostly at the last refit and does in a sample now."""
        last = copy.values
        if copy.changed <= SAMPLE_ABOVE or read.dim() < 2 or read.shape[0] < 2 * SAMPLE_EVERY:
            return False
        part = read[::SAMPLE_EVERY]
        new = self._scratch(last.dtype, read.device, part.numel()).view(part.shape)
        new.copy_(part)
        mask = self._scratch(torch.bool, read.device, part.numel()).view(part.shape)
        m = codec.diff(new, last.view(h.size)[::SAMPLE_EVERY], mask)
        return m > DENSE_SAMPLED * part.numel()

    def _encode_region(self, i: int, h: Hop, sparse: bool) -> codec.Encoded:
        """Region ``i`` now, against its copy, in its cheapest encoding (dense if not
        ``sparse``); the copy becomes it. A copy that several sends read (replicas of
        one layout) is encoded once a run: sparse if any of them may take it so."""
        key = self.keys[i]
        if self._uses[key] == 1:
            return self._encode_copy(i, h, sparse)
        memo = self._memo.get(key)
        if memo is None:
            memo = self._memo[key] = [self._encode_copy(i, h, self._sparse_key[key]),
                                      self._uses[key]]
        memo[1] -= 1
        enc = memo[0]
        if memo[1] == 0:
            del self._memo[key]
        if sparse or enc.kind == codec.DENSE:
            return enc
        last = self.copies.regions[key].values  # a peer without the base: all of it
        return codec.Encoded(codec.DENSE, last.numel(), h.nbytes, [last.view(torch.uint8)],
                             None, last)

    def _holds_base(self, copy: RegionCopy) -> bool:
        """Whether a region's copy holds the version this run's sparse peers hold."""
        return copy.version is not None and copy.version == self.base

    def _prefetch(self, units: list[list[Hop]], j: int, room: int, sparse: bool
                  ) -> set[int]:
        """Compare, in one native call, the regions of ``units[j]`` and of the units
        after it that this step surely carries (those before it hold fewer than ``room``
        bytes dense, and an encoding is never larger than dense), where the fused pass
        runs and nothing else is asked first (a copy of this one send, holding the base,
        that changed little at the last refit): their encodings wait in ``_ready`` for
        :meth:`_encode_copy`. Returns the units looked at (``id``). One call a batch
        spares a call's Python between passes over memory for each region."""
        looked, batch, ahead = set(), [], 0
        for unit in units[j:]:
            if looked and ahead >= room:
                break
            looked.add(id(unit))
            for h in unit:
                ahead += h.nbytes
                i = self._slot[id(h)]
                if not sparse or self._uses[self.keys[i]] != 1:
                    continue
                try:
                    read = self.views.read(h)
                except Exception:  # noqa: BLE001 - the usual path meets it, and says so
                    continue
                copy = self._copy(i, read)
                if (not self._holds_base(copy) or copy.changed > SAMPLE_ABOVE  # sampled first
                        or not native.supports(read, copy.values)):
                    continue
                batch.append((h, read, copy))
        for dtype in {c.values.dtype for _, _, c in batch}:
            group = [(h, r, c) for h, r, c in batch if c.values.dtype == dtype]
            if len(group) < 2:  # nothing to spare
                continue
            encs = codec.encode_fused_many([(r, c.values) for _, r, c in group])
            for (h, _, copy), enc in zip(group, encs):
                n = copy.values.numel()
                copy.changed = enc.count / n if n else 0.0
                self._ready[id(h)] = enc
        return looked

    def _encode_copy(self, i: int, h: Hop, sparse: bool) -> codec.Encoded:
        enc = self._ready.pop(id(h), None)
        if enc is not None:  # compared ahead (_prefetch)
            return enc
        read = self.views.read(h)
        copy = self._copy(i, read)
        last, n = copy.values, copy.values.numel()
        if not (sparse and self._holds_base(copy)) or self._likely_dense(h, read, copy):
            last.view(h.size).copy_(read)  # cast straight into the copy, sent from there
            copy.changed = 1.0
            return codec.Encoded(codec.DENSE, n, h.nbytes, [last.view(torch.uint8)], None,
                                 last)
        enc = codec.encode_fused(read, last, lambda dtype, k: self._scratch(
            dtype, read.device, k))
        if enc is None:  # cast into a scratch buffer, then the scans
            new = self._scratch(last.dtype, read.device, n)
            new.view(h.size).copy_(read)
            enc = codec.encode(new, last, mask=self._scratch(torch.bool, read.device, n),
                               update=True)
        copy.changed = enc.count / n if n else 0.0
        return enc

    # -- one refit ---------------------------------------------------------------------
    def run(self, src, dst, *, sparse_to: set[int], base: int | None = None,
            bases: dict[int, int | None] | None = None) -> SparseStats:
        """Move this rank's regions, sparse to the peers in ``sparse_to`` (whose base is
        ``base``, the version this rank's copies hold), dense to the others; the copies
        are updated as it goes. ``bases``: every rank's base (a relaying runner forms its
        chains from them: :meth:`chains`)."""
        self._runs += 1
        self.base, self._memo = base, {}
        self._sparse_key = {}
        for key, h in zip(self.keys, self.sends):
            self._sparse_key[key] = self._sparse_key.get(key, False) or h.dst_rank in sparse_to
        self.broken, self.read_error, self.corrupt = False, None, None
        stats = SparseStats(used=True)
        self._streams(bases)
        out_at, in_at = dict.fromkeys(self._out, 0), dict.fromkeys(self._in_streams, 0)
        fwd_at = dict.fromkeys(self._forwards, 0)
        self._stash: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.views.bind(src, dst)
        try:
            with torch.no_grad():
                for h in self.local:
                    self.views.write(h).copy_(self.views.read(h))
                while (any(at < len(self._out[s]) for s, at in out_at.items())
                       or any(at < len(self._in_streams[s].units) for s, at in in_at.items())
                       or any(at < len(self._in_streams[self._forwards[s]].units)
                              for s, at in fwd_at.items())):
                    self._step(stats.rounds, out_at, in_at, fwd_at, sparse_to, stats)
                    stats.rounds += 1
                    if self.progress is not None:
                        self.progress(stats.wire_sent, self._dense_total)
        except RuntimeError as e:  # a peer died or timed out
            self.broken = True
            raise TransferError(f"rank {self.rank}: sparse transfer failed in step "
                                f"{stats.rounds}: {str(e).splitlines()[0]}") from e
        finally:
            self.views.unbind()
            self._stash = {}
        if self.corrupt:
            raise TransferError(f"rank {self.rank}: {self.corrupt}; the received data is "
                                "corrupt and this refit must be discarded")
        if self.read_error is not None:
            raise TransferError(f"rank {self.rank}: reading a source tensor failed midway "
                                f"({self.read_error!r}); its peers got placeholder bytes and "
                                "this refit must be discarded") from self.read_error
        stats.dense_peers = tuple(sorted({h.dst_rank for h in self.sends} - sparse_to))
        return stats

    def _step(self, k: int, out_at: dict, in_at: dict, fwd_at: dict, sparse_to: set[int],
              stats: SparseStats) -> None:
        """One step: a header each way on every stream still owed something, then the
        messages; ``out_at`` / ``in_at`` / ``fwd_at``: each stream's next unit, advanced.
        A chain's link passes on, as it came, what its stream brought the step before."""
        device = self._device()
        outgoing: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for key, at in out_at.items():
            units = self._out[key]
            if at < len(units):
                head, parts, used = self._encode(k, key[0], units[at:], key[0] in sparse_to,
                                                 stats, device, chunk=key in self._heads)
                outgoing[key], out_at[key] = (head, parts), at + used
        for key, came in self._forwards.items():
            if came in self._stash:
                head, parts = outgoing[key] = self._stash.pop(came)
                fwd_at[key] += int(head[0])
                stats.wire_sent += sum(t.numel() for t in parts) + head.numel() * 8
        heads = {}
        for key, at in in_at.items():
            st = self._in_streams[key]
            if at < len(st.units) and k >= st.delay:
                heads[key] = torch.empty(_head_len(st.units[at:]), dtype=torch.int64,
                                         device=device)
        for w in self.comm.exchange([(head, key[0]) for key, (head, _) in sorted(outgoing.items())],
                                    [(t, key[0]) for key, t in sorted(heads.items())],
                                    _TAG + 2 * k):
            self._wait(w)
        incoming = {}
        for key, t in sorted(heads.items()):
            stats.wire_received += t.numel() * 8
            head = t.tolist()
            st = self._in_streams[key]
            units = st.units[in_at[key]:in_at[key] + head[0]]
            in_at[key] += head[0]
            hops = [h for u in units for h in u]
            incoming[key] = (t, hops, head[1:3 + 2 * len(hops)],
                             *self._receivers(hops, head[1:], device))
        for w in self.comm.exchange(
                [(t, key[0]) for key, (_, parts) in sorted(outgoing.items()) for t in parts],
                [(t, key[0]) for key, (_, _, _, parts, _) in sorted(incoming.items())
                 for t in parts],
                _TAG + 2 * k + 1):
            self._wait(w)
        forwarded = set(self._forwards.values())
        for key, (t, hops, head, parts, temps) in incoming.items():
            self._apply(k, self._in_streams[key], hops, head, parts, temps, stats)
            if key in forwarded:  # the next link's, next step: the bytes as they came
                self._stash[key] = (t, parts)

    def _encode(self, k: int, peer: int, units: list[list[Hop]], sparse: bool,
                stats: SparseStats, device, *, chunk: bool = False
                ) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """The header and the messages to ``peer`` this step, and how many of ``units``
        they carry (as many as fit the budget once encoded, at least one; ``chunk``, to
        the head of a chain: a sixth of it, the dense relays' network chunk, so that a
        chain runs as a pipeline where there is much to send): a body (the sparse
        regions and small dense ones), then each larger dense region alone."""
        t0 = time.perf_counter()
        encs, size, used = [], 0, 0
        cap = max(1, self.budget // 6) if chunk else self.budget
        self._ready, fetched = {}, set()
        for j, unit in enumerate(units):
            if used and size >= cap:
                break
            if id(unit) not in fetched:
                fetched |= self._prefetch(units, j, cap - size, sparse)
            used += 1
            for h in unit:
                size += self._encode_hop(h, sparse, encs, stats, device)
        if self._ready:  # compared (their copies written) but not sent: never so by design
            self.read_error = self.read_error or RuntimeError(
                f"{len(self._ready)} regions compared ahead were not sent")
            self._ready = {}
        inline = [e for e in encs if not _alone(e.kind, e.nbytes)]
        offsets, pos = [], 0
        for enc in inline:
            pos = -(-pos // 8) * 8
            offsets.append(pos)
            pos += enc.nbytes
        body = torch.empty(pos, dtype=torch.uint8, device=device)
        codec.write_payloads(inline, offsets, body)
        parts = ([body] if pos else []) + [e.parts[0] for e in encs if _alone(e.kind, e.nbytes)]
        items = [x for enc in encs for x in (enc.kind, enc.count)]
        head = torch.zeros(_head_len(units), dtype=torch.int64, device=device)
        head[:3 + len(items)] = torch.tensor(
            [used, pos, self._digest(k, self.rank, peer, items, parts), *items])
        stats.wire_sent += sum(t.numel() for t in parts) + head.numel() * 8
        stats.detect_seconds += time.perf_counter() - t0
        return head, parts, used

    def _encode_hop(self, h: Hop, sparse: bool, encs: list, stats: SparseStats, device
                    ) -> int:
        """Encode one region into ``encs``; its bytes on the wire."""
        try:
            enc = self._encode_region(self._slot[id(h)], h, sparse)
        except Exception as e:  # keep the protocol whole: the peer gets placeholders
            self.read_error = self.read_error or e
            zeros = torch.zeros(h.nbytes, dtype=torch.uint8, device=device)
            n = h.nbytes // self.dtypes[h.name].itemsize
            enc = codec.Encoded(codec.DENSE, n, h.nbytes, [zeros], None, zeros)
        encs.append(enc)
        stats.add(enc.kind, enc.nbytes, enc.count, h.nbytes // self.dtypes[h.name].itemsize)
        stats.dense_bytes += h.nbytes
        if not sparse:  # a peer without this rank's base
            stats.unbased_bytes += enc.nbytes
        return enc.nbytes

    def _receivers(self, hops: list[Hop], head: list[int], device
                   ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Where the messages from one peer land: the body, then each dense region sent
        alone, into the region itself when contiguous, else into a buffer (``temps``)."""
        parts, temps = [], {}
        if head[0]:
            parts.append(torch.empty(head[0], dtype=torch.uint8, device=device))
        for j, h in enumerate(hops):
            if not _alone(head[2 + 2 * j], h.nbytes):
                continue
            region = self.views.write(h)
            if region.is_contiguous():
                parts.append(region.view(-1).view(torch.uint8))
            else:
                temps[j] = torch.empty(h.nbytes, dtype=torch.uint8, device=device)
                parts.append(temps[j])
        return parts, temps

    def _apply(self, k: int, st: _InStream, hops: list[Hop], head: list[int],
               parts: list[torch.Tensor], temps: dict[int, torch.Tensor],
               stats: SparseStats) -> None:
        t0 = time.perf_counter()
        items = head[2:]
        peer = st.origin
        for part in parts if self.on_receive is not None else ():
            self.on_receive(k, peer, part)
        if self.checksum and head[1] != self._digest(k - st.delay, st.origin, st.head, items,
                                                     parts):
            self.corrupt = self.corrupt or (f"checksum mismatch on the sparse message from "
                                            f"rank {peer} in step {k} ({self.checksum})")
            return
        body = parts[0] if head[0] else None
        pos, inline, names = 0, [], []
        for j, h in enumerate(hops):
            kind, count = items[2 * j], items[2 * j + 1]
            dtype = self.dtypes[h.name]
            n = h.nbytes // dtype.itemsize
            if kind not in _KINDS or not 0 <= count <= n:  # a header no sender writes
                self.corrupt = self.corrupt or (
                    f"the sparse message from rank {peer} in step {k} has a header no "
                    f"sender writes (region {h.name}: encoding {kind}, {count} changed of {n})")
                return
            size = codec.payload_nbytes(kind, n, count, dtype.itemsize)
            if _alone(kind, size):
                if j in temps:
                    self.views.write(h).copy_(temps[j].view(dtype).view(h.size))
            elif size:  # nothing changed: no payload (a step may carry no body at all)
                pos = -(-pos // 8) * 8
                inline.append((self.views.write(h), kind, n, count, body[pos:pos + size]))
                names.append(h.name)
                pos += size
            stats.add(kind, size, count, n)
            stats.dense_bytes += h.nbytes
        for name, fits in zip(names, codec.decode_into_many(inline)):  # one native call
            if not fits:
                self.corrupt = self.corrupt or (
                    f"the sparse message from rank {peer} in step {k} does not match "
                    f"its header (region {name})")
        stats.wire_received += sum(t.numel() for t in parts)  # the header: in _step
        stats.detect_seconds += time.perf_counter() - t0

    def _digest(self, k: int, src: int, dst: int, items: list[int],
                parts: list[torch.Tensor]) -> int:
        if not self.checksum:
            return 0
        context = b"sparse|%d|%d|%d|%d" % (self._runs, k, src, dst)
        head = torch.tensor(items, dtype=torch.int64)
        out = digest(head, self.checksum, key=self.digest_key, context=context + b"|h")
        for j, part in enumerate(parts):
            out ^= digest(part, self.checksum, key=self.digest_key,
                          context=context + b"|%d" % j)
        return out

    def _device(self) -> torch.device:
        return (_device_of(self.views.src, self.views.src_names)
                or _device_of(self.views.dst, self.views.dst_names) or torch.device("cpu"))

    def _wait(self, work: Any) -> None:
        wait_for(work, self.deadline, self.comm.backend)


@dataclass
class _InStream:
    """What a rank receives from one peer in a run: ``units`` (its own hops), as
    ``origin`` sent them to ``head`` (the first of a chain; this rank when direct),
    ``delay`` steps later (its place in the chain)."""

    units: list[list[Hop]]
    origin: int
    head: int
    delay: int


def _device_of(tensors, names: list[str]) -> torch.device | None:
    """The device of the first of ``names`` that can be read in ``tensors`` (a caller's
    mapping may fail on one: its region's encoding reports that, and the refit fails
    cleanly, the group whole)."""
    for name in names:
        try:
            return tensors[name].device
        except Exception:  # noqa: BLE001 - unreadable now: ask the next
            continue
    return None


def _pair_units(rounds) -> dict[tuple[int, int], list[list[Hop]]]:
    """Every (sender, receiver) pair's units, as :func:`_units` makes one rank's."""
    out: dict[tuple[int, int], list[list[Hop]]] = {}
    for hops in rounds:
        by_pair: dict[tuple[int, int], list[Hop]] = {}
        for h in hops:
            if not h.is_local:
                by_pair.setdefault((h.src_rank, h.dst_rank), []).append(h)
        for pair, hs in by_pair.items():
            out.setdefault(pair, []).append(hs)
    return out


def _units(rounds: list[list[Hop]], mine, peer_of) -> dict[int, list[list[Hop]]]:
    """Per peer, the hops of each round that ``mine`` keeps (rounds without any left out)."""
    out: dict[int, list[list[Hop]]] = {}
    for hops in rounds:
        by_peer: dict[int, list[Hop]] = {}
        for h in hops:
            if not h.is_local and mine(h):
                by_peer.setdefault(peer_of(h), []).append(h)
        for p, hs in by_peer.items():
            out.setdefault(p, []).append(hs)
    return out


def _head_len(units: list[list[Hop]]) -> int:
    """A step's header: units carried, body length, digest, then (encoding, count) per
    region; long enough for all of ``units``."""
    return 3 + 2 * sum(len(u) for u in units)


def _alone(kind: int, nbytes: int) -> bool:
    """Whether a region travels as a message of its own (dense, large)."""
    return kind == codec.DENSE and nbytes >= SMALL_DENSE
