"""Backends that match messages only in posting order (NCCL ignores tags).

Gloo matches a pair's messages by tag, so the executor posts the unpacked messages of
every round up front and the packed ones round by round. Under order-only matching
that would pair the wrong messages: one end may send a region unpacked (contiguous at
the source) while the other unpacks it (strided at the destination), and their posting
orders then differ. For such backends the executor posts each round whole, in round
order, sends and receives in one group call.

Shown on in-process thread ranks (``_inproc``) whose mailboxes ignore tags and give
the n-th posted receive the n-th message, as NCCL does; every layout below mixes
regions contiguous on one side only, and regions large enough to travel unpacked."""

from __future__ import annotations

import pytest
import torch

from reshard import planner
from reshard.executor import Executor
from reshard.sim.models import synthetic_model
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.synthetic import fill_local, matches
from reshard.topology import Topology

from ._inproc import run_ranks

MODEL = synthetic_model(64 << 20, hidden=1024)


def _plan(src: str, dst: str, colocated: bool):
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    first = 0 if colocated else s.world_size
    plan = planner.plan(model_layouts(MODEL.tensors, s), model_layouts(MODEL.tensors, d,
                                                                   first_rank=first))
    return plan, max(s.world_size, first + d.world_size)


def _run(plan, world, method, topology, *, by_tag, force_tagged=False, budget=8 << 20):
    def rank_fn(comm):
        r = comm.rank
        src = {t.name: fill_local(t.src, r) for t in plan.tensors if r in t.src.rank_set}
        dst = {t.name: torch.full(t.dst.local_shape(r), -1.0)
               for t in plan.tensors if r in t.dst.rank_set}
        ex = Executor(plan, comm, method=method, budget_bytes=budget, topology=topology)
        if force_tagged:
            ex._runner.ordered = False
        ex.run(src, dst)
        return all(matches(t.dst, r, dst[t.name]) for t in plan.tensors if t.name in dst)

    return run_ranks(world, rank_fn, by_tag=by_tag)


CASES = [  # src, dst, colocated (overlapping meshes: ranks exchange both ways), method
    ("tp4", "tp2,dp2", False, "p2p"),
    ("fsdp4", "tp4", False, "p2p"),
    ("tp4", "tp2,dp2", False, "reshard"),  # two domains: received once, forwarded inside
    ("tp2", "tp4", True, "p2p"),
    ("fsdp2,tp2", "tp4", True, "reshard"),
]


@pytest.mark.parametrize("src, dst, colocated, method", CASES)
def test_order_only_matching_is_exact(src, dst, colocated, method):
    plan, world = _plan(src, dst, colocated)
    topology = Topology(domain_size=4) if method == "reshard" else None
    results = _run(plan, world, method, topology, by_tag=False)
    assert all(ok and value for ok, value in results), results


def test_mailboxes_really_match_by_order():
    """The check above can fail: the tag-matched posting order, under order-only
    matching, pairs wrong messages (an error or wrong bytes on some rank)."""
    plan, world = _plan("tp4", "tp2,dp2", False)
    tagged = _run(plan, world, "p2p", None, by_tag=True, force_tagged=True)
    assert all(ok and value for ok, value in tagged), tagged
    mixed = _run(plan, world, "p2p", None, by_tag=False, force_tagged=True)
    assert not all(ok and value for ok, value in mixed)
