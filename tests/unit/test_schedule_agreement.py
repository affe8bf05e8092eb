"""Every rank of a transfer must schedule the plan alike: ranks whose method, staging
budget or fast domains differ would pair the wrong messages (or, on NCCL, wait
forever). The executor refuses on every rank before any byte moves, naming the
setting that differs; topology detection refuses a bad or differing environment
setting on every rank. Shown on in-process thread ranks (``_inproc``)."""

from __future__ import annotations

import re

import pytest
import torch

import reshard as R
from reshard.executor import Executor, schedule_disagreement
from reshard.topology import Topology

from ._inproc import run_ranks

SRC = {f"w{i}": R.Layout((32, 16), R.Mesh([0, 1]), [R.Shard(i % 2)]) for i in range(3)}
DST = {f"w{i}": R.Layout((32, 16), R.Mesh([2, 3]), [R.Shard((i + 1) % 2)]) for i in range(3)}
PLAN = R.plan(SRC, DST)
FULL = {n: torch.randn(32, 16) for n in SRC}


def _tensors(rank: int):
    src = {n: SRC[n].shard(FULL[n], rank) for n in SRC} if rank < 2 else {}
    dst = {n: torch.full(DST[n].local_shape(rank), -1.0) for n in DST} if rank >= 2 else {}
    return src, dst


def _run(options_of_rank):
    tensors = {r: _tensors(r) for r in range(4)}

    def rank_fn(comm):
        ex = Executor(PLAN, comm, **options_of_rank(comm.rank))
        return ex.run(*tensors[comm.rank])

    return run_ranks(4, rank_fn), tensors


def _refused_everywhere(results, tensors, pattern):
    for ok, err in results:
        assert not ok and isinstance(err, R.FingerprintMismatchError), err
        assert re.search(pattern, str(err)), str(err)
        assert str(err).endswith("nothing was moved")
    for r, (_, dst) in tensors.items():
        assert all(bool((t == -1.0).all()) for t in dst.values()), f"rank {r} was written"


TWO = Topology(domain_size=2)


def test_same_settings_move_bit_exact():
    results, tensors = _run(lambda r: dict(method="reshard", budget_bytes=1024, topology=TWO))
    assert all(ok for ok, _ in results), results
    for r in (2, 3):
        for n, t in tensors[r][1].items():
            assert torch.equal(t, DST[n].shard(FULL[n], r))


def test_differing_budget_refused_on_every_rank():
    results, tensors = _run(lambda r: dict(method="p2p",
                                           budget_bytes=1024 if r == 0 else 1 << 20))
    _refused_everywhere(results, tensors,
                        r"budget_bytes differ \(1024 on ranks 0; 1048576 on ranks 1-3\)")


def test_differing_method_refused_on_every_rank():
    results, tensors = _run(lambda r: dict(method="p2p" if r == 3 else "reshard",
                                           topology=TWO))
    _refused_everywhere(results, tensors, r"method differ \(reshard on ranks 0-2; p2p on ranks 3\)")


def test_differing_domains_refused_on_every_rank():
    other = Topology(domains={0: 0, 1: 1, 2: 0, 3: 1})
    results, tensors = _run(lambda r: dict(method="reshard", budget_bytes=1024,
                                           topology=other if r == 1 else TWO))
    _refused_everywhere(results, tensors,
                        r"fast domains of ranks 0-3 differ \(0,0,1,1 on ranks 0,2-3; "
                        r"0,1,0,1 on ranks 1\)")


def test_schedule_disagreement_is_none_when_alike():
    key = (("method", "p2p"), ("budget_bytes", "1024"))
    assert schedule_disagreement([(0, key), (1, key)]) is None


def _detect(envs):
    return run_ranks(len(envs), lambda c: Topology.detect(c, key=lambda: "host",
                                                          env=envs[c.rank]))


def test_detect_groups_by_host_and_takes_an_agreed_override():
    out = _detect([{}] * 4)
    assert all(ok for ok, _ in out) and {t.domain(r) for _, t in out for r in range(4)} == {0}
    out = _detect([{"RESHARD_DOMAIN_SIZE": "2"}] * 4)
    assert all(ok and [t.domain(r) for r in range(4)] == [0, 0, 1, 1] for ok, t in out), out
    out = _detect([{"RESHARD_DOMAINS": "1,0,1,0"}] * 4)
    assert all(ok and [t.domain(r) for r in range(4)] == [1, 0, 1, 0] for ok, t in out), out


@pytest.mark.parametrize("envs, pattern", [
    # one rank has the override and the others do not: without the check those ranks
    # would skip the collective the others wait in
    ([{"RESHARD_DOMAIN_SIZE": "2"}, {}, {}, {}],
     r"settings differ \(RESHARD_DOMAIN_SIZE=2 on ranks \[0\]; no setting on ranks "
     r"\[1, 2, 3\]\)"),
    ([{"RESHARD_DOMAINS": "0,0,1"}] * 4,
     r"rank 0: RESHARD_DOMAINS names the domains of 3 ranks, but the group has 4"),
    ([{}, {}, {"RESHARD_DOMAIN_SIZE": "eight"}, {}],
     r"rank 2: RESHARD_DOMAIN_SIZE='eight': expected a positive integer"),
    ([{"RESHARD_DOMAIN_SIZE": "0"}] * 4, r"RESHARD_DOMAIN_SIZE='0': expected a positive"),
    ([{"RESHARD_DOMAINS": "0,a,1,1"}] * 4, r"RESHARD_DOMAINS='0,a,1,1': expected the domain"),
    ([{"RESHARD_DOMAINS": "0,0,1,1", "RESHARD_DOMAIN_SIZE": "2"}] * 4,
     r"both RESHARD_DOMAINS='0,0,1,1' and RESHARD_DOMAIN_SIZE='2' are set"),
])
def test_detect_refuses_bad_or_differing_settings_on_every_rank(envs, pattern):
    out = _detect(envs)
    for ok, err in out:
        assert not ok and isinstance(err, R.LayoutError), err
        assert re.search(pattern, str(err)), str(err)


def _side(comm, *, method=None, budget=1 << 20, policy=None):
    """A refit side on thread ranks: rank 0 the trainer, the others receivers."""
    from datetime import timedelta

    from reshard.refit import RefitReceiver, RefitSender
    from reshard.refit.rendezvous import Meeting
    from reshard.refit.side import Side

    rank = comm.rank
    meeting = Meeting(comm, PLAN, rank, "trainer" if rank < 2 else "inference",
                      0 if rank < 2 else 2)
    side = (RefitSender if rank < 2 else RefitReceiver).__new__(
        RefitSender if rank < 2 else RefitReceiver)
    if method is not None:
        side.method = method  # as reshard.refit.elastic's sides carry one
    Side.__init__(side, meeting, policy=policy if rank < 2 else None, budget_bytes=budget,
                   progress=False, refit_timeout=timedelta(seconds=10))
    return side


def test_refit_sides_agree_on_the_smallest_budget_and_the_trainers_policy():
    policy = {"w1": "p2p"}
    out = run_ranks(4, lambda c: _side(c, budget=(1 << 20) if c.rank else 4096,
                                       policy=policy))
    assert all(ok for ok, _ in out), out
    for _, side in out:
        assert side.budget_bytes == 4096 and side.policy == policy
        assert sorted(ex.method for ex in side.executors) == ["p2p", "reshard"]


@pytest.mark.parametrize("opts, pattern", [
    (lambda r: dict(method="p2p" if r == 3 else "reshard"),
     r"disagree on the method: \['reshard', 'reshard', 'reshard', 'p2p'\]"),
    (lambda r: dict(policy={"w1": "p2p"} if r == 0 else {"w1": "reshard"}),
     r"the trainer ranks give different policies"),
    (lambda r: dict(policy={"nope": "p2p"}), r"rank 0: the policy names parameters that are "
                                             r"not in the plan: \['nope'\]"),
    (lambda r: dict(policy={"w1": "carrier-pigeon"}), r"unknown methods \['carrier-pigeon'\]"),
])
def test_refit_sides_refuse_what_they_cannot_agree_on(opts, pattern):
    out = run_ranks(4, lambda c: _side(c, **opts(c.rank)))
    for ok, err in out:
        assert not ok and isinstance(err, R.ReshardError), err
        assert re.search(pattern, str(err)), str(err)
        assert str(err).endswith("nothing was moved")
