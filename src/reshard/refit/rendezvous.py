"""Two separately launched jobs (a trainer job and an inference job) meet at a TCP store.

Each side describes its own parameters with layouts over its own ranks (0..n-1). At the
meeting, the sides join one stateless process group (trainer ranks first, inference
ranks after them: the rank offset), exchange their layouts through the store, and every
rank builds the same plan. A plan fingerprint is compared on every rank before any
weight moves; if any rank disagrees, every rank raises ``FingerprintMismatchError``.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from reshard.comm import Comm
from reshard.errors import FingerprintMismatchError, PlanError
from reshard.layout import Layout
from reshard.planner import Plan, plan

__all__ = ["Meeting", "meet"]

SIDES = ("trainer", "inference")


@dataclass
class Meeting:
    """What a rank gets from :func:`meet`: the shared group, the plan, its group rank."""

    comm: Comm
    plan: Plan
    rank: int
    side: str
    offset: int


def meet(host: str, port: int, *, side: str, side_rank: int, trainer_size: int,
         inference_size: int, layouts: Mapping[str, Layout], backend: str = "gloo",
         allow_cast: bool = True, timeout: timedelta = timedelta(minutes=5)) -> Meeting:
    """Join the weight-update group and agree on a plan; collective over both jobs.

    ``layouts`` use this side's own rank numbers; the trainer's rank 0 hosts the store.
    """
    if side not in SIDES:
        raise PlanError(f"side must be one of {SIDES}, got {side!r}")
    if trainer_size < 1 or inference_size < 1:
        raise PlanError(f"trainer_size and inference_size must be >= 1, got {trainer_size} "
                        f"and {inference_size}")
    size = trainer_size if side == "trainer" else inference_size
    if not 0 <= side_rank < size:
        raise PlanError(f"side_rank must be in [0, {size}) for the {side}, got {side_rank}")
    offset = 0 if side == "trainer" else trainer_size
    rank = side_rank + offset
    world = trainer_size + inference_size
    store = Comm.open_store(host, port, rank, world, timeout=timeout)
    _agree_on_sizes(store, side, side_rank, (trainer_size, inference_size, backend), timeout)
    comm = Comm.from_existing_store(store, rank, world, backend=backend, timeout=timeout)
    mine = {name: lay.shifted(offset) for name, lay in layouts.items()}
    if side_rank == 0:
        comm.store.set(f"reshard/layouts/{side}", pickle.dumps(mine))
    other = "inference" if side == "trainer" else "trainer"
    comm.store.wait([f"reshard/layouts/{other}"], timeout)
    theirs = pickle.loads(comm.store.get(f"reshard/layouts/{other}"))
    src, dst = (mine, theirs) if side == "trainer" else (theirs, mine)
    try:
        the_plan = plan(src, dst, allow_cast=allow_cast)
        fingerprint, problem = the_plan.fingerprint(), None
    except PlanError as e:
        the_plan, fingerprint, problem = None, None, str(e)
    views = comm.all_gather_object((rank, fingerprint, problem))
    _agree(views)
    assert the_plan is not None
    return Meeting(comm, the_plan, rank, side, offset)


def _agree_on_sizes(store, side: str, side_rank: int, mine: tuple[int, int, str],
                    timeout: timedelta) -> None:
    """Before the group forms: both jobs must give the same sizes and backend, or the
    group would wait for ranks that never come. Each side's rank 0 publishes what its
    job was given; every rank compares both with its own and raises ``PlanError`` at
    once. The store's host (trainer rank 0) waits, within ``timeout``, until every rank
    that will come has read, so no rank loses the store before it learns why."""
    if side_rank == 0:
        store.set(f"reshard/setup/{side}", pickle.dumps(mine))
    keys = [f"reshard/setup/{s}" for s in SIDES]
    store.wait(keys, timeout)
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


def _agree(views: list[tuple[int, str | None, str | None]]) -> None:
    problems = [(r, p) for r, _, p in views if p]
    if problems:
        r, p = problems[0]
        raise PlanError(f"rank {r} could not plan: {p}; nothing was moved")
    prints = {fp for _, fp, _ in views}
    if len(prints) > 1:
        who = {fp: [r for r, f, _ in views if f == fp] for fp in prints}
        raise FingerprintMismatchError(
            f"the two jobs' ranks built different plans (fingerprint -> group ranks: {who}); "
            "check that every rank of each side passes the same layouts; nothing was moved")
