"""What the refit sender and receiver share: the set-up collective, executors, commit.

The refit API for RL frameworks: a trainer-side sender and an inference-side receiver.

Both sides meet once (:func:`reshard.refit.meet`), plan once, and reuse the plan
for every refit. Each refit carries a weight version, the trainer's step (``>= 0``;
the weights it holds before its first optimizer step are version 0), and each must be
newer than every rank's current one; the receiver's ``version`` tells a rollout which
policy it is sampling from. Before its first refit a side holds no version
(:data:`reshard.defaults.NO_VERSION`, -1): a fresh engine's weights are its checkpoint's.

Never torn: by default the receiver writes into a shadow copy of its parameters and
copies it over the live ones only after every rank of both sides has confirmed that
its part arrived whole (one small collective). A refit that fails midway (a peer dies,
a timeout, a sender raising) leaves the previous version in place on every rank and
raises a :class:`reshard.TransferError`. The shadow costs one extra copy of the
receiving rank's parameters; ``staging="none"`` writes in place instead (no extra
memory, but a failed refit may leave weights torn).

Lost workers (see ``docs/reliability.md``): with ``refit_timeout`` every wait of a refit
ends by one deadline (gloo), so a dead or stuck peer is a ``TransferError`` within that
time on every surviving rank, never a hang. A refit that failed in the transport (a
peer lost, a deadline passed) marks the group ``broken``: later refits refuse at once
until :meth:`reconnect` meets again at a new address (same or new inference size; a
restarted worker joins with a fresh receiver) and rebuilds plans and executors while
keeping the current version. ``checksum`` sends a digest of every message and fails the
refit cleanly on corruption; with a token (``docs/security.md``) it is on by default,
keyed (``"hmac"``), so a message nobody with the token sent never goes live.

FP8 engines (``docs/fp8.md``): when the meeting planned tensors into FP8 blocks, each
trainer rank quantizes its own pieces before every refit (the blocks split across
trainer ranks get their amax in one ``all_reduce(MAX)`` among them) and sends FP8
codes and scales; the receivers get them like any other tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch

from reshard import planner
from reshard.defaults import ALL_METHODS, COLOCATED, DEFAULT_REFIT_STAGING_BYTES, NO_VERSION
from reshard.errors import ConfigError, ReshardError, TensorMismatchError, TransferError
from reshard.executor import CheckedTensors, Executor, checksum_kind
from reshard.layout import Layout
from reshard.planner import Plan, gc_paused
from reshard.refit.amax import quantize_for_refit
from reshard.refit.rendezvous import Meeting, meet
from reshard.refit.sparse import SPARSE_METHODS, SparseRefits, SparseStats

__all__ = ["RefitStats", "Side", "layouts_of", "local_tensors", "print_progress"]


@dataclass(frozen=True)
class RefitStats:
    version: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    rounds: int
    peak_staging_bytes: int = 0
    """The transfer's staging memory on this rank (the largest of its executors')."""
    amax_bytes: int = 0
    """FP8 refits: the bytes this rank put into the amax exchange (4 a shared block)."""
    quantize_seconds: float = 0.0
    """FP8 refits: this rank's time quantizing (its amax exchange included)."""
    sparse: SparseStats | None = None
    """Sparse refits (``RefitSender(sparse=...)`` not ``"off"``): changed fraction,
    bytes by encoding, the dense bytes replaced, detection time (``docs/sparse.md``)."""


def layouts_of(params: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Layout]]:
    """Local tensors and layouts of parameters held as DTensors (FSDP2 / TP) or plain
    tensors (taken as whole, on this rank alone)."""
    tensors, layouts = {}, {}
    for name, p in params.items():
        data = p.detach() if isinstance(p, torch.Tensor) else p
        if hasattr(data, "to_local") and hasattr(data, "placements"):
            layouts[name] = Layout.from_dtensor(data)
            tensors[name] = data.to_local()
        else:
            raise TensorMismatchError(f"parameter {name!r} is a plain tensor: give its Layout "
                                      "explicitly (layouts=...)")
    return tensors, layouts


class _SetupView(NamedTuple):
    """What one rank says at a meeting's set-up collective (see :meth:`Side._setup`)."""

    side: str
    policy: tuple[tuple[str, str], ...]
    budget_bytes: int
    checksum: str | None
    method: str | None
    problem: str | None
    version: int


class Side:
    """What sender and receiver share: the meeting, the plan(s), executors, commit."""

    method: str | None = None  # one method for every tensor (reshard.refit.elastic); else a policy

    def __init__(self, meeting: Meeting, *, policy: Mapping[str, str] | None,
                 budget_bytes: int, progress: bool | Callable[[int, int], None],
                 refit_timeout: timedelta | None = None, checksum: bool | str | None = None,
                 meet_args: dict[str, Any] | None = None, sparse: str | None = None,
                 version: int = NO_VERSION) -> None:
        """``meet_args`` (as for :func:`meet`) are kept for :meth:`_remeet`. ``checksum``
        None: ``"hmac"`` when the meeting has a token, else off. ``sparse``: a sender's
        mode (``"auto"``, ``"on"``, ``"off"``); None on a receiver, which follows.
        ``version``: what this rank holds already (an elastic replica filled from its
        peers); NO_VERSION, nothing refitted yet, is older than any step."""
        self.sparse_refits = SparseRefits(sparse)
        if meet_args is not None:
            self._meet_args = meet_args
        self.version = version
        self.broken = False  # a refit failed in the transport: reconnect() before the next
        self.pending: int | None = None  # a version received whole whose commit is in doubt
        self.refit_timeout, self.checksum = refit_timeout, checksum
        self._options = (policy, budget_bytes, progress)
        self._setup(meeting)

    def _setup(self, meeting: Meeting) -> None:
        """Plans and executors for a meeting (the first one or a reconnect)."""
        policy, budget_bytes, _ = self._options
        self.meeting, self.comm, self.rank = meeting, meeting.comm, meeting.rank
        fp8 = meeting.fp8  # what each refit's tensors are checked against (_check)
        self._checked = CheckedTensors(meeting.plan, meeting.rank, src_layouts=None
                                       if fp8 is None else fp8.source_checks())
        # one collective before any executor is built: both sides must schedule the plan
        # alike (two ends of a message that disagree on its round or method pair the
        # wrong messages or wait forever), so they agree on the trainer's policy (a
        # receiver has none), on the staging budget (the smallest any rank asked for:
        # one schedule has to respect every rank's cap) and on the checksum option (a
        # digest nobody reads would hang); they also learn the newest version any rank
        # committed (see _reconciled)
        kind = self._checksum_kind(meeting)
        problem = _policy_problem(meeting.plan, policy)
        unchecked = sorted({"gather_broadcast", COLOCATED} & set((policy or {}).values()))
        if problem is None and self.checksum and unchecked:
            problem = f"checksum does not cover the {' / '.join(unchecked)} policy"
        views: list[_SetupView] = self.comm.all_gather_object(_SetupView(
            meeting.side, tuple(sorted((policy or {}).items())), budget_bytes, kind,
            self.method, problem, self.version))
        bad = [(r, v.problem) for r, v in enumerate(views) if v.problem]
        if bad:
            raise ReshardError(f"rank {bad[0][0]}: {bad[0][1]}; nothing was moved")
        for field_, what in (("checksum", "the checksum option"), ("method", "the method")):
            values = [getattr(v, field_) for v in views]
            if len(set(values)) > 1:
                raise ReshardError(f"the ranks disagree on {what}: {values}; nothing was "
                                   "moved")
        policies = {v.policy for v in views if v.side == "trainer"}
        if len(policies) > 1:
            raise ReshardError("the trainer ranks give different policies "
                               f"({[dict(p) for p in sorted(policies)]}); nothing was moved")
        self.policy = dict(policies.pop()) if policies else {}
        self.budget_bytes = min(v.budget_bytes for v in views)
        # what a round may stage on a receiver: derived from the agreed budget, so alike
        # on every rank (a newer side that stages otherwise shows in the schedule check)
        self.staging_bytes = min(self.budget_bytes, DEFAULT_REFIT_STAGING_BYTES)
        self.executors = self._build_executors(meeting)
        self._amax_comm = _amax_group(meeting)
        self._new_sparse_group()
        self._sparse_bases: dict[int, int | None] | None = None
        self._reconciled(max(v.version for v in views))
        self.pending = None

    def _new_sparse_group(self) -> None:
        """A new meeting: no rank is known to hold anything (an elastic group, whose
        members keep their versions across epochs, keeps its bases)."""
        self.sparse_refits.reset()

    def _checksum_kind(self, meeting: Meeting) -> str | None:
        """The digest every message gets: as asked, else keyed when there is a token."""
        if self.checksum is None:
            return "hmac" if meeting.digest_key else None
        kind = checksum_kind(self.checksum)
        if kind == "hmac" and not meeting.digest_key:
            raise ConfigError("checksum='hmac' needs a token (token= or $RESHARD_TOKEN) on "
                              "both jobs; nothing was moved")
        return kind

    def _build_executors(self, meeting: Meeting) -> list[Executor]:
        """One executor per policy method (``reshard`` for every tensor by default)."""
        progress = self._options[2]
        kind = self._checksum_kind(meeting)
        executors = []
        for method, sub in _split_by_policy(meeting.plan, self.policy).items():
            ex = Executor(sub, self.comm, method=method, budget_bytes=self.budget_bytes,
                          staging_bytes=self.staging_bytes,
                          checksum=False if method in ("gather_broadcast", COLOCATED)
                          else kind or False, digest_key=meeting.digest_key)
            if progress:
                ex.progress = progress if callable(progress) else print_progress
            executors.append(ex)
        return executors

    def _deadline(self) -> float | None:
        if self.refit_timeout is None:
            return None
        return time.monotonic() + self.refit_timeout.total_seconds()

    @staticmethod
    def _left(deadline: float | None, floor: float = 0.0) -> timedelta | None:
        if deadline is None:
            return None
        return timedelta(seconds=max(deadline - time.monotonic(), floor, 0.001))

    def _check(self, src, dst, proposed: int | None, deadline: float | None = None) -> int:
        if self.broken:
            raise TransferError(f"rank {self.rank}: the weight-update group is broken since a "
                                "refit failed in the transport; call reconnect() first; "
                                "nothing was moved")
        problem = self._checked.problem(src, dst)
        sparse = self.sparse_refits.view()
        try:
            views = self.comm.all_gather_object((self.rank, problem, proposed, self.version,
                                                 sparse), **_timeout(self._left(deadline)))
        except RuntimeError as e:
            self._break()
            raise TransferError(f"rank {self.rank}: the weight-update group is broken "
                                f"({str(e).splitlines()[0]}); nothing was moved") from e
        problems = [(r, p) for r, p, *_ in views if p]
        if problems:
            raise TensorMismatchError(f"rank {problems[0][0]}: {problems[0][1]}; nothing "
                                      "was moved")
        proposals = [v for _, _, v, *_ in views if v is not None]
        new, current = max(proposals), max(c for _, _, _, c, _ in views)
        sparse_views = [s for *_, s in views]
        self._sparse_bases = SparseRefits.decide(sparse_views)
        self.sparse_refits.heard(sparse_views)
        if min(proposals) < 0:
            raise ConfigError(f"a refit version is the trainer's step, >= 0; got "
                              f"{min(proposals)}; nothing was moved")
        if new <= current:
            raise ReshardError(f"refit version {new} is not newer than the current version "
                               f"{current}; nothing was moved")
        return new

    def _move(self, src, dst, proposed: int | None,
              ready: Callable[[], None] | None = None) -> RefitStats:
        """One version: check, transfer, then (``ready``, on a receiver whose part
        arrived whole: its own last step before it confirms, such as preparing the new
        version beside the live one; raising fails the version on every rank) the
        agreement. Once every rank has come (the check's collective), Python's cyclic
        collector is paused until the agreement (as for planning): a refit makes a few
        small objects per region and no cycles, and each automatic collection would
        traverse everything alive (the plan, its hops, the caller's model); with 50,000
        regions (a MoE of Qwen3-30B-A3B's tensor count) those collections took more than
        half of a sparse refit. Not while waiting for the peers: a served engine may
        wait long for its trainer."""
        t0 = time.perf_counter()
        deadline = self._deadline()
        version = self._check(src, dst, proposed, deadline)
        with gc_paused():
            return self._moved(src, dst, version, deadline, ready, t0)

    def _moved(self, src, dst, version: int, deadline: float | None,
               ready: Callable[[], None] | None, t0: float) -> RefitStats:
        """:meth:`_move` once checked: quantize (FP8), transfer, ready, agree, commit."""
        error: BaseException | None = None
        t_quant = time.perf_counter()
        try:
            src, amax = self._quantized(src, deadline)
        except TransferError as e:
            error, amax = e, 0
        t_quant = time.perf_counter() - t_quant
        moved = _Moved()
        if error is None:
            error = self._transfer(src, dst, deadline, moved)
        broken = any(ex.broken for ex in self.executors) or any(
            tr.broken for tr in self.sparse_refits.transports.values())
        if broken:  # tell every peer now (their waits fail at once), then the commit fails
            self._break()
        if error is None and ready is not None:
            try:
                ready()
            except Exception as e:  # noqa: BLE001 - every rank hears of it at the commit
                error = e
        try:
            self._commit(error, broken=broken, deadline=deadline, version=version)
        except BaseException:
            self.sparse_refits.failed()
            raise
        self.sparse_refits.committed(version, src, self.executors, moved.sparse,
                                     time.perf_counter() - t0)
        return RefitStats(version, time.perf_counter() - t0, moved.sent, moved.received,
                          moved.rounds, moved.staging, amax, t_quant, moved.sparse)

    def _transfer(self, src, dst, deadline: float | None, moved: _Moved
                  ) -> BaseException | None:
        """Run every executor (those a sparse refit carries through its transport);
        what they moved goes into ``moved``; returns the first transport error."""
        bases = self._sparse_bases
        dense = []  # the executors a sparse refit does not carry: as in a dense refit
        for ex in self.executors:
            ex.deadline = deadline
            try:
                if bases is not None and ex.method in SPARSE_METHODS:
                    s = self.sparse_refits.run(ex, src, dst, bases, deadline)
                    moved.add_sparse(s)
                else:
                    moved.add(ex.run(src, dst, check=False))
                    dense.append(ex.method)
            except TransferError as e:
                return e
        if moved.sparse is None and self.sparse_refits.mode not in (None, "off"):
            moved.sparse = SparseStats(state_bytes=self.sparse_refits.state_bytes())
        elif moved.sparse is not None:
            moved.sparse.dense_methods = tuple(sorted(set(dense)))
        return None

    def _quantized(self, src, deadline: float | None):
        """``(what this rank sends, amax bytes it exchanged)``: on a trainer rank of an
        FP8 refit, its quantized tensors' FP8 codes and scales over ``src``."""
        fp8 = self.meeting.fp8
        if fp8 is None or self.rank not in fp8.sources:
            return src, 0
        group = self._amax_comm

        def reduce(vec: torch.Tensor) -> None:
            if group is not None:
                group.all_reduce_max(vec, self._left(deadline))

        try:
            made = quantize_for_refit(fp8, src, self.rank, reduce)
        except RuntimeError as e:  # the exchange failed: a trainer rank lost or late
            self._break()
            raise TransferError(f"rank {self.rank}: the FP8 amax exchange failed "
                                f"({str(e).splitlines()[0]})") from e
        return _Overlay(made, src), fp8.plan.exchange_bytes

    def _commit(self, error: BaseException | None, *, broken: bool = False,
                deadline: float | None = None, version: int | None = None) -> None:
        """Every rank says whether its part arrived whole; any failure aborts all. A
        transport failure anywhere marks the group broken on every rank that hears of it."""
        try:
            views = self.comm.all_gather_object(
                (self.rank, None if error is None else str(error), broken),
                **_timeout(self._left(deadline, floor=_COMMIT_GRACE_S)))
        except Exception as e:
            self._break()
            if error is None and version is not None:
                self._in_doubt(version)
            why = str(error if error is not None else e).splitlines()[0]
            raise TransferError(f"rank {self.rank}: refit aborted, the group is broken "
                                f"({why}); the previous version stays in place"
                                ) from (error or e)
        self.broken = self.broken or any(b for _, _, b in views)
        failed = [(r, msg) for r, msg, _ in views if msg]
        if failed:
            raise TransferError(f"refit aborted on every rank because rank {failed[0][0]} "
                                f"failed: {failed[0][1]}; the previous version stays in "
                                "place") from error

    def _break(self) -> None:
        """The group failed in the transport: mark it broken and close this rank's
        connections, so every peer's pending wait fails now rather than at its deadline."""
        if not self.broken:
            self.broken = True
            with suppress(Exception):
                self.comm.abort()

    def _in_doubt(self, version: int) -> None:
        """This rank's part of ``version`` arrived whole but the commit did not reach it."""

    # -- rebuilding after a lost worker --------------------------------------------------
    def _remeet(self, host: str, port: int, *, rank: int | None, trainer_size: int | None,
                inference_size: int | None, timeout: timedelta | None) -> None:
        args = dict(self._meet_args)
        args.update({k: v for k, v in (("side_rank", rank), ("trainer_size", trainer_size),
                                       ("inference_size", inference_size),
                                       ("timeout", timeout)) if v is not None})
        old = self.comm
        with suppress(Exception):  # the old group may hold dead peers; never wait on it
            old.close()
        meeting = meet(host, port, **args)
        self._meet_args = args
        self.broken = False
        self._setup(meeting)

    def _reconciled(self, committed: int) -> None:
        """After a reconnect: ``committed`` is the newest version any rank committed."""


class _Moved:
    """What a refit's executors moved on this rank, added up."""

    def __init__(self) -> None:
        self.sent = self.received = self.rounds = self.staging = 0
        self.sparse: SparseStats | None = None

    def add(self, s) -> None:
        self.sent, self.received = self.sent + s.bytes_sent, self.received + s.bytes_received
        self.rounds += s.rounds
        self.staging = max(self.staging, s.peak_staging_bytes)

    def add_sparse(self, s: SparseStats) -> None:
        self.sent, self.received = self.sent + s.wire_sent, self.received + s.wire_received
        self.rounds += s.rounds
        if self.sparse is None:
            self.sparse = s
        else:
            self.sparse.merge(s)


_COMMIT_GRACE_S = 1.0  # a rank that hit the deadline still tells its peers, this long


def _timeout(left: timedelta | None) -> dict[str, timedelta]:
    return {} if left is None else {"timeout": left}


def _amax_group(meeting: Meeting) -> Any:
    """The trainer ranks' own group for the FP8 amax exchange (None where none is needed:
    no FP8 tensor, no block split across them, or an inference rank)."""
    fp8 = meeting.fp8
    if fp8 is None or not fp8.plan.num_shared or meeting.rank not in fp8.sources:
        return None
    return meeting.comm.subgroup(fp8.sources)


class _Overlay(dict):
    """The tensors a sender made (FP8 codes and scales) over the ones it was given."""

    def __init__(self, made: Mapping[str, torch.Tensor], rest: Mapping[str, Any]) -> None:
        super().__init__(made)
        self.rest = rest

    def __missing__(self, name: str) -> Any:
        return self.rest[name]

    def get(self, name, default=None):
        return self[name] if name in self else self.rest.get(name, default)


def local_tensors(params: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    class _Lazy(dict):
        def __missing__(self, name):  # DTensor -> its local shard, read at send time
            p = params[name]
            data = p.detach() if isinstance(p, torch.Tensor) else p
            return data.to_local() if hasattr(data, "to_local") else data

        def get(self, name, default=None):
            return self[name] if name in params else default

    return _Lazy()


def _policy_problem(plan: Plan, policy: Mapping[str, str] | None) -> str | None:
    """What is wrong with a per-parameter policy, as a sentence, or None."""
    if not policy:
        return None
    unknown = sorted(set(policy) - set(plan.names))
    if unknown:
        return f"the policy names parameters that are not in the plan: {unknown[:5]}"
    methods = sorted(set(policy.values()) - set(ALL_METHODS))
    if methods:
        return f"the policy names unknown methods {methods}; expected one of {ALL_METHODS}"
    return None


def _split_by_policy(plan: Plan, policy: Mapping[str, str]) -> dict[str, Plan]:
    groups: dict[str, list] = {}
    for t in plan.tensors:
        groups.setdefault(policy.get(t.name, "reshard"), []).append(t)
    if len(groups) == 1:  # one method for everything: the meeting's plan as it is
        return {next(iter(groups)): plan}
    out = {}
    for method, tensors in groups.items():
        out[method] = planner.plan({t.name: t.src for t in tensors},
                                {t.name: t.dst for t in tensors}, allow_cast=True)
    return out


def print_progress(done: int, total: int) -> None:
    if total:
        print(f"\rrefit: {done / total:6.1%} of {total / 2**20:.1f} MiB sent", end="",
              flush=True)
        if done >= total:
            print()
