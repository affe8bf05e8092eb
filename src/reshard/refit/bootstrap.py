"""Peer bootstrap: a new (or restarted) replica takes the current weight version from
live replicas' committed weights, spread over several peers, without the trainer.

Every rank of each live replica lending its weights builds a :class:`BootstrapSender`
over its committed tensors (in its own layouts); every rank of the new replica a
:class:`BootstrapReceiver` (targets and layouts, or ``prepare`` to make them from the
peers' tensor names, shapes and dtypes). They meet at a TCP store the new replica's
rank 0 hosts:

* the new replica's rank 0 says how many peers it waits for and its TP size; each
  peer's rank 0 publishes its TP size, layouts, committed version, and why it cannot
  lend if it cannot (nothing committed whole: a refit failed or is under way);
* every rank then forms one stateless group (peer 0's ranks, peer 1's, ..., the new
  replica's last) and builds the same plan (:func:`bootstrap_plan`): the peers'
  tensors as replicas of one source, so the planner spreads the regions over the peers
  (each region from the least-loaded holder, the same way on every rank), into the new
  replica's layouts, any TP size on either side;
* a peer that cannot lend, peers at different versions, tensors missing or of another
  shape or dtype: every rank refuses with the same error before a byte moves;
* one transfer of :mod:`reshard.refit.side`'s protocol: the new replica receives into a
  shadow (``direct`` targets straight, the caller commits them) and makes it live only
  after every rank confirmed; a peer lost midway fails it on every rank (within
  ``refit_timeout``), nothing of it live, and the new replica may try again.

The peers send from their committed tensors and never write them: their engines go on
serving. The caller keeps them from refitting while they lend (the vLLM integration
waits for the lending thread before a refit writes those tensors).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from itertools import product

import torch
import torch.distributed as dist

from reshard import planner
from reshard.comm import Comm
from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import ConfigError, PlanError, ReshardError, TransferError
from reshard.gate import resolve_key
from reshard.layout import Layout
from reshard.pieces import LocalView, Piece
from reshard.planner import Plan
from reshard.refit.receiver import Prepare, RefitReceiver
from reshard.refit.rendezvous import Meeting, Refused, agree, meeting_digest_key, own_layouts
from reshard.refit.side import RefitStats, Side

__all__ = ["BootstrapReceiver", "BootstrapSender", "PeerInfo", "bootstrap_plan"]

_PREFIX = "reshard/bootstrap"


@dataclass(frozen=True)
class PeerInfo:
    """What a lending replica's rank 0 publishes at the meeting."""

    tp_size: int
    layouts: dict[str, Layout]  # over the peer's own ranks 0..tp_size-1
    version: int  # the version its tensors hold, committed
    problem: str | None = None  # why it cannot lend, or None


def peers_problem(peers: Sequence[PeerInfo]) -> str | None:
    """Why these peers cannot fill a replica together, as a sentence, or None."""
    for i, p in enumerate(peers):
        if p.problem:
            return f"peer {i} cannot lend: {p.problem}"
        if p.version < 0:
            return f"peer {i} holds no committed version (version {p.version})"
    versions = [p.version for p in peers]
    if len(set(versions)) > 1:
        return (f"the peers hold different versions {versions}; a bootstrap copies one "
                "version from every peer")
    names = [sorted(p.layouts) for p in peers]
    for i, n in enumerate(names[1:], 1):
        if n != names[0]:
            odd = sorted(set(n) ^ set(names[0]))
            return f"peers 0 and {i} hold different tensors (first: {odd[:3]})"
    return None


def bootstrap_plan(peers: Sequence[PeerInfo], layouts: Mapping[str, Layout]) -> Plan:
    """The plan of a bootstrap: every peer's tensors (peer ``i`` on the group ranks after
    peers ``0..i-1``'s), held as replicas of one source, into ``layouts`` (the new
    replica's, over its ranks ``0..tp-1``, placed after every peer's). A ``PlanError``
    naming what does not fit: a tensor missing on either side, another shape or dtype
    (a bootstrap copies the committed weights as they are: it never casts)."""
    problem = peers_problem(peers)
    if problem:
        raise PlanError(problem)
    theirs = peers[0].layouts
    missing, extra = sorted(set(theirs) - set(layouts)), sorted(set(layouts) - set(theirs))
    if missing or extra:
        raise PlanError(f"the new replica's tensors differ from the peers': missing "
                        f"{missing[:3]}, not held by the peers {extra[:3]}")
    for name, lay in layouts.items():
        if (lay.shape, lay.dtype) != (theirs[name].shape, theirs[name].dtype):
            raise PlanError(f"tensor {name!r}: the new replica wants {list(lay.shape)} "
                            f"{lay.dtype}, the peers hold {list(theirs[name].shape)} "
                            f"{theirs[name].dtype}")
    offsets = peer_offsets(peers)
    total = sum(p.tp_size for p in peers)
    src = {n: _union([p.layouts[n].shifted(o) for p, o in zip(peers, offsets)])
           for n in sorted(layouts)}
    return planner.plan(src, {n: layouts[n].shifted(total) for n in sorted(layouts)})


def peer_offsets(peers: Sequence[PeerInfo]) -> list[int]:
    """Each peer's first group rank."""
    out, at = [], 0
    for p in peers:
        out.append(at)
        at += p.tp_size
    return out


def _union(layouts: Sequence[Layout]) -> Layout:
    """One layout whose ranks hold what each of ``layouts`` (on disjoint ranks) holds,
    every piece cut where any other layout's pieces begin or end: replicas of other
    splits (TP1 beside TP2) then hold boxes that are equal or disjoint, as an explicit
    layout's replicas must."""
    views = {r: lay.view_of_slot(slot) for lay in layouts for slot, r in enumerate(lay.ranks)}
    ndim = len(layouts[0].shape)
    cuts = [sorted({c for v in views.values() for p in v.pieces
                    for c in (p.offset[d], p.offset[d] + p.size[d])}) for d in range(ndim)]
    refined = {r: LocalView(v.local_shape, tuple(q for p in v.pieces for q in _cut(p, cuts)))
               for r, v in views.items()}
    return Layout.explicit(layouts[0].shape, refined, layouts[0].dtype)


def _cut(piece: Piece, cuts: Sequence[Sequence[int]]) -> list[Piece]:
    """``piece`` split at every cut inside it, dim by dim."""
    per_dim = []
    for d, (lo, n) in enumerate(zip(piece.offset, piece.size)):
        points = [lo] + [c for c in cuts[d] if lo < c < lo + n] + [lo + n]
        per_dim.append([(a, b - a) for a, b in zip(points, points[1:])])
    return [Piece(tuple(a for a, _ in box), tuple(n for _, n in box),
                  tuple(a - o + lo for (a, _), o, lo in zip(box, piece.offset,
                                                          piece.local_offset)))
            for box in product(*per_dim)]


@dataclass(frozen=True)
class _Own:
    """Who this rank is at a bootstrap meeting."""

    peer: int | None  # its replica's peer index; None on the new replica
    rank: int  # in its replica
    tp_size: int


def _meet(host: str, port: int, own: _Own, *, num_peers: int | None,
          info: PeerInfo | None, layouts, backend: str, timeout: timedelta,
          token, listen: str | None) -> Meeting:
    """The bootstrap meeting (see the module docstring); collective over every rank of
    the peers and of the new replica."""
    new = own.peer is None
    key = resolve_key(token)
    store = Comm.open_store(host, port, 0 if new and own.rank == 0 else 1, None,
                            is_server=new and own.rank == 0, timeout=timeout, token=key,
                            listen=listen)
    kv = dist.PrefixStore(_PREFIX, store)
    digest_key = meeting_digest_key(store, key, new and own.rank == 0, timeout)
    if own.rank == 0:
        kv.set("new" if new else f"peer/{own.peer}",
               pickle.dumps((num_peers, own.tp_size, backend) if new else info))
    num_peers, new_tp, new_backend = pickle.loads(_wait(kv, ["new"], timeout, "the new "
                                                        "replica")[0])
    if new_backend != backend:
        raise ConfigError(f"backend {backend!r} on this rank, {new_backend!r} on the new "
                          "replica; nothing was moved")
    if not new and not 0 <= own.peer < num_peers:
        raise ConfigError(f"peer must be in [0, {num_peers}) (the new replica waits for "
                          f"{num_peers} peers), got {own.peer}; nothing was moved")
    peers = [pickle.loads(b) for b in _wait(kv, [f"peer/{i}" for i in range(num_peers)],
                                            timeout, "peers")]
    if new:  # every rank makes its targets from the peers' names, shapes and dtypes
        problem = peers_problem(peers)
        mine = (Refused("PlanError", problem) if problem else
                own_layouts(layouts, 0, peers[0].layouts))
        if own.rank == 0:
            kv.set("new/layouts", pickle.dumps(mine))
    theirs = pickle.loads(_wait(kv, ["new/layouts"], timeout, "the new replica")[0])
    total = sum(p.tp_size for p in peers)
    rank = total + own.rank if new else peer_offsets(peers)[own.peer] + own.rank
    comm = Comm.from_existing_store(dist.PrefixStore("group", kv), rank, total + new_tp,
                                    backend=backend, timeout=timeout, name=_PREFIX)
    the_plan, fingerprint, problem = None, None, None
    if isinstance(theirs, Refused):
        problem = (theirs.kind, theirs.message)
    else:
        try:
            the_plan = bootstrap_plan(peers, theirs)
            fingerprint = the_plan.fingerprint()
        except ReshardError as e:
            problem = (type(e).__name__, str(e))
    agree(comm.all_gather_object((rank, fingerprint, problem)))
    return Meeting(comm, the_plan, rank, "inference" if new else "trainer",
                   total if new else 0, digest_key)


def _wait(kv, keys: list[str], timeout: timedelta, who: str) -> list[bytes]:
    try:
        kv.wait(keys, timeout)
    except RuntimeError as e:
        came = []
        with suppress(Exception):  # the store's host may be gone
            came = [k for k in keys if kv.check([k])]
        raise TransferError(f"{who} did not come to the bootstrap within "
                            f"{timeout.total_seconds():.0f} s (found {came} of {keys}); "
                            "nothing was moved") from e
    return [kv.get(k) for k in keys]


class BootstrapSender(Side):
    """One rank of a live replica lending its committed tensors to a new replica.

    ``targets``: name -> this rank's committed tensor (read, never written);
    ``layouts``: name -> Layout over the replica's ranks ``0..tp_size-1`` (as it
    receives its refits); ``peer``: this replica's index among the ``num_peers`` the
    new replica waits for (every rank of the replica passes the same); ``version``:
    the version the tensors hold; ``problem``: why this replica cannot lend (the
    meeting then fails on every rank with it, nothing moved). The meeting happens in
    the constructor, the transfer in :meth:`send`."""

    def __init__(self, targets: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout],
                 *, host: str, port: int, peer: int, rank: int, tp_size: int, version: int,
                 problem: str | None = None, budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 backend: str = "gloo", timeout: timedelta = timedelta(seconds=120),
                 refit_timeout: timedelta | None = None, checksum: bool | str | None = None,
                 token: str | bytes | None = None,
                 progress: bool | Callable[[int, int], None] = False) -> None:
        _check_rank(rank, tp_size)
        self.targets, self.lent_version = dict(targets), version
        info = PeerInfo(tp_size, dict(layouts), version, problem) if rank == 0 else None
        meeting = _meet(host, port, _Own(peer, rank, tp_size), num_peers=None, info=info,
                        layouts=None, backend=backend, timeout=timeout, token=token,
                        listen=None)
        super().__init__(meeting, policy=None, budget_bytes=budget_bytes, progress=progress,
                         refit_timeout=refit_timeout, checksum=checksum)

    def send(self) -> RefitStats:
        """Send this rank's part of the plan; returns once every rank confirmed (the new
        replica then holds the version whole), or raises ``TransferError``."""
        try:
            return self._move(self.targets, {}, self.lent_version)
        finally:
            self.close()

    def close(self) -> None:
        with suppress(Exception):
            self.comm.close()


class BootstrapReceiver(RefitReceiver):
    """One rank of the new replica. ``targets`` and ``layouts`` (over its ranks
    ``0..tp_size-1``), or ``prepare`` (called with the peers' layouts: names, shapes,
    dtypes), ``staging`` and ``direct`` are as for :class:`RefitReceiver`;
    ``num_peers``: how many live replicas lend (each region comes from one of them);
    rank 0 hosts the meeting's store at ``host:port`` (``listen`` as for the trainer's
    rank 0). The meeting happens in the constructor; :meth:`refit` receives the version
    (never torn: live only once every rank confirmed)."""

    def __init__(self, targets: Mapping[str, torch.Tensor] | None = None,
                 layouts: Mapping[str, Layout] | None = None, *, host: str, port: int,
                 rank: int, tp_size: int, num_peers: int, staging: str = "shadow",
                 direct: Collection[str] = (), prepare: Prepare | None = None,
                 budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=120),
                 refit_timeout: timedelta | None = None, checksum: bool | str | None = None,
                 token: str | bytes | None = None, listen: str | None = None) -> None:
        _check_rank(rank, tp_size)
        if isinstance(num_peers, bool) or not isinstance(num_peers, int) or num_peers < 1:
            raise ConfigError(f"num_peers must be an int >= 1, got {num_peers!r}")
        made = self._targets_or_prepare(targets, layouts, staging, direct, prepare)
        meeting = _meet(host, port, _Own(None, rank, tp_size), num_peers=num_peers,
                        info=None, layouts=made, backend=backend, timeout=timeout,
                        token=token, listen=listen)
        Side.__init__(self, meeting, policy=None, budget_bytes=budget_bytes, progress=False,
                      refit_timeout=refit_timeout, checksum=checksum)
        self.shadow = self._new_shadow()

    def refit(self, go_live: bool = True, ready: Callable[[], None] | None = None
              ) -> RefitStats:
        """Receive the peers' version (see :meth:`RefitReceiver.refit`); the group is
        left afterwards, whatever the outcome (a failed bootstrap is tried anew)."""
        try:
            return super().refit(go_live, ready)
        finally:
            with suppress(Exception):
                self.comm.close()

    def reconnect(self, *args, **kwargs) -> None:
        raise ConfigError("a bootstrap meets its peers once: build a new BootstrapReceiver "
                          "to try again")


def _check_rank(rank: int, tp_size: int) -> None:
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank must be in [0, {tp_size}) (tp_size), got {rank}")
