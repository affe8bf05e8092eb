"""The receiver's staging cap (``staging_bytes``, what a refit's round may stage on a
receiving rank): the real executor on in-process ranks, with regions strided in the
receiver's tensors (a run of experts' rows, as an engine rank's gate or up rows of
fused experts lie in its ``w13`` buffer) and small tensors packed together. With the
cap every receiver's arena stays within it, the strided regions cut into parts that
land in place, and the result is exact; without it the receiver stages a whole round.
The schedule side (every round's staged bytes per receiver within the cap, exact over
random layouts) is checked on plans alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.errors import ConfigError
from reshard.executor import Executor
from reshard.local import execute_schedule_local
from reshard.schedule import contiguous_box, flat_schedule

from ._inproc import run_ranks
from .test_plan_properties import _global, layout_pairs

# 8 experts of 512 rows: the source ranks hold row halves of every expert, the
# destination ranks whole experts, so each source's region is strided at the receiver
# (4 experts x 256 rows of its 512: 1 MiB); one expert's part is 256 KiB, contiguous
# there
SRC = {"experts": R.Layout((8, 512, 256), R.Mesh([0, 1]), [R.Shard(1)]),
       **{f"norm{i}": R.Layout((256,), R.Mesh([0, 1]), [R.Replicate()]) for i in range(8)}}
DST = {"experts": R.Layout((8, 512, 256), R.Mesh([2, 3]), [R.Shard(0)]),
       **{f"norm{i}": R.Layout((256,), R.Mesh([2, 3]), [R.Replicate()]) for i in range(8)}}
PLAN = R.plan(SRC, DST)
CAP = 768 << 10


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    return {n: torch.randn(lay.shape, generator=g) for n, lay in SRC.items()}


@pytest.mark.parametrize("cap", [None, CAP])
def test_a_receivers_arena_stays_within_the_cap_and_the_result_is_exact(cap):
    full = _full()

    def rank_fn(comm):
        r = comm.rank
        ex = Executor(PLAN, comm, method="p2p", budget_bytes=64 << 20, staging_bytes=cap)
        src = {n: lay.shard(full[n], r) for n, lay in SRC.items() if r in lay.rank_set}
        dst = {n: torch.zeros(lay.local_shape(r)) for n, lay in DST.items()
               if r in lay.rank_set}
        stats = ex.run(src, dst)
        exact = all(torch.equal(dst[n], DST[n].shard(full[n], r)) for n in dst)
        return exact, stats.peak_staging_bytes, stats.direct_messages, len(ex.schedule.rounds)

    out = [res for ok, res in run_ranks(4, rank_fn) if ok]
    assert len(out) == 4 and all(exact for exact, *_ in out)
    arenas = [arena for _, arena, _, _ in out[2:]]  # the receivers'
    if cap is None:  # both sources' 1 MiB of strided rows staged in one round
        assert min(arenas) >= 2 << 20, arenas
    else:
        assert max(arenas) <= cap, arenas
        # the experts' parts arrived in place (the norms, packed, are the staged bytes)
        assert min(direct for _, _, direct, _ in out[2:]) >= 8, out


def test_the_cap_is_part_of_the_schedule_both_sides_check():
    def key(cap):
        return dict(Executor(PLAN, _Solo(), method="p2p", staging_bytes=cap).schedule_key())

    assert "staging_bytes" not in key(None)
    assert key(CAP)["staging_bytes"] == str(CAP)
    with pytest.raises(ConfigError, match="staging_bytes must be at least 1024"):
        key(512)


class _Solo:
    """A one-rank stand-in for a group: building a schedule needs only the rank."""

    rank, size, matches_by_tag = 0, 4, True


def _staged_per_round(schedule, plan):
    """Bytes each round lands in each receiver's arena, as the runner decides: a message
    of several hops, or of one hop not contiguous in the receiver's tensor."""
    out = []
    for hops in schedule.rounds:
        messages: dict[tuple[int, int], list] = {}
        for h in hops:
            if not h.is_local:
                messages.setdefault((h.src_rank, h.dst_rank), []).append(h)
        staged: dict[int, int] = {}
        for (_, dst), m in messages.items():
            t = plan[m[0].name]
            if len(m) > 1 or not contiguous_box(m[0].dst_offset, m[0].size,
                                                t.dst.local_shape(dst)):
                staged[dst] = staged.get(dst, 0) + sum(h.nbytes for h in m)
        out.append(staged)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(), st.sampled_from([1024, 4096]))
def test_every_round_stages_at_most_the_cap_and_the_schedule_is_exact(pair, cap):
    src, dst = pair
    plan = R.plan({"t": src}, {"t": dst})
    sched = flat_schedule(plan, 1 << 20, cap)
    for staged in _staged_per_round(sched, plan):
        assert all(v <= cap for v in staged.values()), staged
    g = _global(src.shape)
    out = execute_schedule_local(sched, plan, {r: {"t": src.shard(g, r)} for r in src.ranks})
    for r in dst.ranks:
        assert torch.equal(out[r]["t"], dst.shard(g, r))
