"""Two separately launched jobs (a trainer job and an inference job) meet at a TCP store.

Each side describes its own parameters with layouts over its own ranks (0..n-1). At the
meeting, the sides join one stateless process group (trainer ranks first, inference
ranks after them: the rank offset), exchange their layouts through the store, and every
rank builds the same plan. A plan fingerprint is compared on every rank before any
weight moves; if any rank disagrees, every rank raises ``FingerprintMismatchError``.

An inference side that serves tensors in FP8 blocks says so with ``quant`` (its block
format): every rank then plans the quantization too (:mod:`reshard.quant.targets`),
and a split the engine could not load is refused on every rank of both jobs.
"""

from __future__ import annotations

import pickle
import secrets
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta

from reshard.comm import Comm
from reshard.errors import FingerprintMismatchError, PlanError, ReshardError, error_class
from reshard.gate import TOKEN_ENV, AuthError, Key, resolve_key
from reshard.layout import Layout
from reshard.planner import Plan, plan
from reshard.quant.blocks import BlockFormat
from reshard.quant.targets import Fp8Refit, plan_fp8_refit
from reshard.store import refusals, token_notice, token_notices

__all__ = ["Meeting", "Refused", "agree", "meet", "meeting_digest_key", "own_layouts"]

SIDES = ("trainer", "inference")
_POLL_S = 0.05  # how often a rank waiting for the other job looks for a token notice


@dataclass
class Meeting:
    """What a rank gets from :func:`meet`: the shared group, the plan, its group rank."""

    comm: Comm
    plan: Plan
    rank: int
    side: str
    offset: int
    digest_key: bytes | None = None
    """With a token: the key of this meeting's message digests (fresh per meeting)."""
    fp8: Fp8Refit | None = None
    """The tensors quantized to FP8 blocks on the way (an engine that asked for it)."""


#: What an inference side may give instead of its layouts: a function of the trainer's
#: layouts (name -> Layout, with names, shapes and dtypes) returning its own.
LayoutsFromTrainer = Callable[[Mapping[str, Layout]], Mapping[str, Layout]]


@dataclass(frozen=True)
class Refused:
    """Published instead of layouts when a side could not make them."""

    kind: str
    message: str


def meet(host: str, port: int, *, side: str, side_rank: int, trainer_size: int,
         inference_size: int, layouts: Mapping[str, Layout] | LayoutsFromTrainer,
         backend: str = "gloo", allow_cast: bool = True,
         timeout: timedelta = timedelta(minutes=5), token: str | bytes | Key | None = None,
         listen: str | None = None, quant: BlockFormat | None = None) -> Meeting:
    """Join the weight-update group and agree on a plan; collective over both jobs.

    ``layouts`` use this side's own rank numbers; the trainer's rank 0 hosts the store.
    The inference side may pass a function of the trainer's layouts instead (it learns
    the trainer's tensor names, shapes and dtypes at the meeting, before the group
    forms); if it raises a :class:`reshard.ReshardError`, every rank of both jobs raises
    the same error class with its message, and nothing moves. ``quant`` (inference
    side only): the block format of the engine's FP8 tensors (those whose layout is
    ``float8_e4m3fn`` while the trainer's is not), which the trainer quantizes on the way.

    ``token`` (else ``$RESHARD_TOKEN``): only ranks holding the same token meet, and
    every message of the refits is checked with a key derived from it; ``listen``: the
    address or interface the host's store listens at (default ``host``). See
    ``docs/security.md``.
    """
    if side not in SIDES:
        raise PlanError(f"side must be one of {SIDES}, got {side!r}")
    if trainer_size < 1 or inference_size < 1:
        raise PlanError(f"trainer_size and inference_size must be >= 1, got {trainer_size} "
                        f"and {inference_size}")
    if side == "trainer" and quant is not None:
        raise PlanError("quant is the inference side's to give (its FP8 block format); "
                        "the trainer learns it at the meeting")
    if side == "trainer" and callable(layouts):
        raise PlanError("the trainer side gives its layouts as a mapping name -> Layout; "
                        "only the inference side may derive its own from the trainer's")
    size = trainer_size if side == "trainer" else inference_size
    if not 0 <= side_rank < size:
        raise PlanError(f"side_rank must be in [0, {size}) for the {side}, got {side_rank}")
    offset = 0 if side == "trainer" else trainer_size
    rank = side_rank + offset
    world = trainer_size + inference_size
    key = resolve_key(token)
    store = Comm.open_store(host, port, rank, world, timeout=timeout, token=key,
                            listen=listen)
    _agree_on_sizes(store, side, side_rank, (trainer_size, inference_size, backend), timeout)
    digest_key = meeting_digest_key(store, key, rank == 0, timeout)
    trainer_layouts = None
    if side == "trainer":  # published before the group forms: a receiver may need them
        mine = own_layouts(layouts, offset, None)
        if side_rank == 0:
            store.set("reshard/layouts/trainer", pickle.dumps(mine))
    else:
        trainer_layouts = _read_layouts(store, "trainer", timeout)
        mine = own_layouts(layouts, offset, trainer_layouts)
    comm = Comm.from_existing_store(store, rank, world, backend=backend, timeout=timeout)
    if side == "inference" and side_rank == 0:  # the format first: read once layouts are
        comm.store.set("reshard/quant/inference", pickle.dumps(quant))
        comm.store.set("reshard/layouts/inference", pickle.dumps(mine))
    if side == "inference":
        theirs = trainer_layouts
    else:
        theirs = _read_layouts(comm.store, "inference", timeout)
        quant = pickle.loads(comm.store.get("reshard/quant/inference"))
    the_plan, fp8, fingerprint, problem = _plan_or_problem(
        mine, theirs, side, allow_cast, quant, trainer_size)
    views = comm.all_gather_object((rank, fingerprint, problem))
    agree(views)
    assert the_plan is not None
    return Meeting(comm, the_plan, rank, side, offset, digest_key, fp8)


def meeting_digest_key(store, key: Key | None, host: bool, timeout: timedelta) -> bytes | None:
    """The key of this meeting's message digests: the token's, salted by a nonce the host
    draws (so a message recorded at one meeting fails at the next)."""
    if key is None:
        return None
    if host:
        store.set("reshard/meeting/nonce", secrets.token_bytes(16))
    store.wait(["reshard/meeting/nonce"], timeout)
    return key.derive(b"digest|" + store.get("reshard/meeting/nonce"))


def _read_layouts(store, side: str, timeout: timedelta) -> dict[str, Layout] | Refused:
    store.wait([f"reshard/layouts/{side}"], timeout)
    return pickle.loads(store.get(f"reshard/layouts/{side}"))


def own_layouts(layouts: Mapping[str, Layout] | LayoutsFromTrainer, offset: int,
                 trainer: dict[str, Layout] | Refused | None) -> dict[str, Layout] | Refused:
    """This side's layouts in group ranks, or why it could not make them."""
    if isinstance(trainer, Refused):
        return trainer
    try:
        if callable(layouts):  # the trainer's ranks come first: its own numbers already
            layouts = layouts(dict(trainer))
        return {name: lay.shifted(offset) for name, lay in layouts.items()}
    except ReshardError as e:
        return Refused(type(e).__name__, str(e))


def _plan_or_problem(mine, theirs, side: str, allow_cast: bool, quant: BlockFormat | None,
                     trainer_size: int):
    """``(plan, fp8 part, fingerprint, None)``, or ``(None, None, None, (error class
    name, message))``."""
    refused = next((x for x in (mine, theirs) if isinstance(x, Refused)), None)
    if refused is not None:
        return None, None, None, (refused.kind, refused.message)
    src, dst = (mine, theirs) if side == "trainer" else (theirs, mine)
    try:
        src, fp8 = plan_fp8_refit(src, dst, quant, tuple(range(trainer_size)), trainer_size)
        the_plan = plan(src, dst, allow_cast=allow_cast)
        return the_plan, fp8, the_plan.fingerprint(), None
    except ReshardError as e:
        return None, None, None, (type(e).__name__, str(e))


def _agree_on_sizes(store, side: str, side_rank: int, mine: tuple[int, int, str],
                    timeout: timedelta) -> None:
    """Before the group forms: both jobs must give the same sizes and backend, or the
    group would wait for ranks that never come. Each side's rank 0 publishes what its
    job was given; every rank compares both with its own and raises ``PlanError`` at
    once. A rank of the other job that was refused for its token says so in the store:
    then every rank waiting here raises ``AuthError`` at once. The store's host (trainer
    rank 0) waits, within ``timeout``, until every rank that will come has read, so no
    rank loses the store before it learns why."""
    if side_rank == 0:
        store.set(f"reshard/setup/{side}", pickle.dumps(mine))
    keys = [f"reshard/setup/{s}" for s in SIDES]
    try:
        _wait_for_setup(store, keys, side, timeout)
    except (RuntimeError, AuthError) as e:  # the other job never came, or said why not
        refused = refusals(store)
        if side == "trainer":
            told = isinstance(e, AuthError)
            _leave_together(store, side_rank, mine[:2], told, timeout)
        if isinstance(e, AuthError):
            raise
        if refused:
            raise AuthError(f"the two jobs did not meet within {timeout.total_seconds():.0f}"
                            f" s{refused}; nothing was moved") from e
        raise
    said = dict(zip(SIDES, (pickle.loads(store.get(k)) for k in keys)))
    store.add("reshard/setup/read", 1)
    if said["trainer"] == said["inference"] == mine:
        return
    if side == "trainer" and side_rank == 0:  # the host: keep the store up for the others
        coming = said["trainer"][0] + said["inference"][1]
        deadline = time.monotonic() + timeout.total_seconds()
        while store.add("reshard/setup/read", 0) < coming and time.monotonic() < deadline:
            time.sleep(0.01)

    def text(v: tuple[int, int, str]) -> str:
        return f"trainer_size={v[0]}, inference_size={v[1]}, backend={v[2]!r}"

    parts = [f"the {s} job's rank 0 was given {text(v)}" for s, v in said.items()]
    if mine not in said.values():
        parts.append(f"this rank ({side} rank {side_rank}) was given {text(mine)}")
    raise PlanError("the two jobs disagree on the group: " + "; ".join(parts)
                    + "; nothing was moved")


def _wait_for_setup(store, keys: list[str], side: str, timeout: timedelta) -> None:
    """``store.wait(keys, timeout)``, looking every ``_POLL_S`` for a token notice: a rank
    of the other job said it was refused for its token (``AuthError`` at once)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        said = token_notice(store)
        if said is not None:
            raise AuthError(_told(said, side))
        if time.monotonic() + _POLL_S >= deadline:  # torch's own error at the deadline
            store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            return
        time.sleep(_POLL_S)


_TOLD = {"none": "holds no token while this job holds one",
         "other": "holds a different token from this job's",
         "extra": "holds a token while this job holds none"}


def _told(said: str, side: str) -> str:
    """The error a waiting rank raises when the other job said why its rank left."""
    other = SIDES[1 - SIDES.index(side)]
    how = ("this job's gate refused its ranks" if said != "extra"
           else "its ranks do not join a store without a gate")
    return (f"the {other} job {_TOLD[said]} (${TOKEN_ENV} or token=): {how}; give both "
            "jobs the same token; nothing was moved")


def _leave_together(store, side_rank: int, sizes: tuple[int, int], told: bool,
                    timeout: timedelta) -> None:
    """The trainer's ranks gave up waiting: the host keeps the store up (a few seconds
    at most) until each has read why, and, ``told`` by the other job's ranks why they
    left, until each of them has said so (so that none, coming later, finds nobody to
    tell it by name), then all leave."""
    with suppress(Exception):
        store.add("reshard/setup/gave_up", 1)
        if side_rank == 0:
            deadline = time.monotonic() + min(timeout.total_seconds(), 10.0)
            while (store.add("reshard/setup/gave_up", 0) < sizes[0]
                   or told and token_notices(store) < sizes[1]):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def agree(views: list[tuple[int, str | None, tuple[str, str] | None]]) -> None:
    """Every rank's ``(rank, plan fingerprint, problem)`` seen alike: the first problem
    raised as its own error class, or different fingerprints refused, before a byte moves."""
    problems = [(r, p) for r, _, p in views if p]
    if problems:
        r, (kind, p) = problems[0]
        raise error_class(kind, PlanError)(f"rank {r} could not plan: {p}; nothing was moved")
    prints = {fp for _, fp, _ in views}
    if len(prints) > 1:
        who = {fp: [r for r, f, _ in views if f == fp] for fp in prints}
        raise FingerprintMismatchError(
            f"the two jobs' ranks built different plans (fingerprint -> group ranks: {who}); "
            "check that every rank of each side passes the same layouts; nothing was moved")
