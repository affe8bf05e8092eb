"""Elastic membership: inference replicas join and leave between refits, and the trainer
never restarts.

A *replica* is one data-parallel copy of the model on the inference side: a tensor-
parallel group of ``tp_size`` ranks (replicas may differ in TP size and layouts). The
trainer ranks (:class:`ElasticSender`) and every replica rank (:class:`ElasticReceiver`)
share one long-lived TCP store hosted by trainer rank 0. Trainer rank 0 coordinates:

* a replica asks to join (its layouts go to the store) or to leave, at any time;
* at the start of each refit the coordinator applies the pending requests and announces
  the refit: weight version, *membership epoch* and members (in the store);
* when the membership changed (or the previous refit broke the group), every
  participant of the new epoch forms a **fresh stateless gloo group over a**
  ``PrefixStore("epoch/<n>")`` **of the same store** (trainer ranks first, then the
  replicas in join order) and the refit runs on it with the protocol of
  :mod:`reshard.refit.side`: bad tensors refused on every rank before any byte moves, a
  shadow copy on each receiver, one commit collective, the previous version kept on
  any failure, optional deadline and checksum;
* a replica that left sees itself out of the next announcement and its ``refit()``
  returns None; after a failed refit, replicas whose ranks all report back within
  ``rejoin_timeout`` stay, the others are dropped (a replica with a dead rank must come
  back under a new id).

Replicas of one layout on different fast domains are fed through relays where the cost
model says so (:mod:`reshard.fanout`): the trainer sends one copy per replica layout and
the replicas forward the rest from their uncommitted shadows; a relay lost mid-refit
fails that refit everywhere, like any lost rank.

Plans are per replica and cached by (position in the group, layouts): growing from one
replica to three plans only the two new ones; a replica that moves into the place of
one that left, with the same layouts, reuses that plan; shrinking back plans nothing.
Only the schedule of the combined plan (cheap) is rebuilt per epoch.

Why fresh groups over a persistent store rather than ``torch.distributed``'s
``split_group`` / ``shrink_group``: both derive a group from an existing parent group,
so they can only ever produce subsets of it, and replicas that start after the trainer
are in no parent group; ``shrink_group`` is moreover NCCL-only and meant for removing
failed ranks. A new epoch's group over its own ``PrefixStore`` handles join, leave and
failure the same way, needs nothing from the default world (the trainer's FSDP world is
untouched), works on gloo and NCCL, and costs one rendezvous per membership change
(tens of milliseconds locally), never per refit.
"""

from __future__ import annotations

import hmac
import pickle
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reshard import planner
from reshard.comm import Comm
from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES, NO_VERSION
from reshard.errors import ConfigError, PlanError, ReshardError, TransferError
from reshard.executor import Executor
from reshard.fanout import check_fanout
from reshard.gate import resolve_key
from reshard.layout import Layout
from reshard.planner import Plan
from reshard.refit.receiver import Prepare, Staged, check_targets_or_prepare
from reshard.refit.rendezvous import Meeting, meeting_digest_key
from reshard.refit.side import RefitStats, Side, layouts_of, local_tensors, print_progress
from reshard.refit.sparse import DEFAULT_SPARSE, SPARSE_MODES

__all__ = ["Announcement", "ElasticReceiver", "ElasticSender"]

_PREFIX = "reshard/elastic"
_POLL_S = 0.02


@dataclass(frozen=True)
class Announcement:
    """What the coordinator publishes for refit number ``n``."""

    n: int
    version: int
    epoch: int
    members: tuple[tuple[str, int], ...]  # (replica id, tp size), in group order


class _EpochSide(Side):
    """The refit protocol of :mod:`reshard.refit` on one epoch's group: a single executor
    over the epoch's combined plan."""

    def __init__(self, meeting: Meeting, *, method: str, budget_bytes: int,
                 progress: bool | Callable[[int, int], None],
                 refit_timeout: timedelta | None, checksum: bool | str | None,
                 fanout: str = "auto", sparse: str | None = None,
                 version: int = NO_VERSION) -> None:
        self.method, self.fanout = method, fanout
        super().__init__(meeting, policy=None, budget_bytes=budget_bytes, progress=progress,
                         refit_timeout=refit_timeout, checksum=checksum, sparse=sparse,
                         version=version)

    def _build_executors(self, meeting: Meeting) -> list[Executor]:
        progress = self._options[2]  # the budget is the one every rank agreed on
        ex = Executor(meeting.plan, self.comm, method=self.method,
                      budget_bytes=self.budget_bytes, staging_bytes=self.staging_bytes,
                      checksum=self._checksum_kind(meeting) or False,
                      digest_key=meeting.digest_key, fanout=self.fanout,
                      same_source={n: n.split(":", 1)[1] for n in meeting.plan.names})
        if progress:
            ex.progress = progress if callable(progress) else print_progress
        return [ex]

    def enter(self, meeting: Meeting) -> None:
        """Move to a new epoch's group (the old one is dropped)."""
        with suppress(Exception):
            self.comm.close()
        self.broken = False
        self._setup(meeting)

    def _new_sparse_group(self) -> None:
        """A new epoch: every member keeps what it holds. A sender keeps its copies and
        base (a refit that failed dropped them); a replica's shadow is made from its live
        weights, which hold its version whole, so that version is its base (none for a
        replica that never refitted)."""
        if self.sparse_refits.mode is None:
            self.sparse_refits.reset()
            self.sparse_refits.base = None if self.version == NO_VERSION else self.version
        else:
            self.sparse_refits.new_group()


def _layout_key(layouts: Mapping[str, Layout]) -> tuple:
    return tuple((n, lay.structure, lay.ranks) for n, lay in
                 sorted(layouts.items(), key=lambda kv: kv[0]))


class _Planner:
    """Per-replica plans, cached by (group offset, replica layouts)."""

    def __init__(self, trainer_layouts: Mapping[str, Layout], trainer_size: int) -> None:
        self.src, self.trainer_size = dict(trainer_layouts), trainer_size
        self.cache: dict[tuple, Plan] = {}
        self.computed = 0

    def member_plan(self, offset: int, layouts: Mapping[str, Layout]) -> Plan:
        key = (offset, _layout_key(layouts))
        found = self.cache.get(key)
        if found is None:
            names = sorted(layouts)
            missing = sorted(set(self.src) - set(layouts))
            if missing:
                raise PlanError(f"the replica's layouts lack trainer tensors {missing[:5]}")
            found = planner.plan({_name(offset, n): self.src[n] for n in names},
                              {_name(offset, n): layouts[n].shifted(offset) for n in names},
                              allow_cast=True)
            self.cache[key] = found
            self.computed += 1
        return found

    def epoch_plan(self, members: Sequence[tuple[str, int, Mapping[str, Layout]]]
                   ) -> tuple[Plan, dict[str, int]]:
        tensors: list = []
        offsets: dict[str, int] = {}
        offset = self.trainer_size
        for rid, tp, layouts in members:
            tensors.extend(self.member_plan(offset, layouts).tensors)
            offsets[rid] = offset
            offset += tp
        return Plan(tuple(tensors)), offsets


def _name(offset: int, name: str) -> str:
    return f"{offset}:{name}"


class _Participant:
    """What trainer ranks and replica ranks share: the store, epochs, the refit side."""

    def __init__(self, host: str, port: int, *, is_master: bool, timeout: timedelta,
                 method: str, budget_bytes: int, backend: str,
                 refit_timeout: timedelta | None, checksum: bool | str | None,
                 progress: bool | Callable[[int, int], None],
                 token: str | bytes | None = None, listen: str | None = None,
                 fanout: str = "auto", sparse: str | None = None) -> None:
        self.timeout, self.backend = timeout, backend
        key = resolve_key(token)
        self.store = Comm.open_store(host, port, 0 if is_master else 1, None,
                                     is_server=is_master, timeout=timeout, token=key,
                                     listen=listen)
        self.digest_key = meeting_digest_key(self.store, key, is_master, timeout)
        self.kv = dist.PrefixStore(_PREFIX, self.store)
        self._side_opts = dict(method=method, budget_bytes=budget_bytes, progress=progress,
                               refit_timeout=refit_timeout, checksum=checksum,
                               fanout=check_fanout(fanout), sparse=sparse)
        self.side: _EpochSide | None = None
        self.epoch = 0
        self.version = NO_VERSION
        self.broken = False  # the last refit failed in the transport (or forming a group)
        self.offsets: dict[str, int] = {}
        self._replicas: dict[str, tuple[int, dict[str, Layout]]] = {}
        self.planner: _Planner

    def replica_info(self, rid: str) -> tuple[int, dict[str, Layout]]:
        info = self._replicas.get(rid)
        if info is None:
            info = self._replicas[rid] = pickle.loads(self.kv.get(f"replica/{rid}"))
        return info

    def announcement(self, n: int, wait: timedelta) -> Announcement:
        try:
            self.kv.wait([f"refit/{n}"], wait)
        except RuntimeError as e:
            raise TransferError(f"no refit announced within {wait.total_seconds():.0f} s "
                                f"({str(e).splitlines()[0]})") from e
        return pickle.loads(self.kv.get(f"refit/{n}"))

    def enter(self, ann: Announcement, group_rank: Callable[[dict[str, int]], int],
              side: str) -> None:
        """Form the group of epoch ``ann.epoch`` (collective over all its members)."""
        members = [(rid, tp, self.replica_info(rid)[1]) for rid, tp in ann.members]
        the_plan, self.offsets = self.planner.epoch_plan(members)
        size = self.planner.trainer_size + sum(tp for _, tp in ann.members)
        rank = group_rank(self.offsets)
        self.epoch = ann.epoch
        try:
            comm = Comm.from_existing_store(
                dist.PrefixStore(f"epoch/{ann.epoch}", self.kv), rank, size,
                backend=self.backend, timeout=self.timeout,
                name=f"{_PREFIX}/epoch/{ann.epoch}")
            meeting = Meeting(comm, the_plan, rank, side, 0 if side == "trainer" else rank,
                              self._epoch_key(ann.epoch))
            if self.side is None:
                # made with the version held (a replica filled from its peers holds
                # one whole): its sparse base from the first epoch on
                self.side = _EpochSide(meeting, version=self.version, **self._side_opts)
            else:
                self.side.enter(meeting)
            self.side.version = self.version
        except RuntimeError as e:
            self.broken = True
            raise TransferError(f"forming the group of membership epoch {ann.epoch} failed "
                                f"({str(e).splitlines()[0]}); nothing was moved") from e
        self.broken = False

    def _epoch_key(self, epoch: int) -> bytes | None:
        """The digest key of one epoch's group (a message of another epoch fails)."""
        if self.digest_key is None:
            return None
        return hmac.digest(self.digest_key, b"epoch %d" % epoch, "sha256")

    def close(self) -> None:
        if self.side is not None:
            with suppress(Exception):
                self.side.comm.close()


class ElasticSender(_Participant):
    """A trainer rank of an elastic refit group; trainer rank 0 also hosts the store and
    coordinates membership. Every trainer rank calls :meth:`refit` with the same
    version, like :class:`reshard.refit.RefitSender`."""

    def __init__(self, params: Mapping[str, Any], layouts: Mapping[str, Layout] | None = None,
                 *, host: str, port: int, rank: int, trainer_size: int,
                 method: str = "reshard", budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 backend: str = "gloo", timeout: timedelta = timedelta(seconds=120),
                 refit_timeout: timedelta | None = None,
                 rejoin_timeout: timedelta | None = None, checksum: bool | str | None = None,
                 progress: bool | Callable[[int, int], None] = False,
                 token: str | bytes | None = None, listen: str | None = None,
                 fanout: str = "auto", sparse: str = DEFAULT_SPARSE) -> None:
        """``timeout`` bounds store operations and group formation; ``refit_timeout``
        each refit (see :class:`reshard.refit.RefitSender`); ``rejoin_timeout`` how long
        the coordinator waits, after a failed refit, for replicas to report alive
        (default: ``refit_timeout`` or ``timeout``). ``token``, ``listen`` and
        ``checksum`` are as for :class:`reshard.refit.RefitSender`. ``fanout``: replicas
        of one layout fed ``direct`` by the trainer, ``relay``ed replica to replica, or
        ``auto`` (:mod:`reshard.fanout`); every trainer and replica rank passes the same.
        ``sparse``: as for :class:`reshard.refit.RefitSender`; a replica that holds the
        trainer's last committed version gets only the changed values while one that
        does not (a joiner, one whose refit failed) gets its regions dense, in the same
        refit (``docs/sparse.md``). Where the dense refits relay, so do the sparse ones:
        the replicas of one layout that hold the trainer's base form a chain, each
        passing on the encoded messages it received (a joiner gets its dense regions
        straight from the trainer)."""
        if sparse not in SPARSE_MODES:
            raise ConfigError(f"sparse must be one of {SPARSE_MODES}, got {sparse!r}")
        if layouts is None:
            _, layouts = layouts_of(params)
        super().__init__(host, port, is_master=rank == 0, timeout=timeout, method=method,
                         budget_bytes=budget_bytes, backend=backend,
                         refit_timeout=refit_timeout, checksum=checksum, progress=progress,
                         token=token, listen=listen, fanout=fanout, sparse=sparse)
        self.params, self.layouts = params, dict(layouts)
        self.rank, self.trainer_size = rank, trainer_size
        self.rejoin_timeout = rejoin_timeout or refit_timeout or timeout
        if rank == 0:
            self.kv.set("trainer", pickle.dumps((trainer_size, self.layouts)))
        self.planner = _Planner(self.layouts, trainer_size)
        self.members: tuple[tuple[str, int], ...] = ()
        self.history: list[dict[str, Any]] = []
        self._n = 0
        self._seen = 0

    @property
    def plans_computed(self) -> int:
        """Per-replica plans computed by this rank so far (the rest came from the cache)."""
        return self.planner.computed

    def requests(self) -> int:
        """How many join/leave requests were ever posted."""
        return int(self.kv.add("requests", 0))

    def wait_for_requests(self, total: int, timeout: timedelta | None = None) -> None:
        """Block until ``total`` join/leave requests have been posted (for scripted
        membership changes); a TransferError after ``timeout``."""
        end = time.monotonic() + (timeout or self.timeout).total_seconds()
        while self.requests() < total:
            if time.monotonic() > end:
                raise TransferError(f"only {self.requests()} of {total} membership requests "
                                    "arrived in time")
            time.sleep(_POLL_S)

    def refit(self, version: int, *, dense: bool = False) -> RefitStats:
        """Send the current parameters as ``version`` to every current replica, after
        applying the membership requests that arrived since the last refit. ``dense``:
        this refit dense whatever the ``sparse`` mode."""
        n = self._n
        before = self.planner.computed
        ann = self._announce(n, version) if self.rank == 0 else self.announcement(
            n, self.timeout)
        self._n += 1
        if ann.epoch != self.epoch or self.broken:
            self.enter(ann, lambda offsets: self.rank, "trainer")
        assert self.side is not None
        local = local_tensors(self.params)
        src = {_name(o, name): local[name] for o in self.offsets.values()
               for name in self.layouts}
        self.side.sparse_refits.force_dense = dense
        try:
            stats = self.side._move(src, {}, version)
        except TransferError:
            self.broken = self.side.broken
            raise
        finally:
            self.history.append({"n": n, "version": version, "epoch": ann.epoch,
                                 "members": [rid for rid, _ in ann.members],
                                 "new_plans": self.planner.computed - before})
        self.version = self.side.version = stats.version
        return stats

    def _announce(self, n: int, version: int) -> Announcement:
        members = list(self.members)
        changed = self.side is None
        if self.broken:  # the last refit broke the group: keep the replicas that answer
            members = self._alive(members)
            changed = True
        count = self.requests()
        for i in range(self._seen, count):
            req = pickle.loads(self.kv.get(f"request/{i}"))
            rid = req[1]
            if req[0] == "join" and all(rid != m for m, _ in members):
                problem = self._admissible(rid, sum(tp for _, tp in members))
                if problem:
                    self.kv.set(f"admit/{rid}", pickle.dumps(("rejected", problem)))
                    continue
                members.append((rid, req[2]))
                self.kv.set(f"admit/{rid}", pickle.dumps(("admitted", n)))
            elif req[0] == "leave":
                members = [m for m in members if m[0] != rid]
        self._seen = count
        changed = changed or tuple(members) != self.members
        ann = Announcement(n, version, self.epoch + 1 if changed else self.epoch,
                           tuple(members))
        self.members = ann.members
        self.kv.set(f"refit/{n}", pickle.dumps(ann))
        return ann

    def _admissible(self, rid: str, replicas_ranks: int) -> str | None:
        """Plan a joining replica before admitting it; a bad one is refused alone."""
        try:
            _, layouts = self.replica_info(rid)
            self.planner.member_plan(self.trainer_size + replicas_ranks, layouts)
        except (ReshardError, RuntimeError, pickle.UnpicklingError) as e:
            return f"replica {rid!r} refused: {e}"
        return None

    def _alive(self, members: list[tuple[str, int]]) -> list[tuple[str, int]]:
        keys = {rid: [f"alive/{self.epoch}/{rid}/{r}" for r in range(tp)]
                for rid, tp in members}
        end = time.monotonic() + self.rejoin_timeout.total_seconds()
        while True:
            ok = {rid for rid, k in keys.items() if self.kv.check(k)}
            if len(ok) == len(keys) or time.monotonic() > end:
                return [m for m in members if m[0] in ok]
            time.sleep(_POLL_S)


class ElasticReceiver(Staged, _Participant):
    """One rank of an inference replica in an elastic refit group.

    ``replica_id`` names the replica (all its TP ranks pass the same id; unique per
    incarnation); ``rank`` is this rank's place in the replica's TP group of
    ``tp_size`` ranks; ``targets`` and ``layouts`` are as for
    :class:`reshard.refit.RefitReceiver` (layouts over ranks ``0..tp_size-1``). The
    replica asks to join at construction; it takes part from the next refit on."""

    def __init__(self, targets: Mapping[str, torch.Tensor] | None = None,
                 layouts: Mapping[str, Layout] | None = None, *,
                 host: str, port: int, replica_id: str, rank: int, tp_size: int,
                 method: str = "reshard", budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 backend: str = "gloo", timeout: timedelta = timedelta(seconds=120),
                 refit_timeout: timedelta | None = None, checksum: bool | str | None = None,
                 progress: bool | Callable[[int, int], None] = False,
                 token: str | bytes | None = None, fanout: str = "auto",
                 direct: Collection[str] = (), prepare: Prepare | None = None) -> None:
        """``direct`` and ``prepare`` are as for :class:`reshard.refit.RefitReceiver`:
        targets that are the caller's own staging (written straight, never shadowed,
        committed by the caller once :meth:`refit` returned), or, instead of
        ``targets`` and ``layouts``, a function of the trainer's layouts (read from the
        store before this replica asks to join) that makes all three (as a vLLM engine
        does: ``reshard.integrations.vllm``)."""
        if not 0 <= rank < tp_size:
            raise PlanError(f"rank must be in [0, {tp_size}), got {rank}")
        check_targets_or_prepare(targets, layouts, prepare)
        super().__init__(host, port, is_master=False, timeout=timeout, method=method,
                         budget_bytes=budget_bytes, backend=backend,
                         refit_timeout=refit_timeout, checksum=checksum, progress=progress,
                         token=token, fanout=fanout)
        self.replica_id, self.rank, self.tp_size = str(replica_id), rank, tp_size
        trainer_size, trainer_layouts = pickle.loads(self.kv.get("trainer"))
        if prepare is not None:
            targets, layouts, direct = prepare(trainer_layouts)
        assert targets is not None and layouts is not None
        self._take(targets, direct)
        self.layouts = dict(layouts)
        self.shadow = self._new_shadow()
        self._torn = False  # a failed refit wrote the direct targets: no sparse base
        self.active = True  # False once it has left (or was dropped)
        if rank == 0:
            if self.kv.check([f"replica/{self.replica_id}"]):
                raise PlanError(f"replica id {self.replica_id!r} was used before; each "
                                "incarnation of a replica needs its own id")
            self.kv.set(f"replica/{self.replica_id}", pickle.dumps((tp_size, self.layouts)))
            self._request(("join", self.replica_id, tp_size))
        self.planner = _Planner(trainer_layouts, trainer_size)
        self._n: int | None = None

    @property
    def executors(self) -> list[Executor]:
        return self.side.executors if self.side is not None else []

    def _request(self, req: tuple) -> None:
        i = int(self.kv.add("requests", 1)) - 1
        self.kv.set(f"request/{i}", pickle.dumps(req))

    def leave(self) -> None:
        """Ask to leave (every rank of the replica may call it; rank 0 posts it). The
        replica still takes part in a refit already announced; the first ``refit()``
        that finds it gone returns None."""
        if self.rank == 0 and self.active:
            self._request(("leave", self.replica_id))

    def refit(self, wait: timedelta | None = None, *, go_live: bool = True,
              ready: Callable[[], None] | None = None) -> RefitStats | None:
        """Wait (up to ``wait``, default the store timeout) for the next refit and take
        part in it; None once this replica is no longer a member. ``go_live`` and
        ``ready`` are as for :meth:`reshard.refit.RefitReceiver.refit`: with
        ``go_live=False`` the version waits whole in the shadow until :meth:`go_live`."""
        if not self.active:
            raise ReshardError(f"replica {self.replica_id!r} is no longer a member")
        wait = wait or self.timeout
        if self._n is None:
            try:
                self.kv.wait([f"admit/{self.replica_id}"], wait)
            except RuntimeError as e:
                raise TransferError(f"replica {self.replica_id!r} was not admitted within "
                                    f"{wait.total_seconds():.0f} s") from e
            status, value = pickle.loads(self.kv.get(f"admit/{self.replica_id}"))
            if status == "rejected":
                self.active = False
                raise PlanError(value)
            self._n = value
        ann = self.announcement(self._n, wait)
        self._n += 1
        if all(rid != self.replica_id for rid, _ in ann.members):
            self.active = False
            self.close()
            return None
        if ann.epoch != self.epoch or self.broken:
            self.shadow = self._new_shadow()
            try:
                self.enter(ann, lambda offsets: offsets[self.replica_id] + self.rank,
                           "inference")
            except TransferError:
                self._report_alive()
                raise
            if self._torn:  # a new epoch takes the live version as its base: not so for
                # direct targets a failed refit wrote (the trainer's copies lost their
                # base at that failure too; this says so on the replica's side as well)
                self.side.sparse_refits.base = None
        assert self.side is not None
        offset = self.offsets[self.replica_id]
        dst = {_name(offset, n): self.shadow[n] for n in self.layouts}
        try:
            stats = self.side._move({}, dst, None, ready)
        except TransferError:
            # the caller's own staging (direct) may hold part of the failed version
            self._torn = self._torn or bool(self.direct)
            self.broken = self.side.broken
            if self.broken:
                self._report_alive()
            raise
        self._torn = False
        self.received = stats.version
        if go_live:
            self.go_live()
        return stats

    def go_live(self) -> int:
        """Copy the last version received whole over the live targets (after
        ``refit(go_live=False)``; :meth:`refit` does it by default); returns it."""
        version = self._received_version()
        self._go_live()
        self.version = self.side.version = version  # type: ignore[union-attr]
        return self.version

    def _report_alive(self) -> None:
        with suppress(Exception):
            self.kv.set(f"alive/{self.epoch}/{self.replica_id}/{self.rank}", "1")
