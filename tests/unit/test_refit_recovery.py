"""The refit API's recovery logic, on in-process thread ranks (``_inproc``): a rank whose
part of a version arrived whole but whose commit collective failed (the group broke at
the very end) is *in doubt*; ``reconnect`` makes that version live there if another rank
committed it, and drops it if nobody did. Also: a broken side refuses to refit until it
reconnects, the checksum option catches a flipped bit, and the version rule: every side
starts with none, so the trainer's step 0 goes in, and a step not newer is refused."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import reshard as R
import reshard.refit.side as refit_mod
from reshard.defaults import NO_VERSION
from reshard.refit import RefitReceiver, RefitSender
from reshard.refit.rendezvous import Meeting
from reshard.refit.side import Side
from reshard.refit.sparse import SparseRefits

from ._inproc import ThreadComm, World, run_ranks

SRC = {"w": R.Layout((8, 6), R.Mesh([0]), [R.Replicate()]),
       "b": R.Layout((6,), R.Mesh([0]), [R.Replicate()])}
DST = {"w": R.Layout((8, 6), R.Mesh([1, 2]), [R.Shard(0)]),
       "b": R.Layout((6,), R.Mesh([1, 2]), [R.Replicate()])}
PLAN = R.plan(SRC, DST)


def weights(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(48.0).view(8, 6) + 100 * version,
            "b": torch.full((6,), float(version))}


class FaultyComm(ThreadComm):
    """Raises after the commit collective completed, when told to (the group "broke"
    just as the last message arrived)."""

    fail_commit = False

    def all_gather_object(self, obj, timeout=None):
        out = super().all_gather_object(obj, timeout)
        if self.fail_commit and len(obj) == 3 and isinstance(obj[2], bool):
            self.fail_commit = False
            raise RuntimeError("injected: connection closed by peer")
        return out


def make(comm: ThreadComm, checksum=False):
    rank = comm.rank
    args = dict(side="trainer" if rank == 0 else "inference", side_rank=max(rank - 1, 0),
                trainer_size=1, inference_size=2, backend="gloo",
                timeout=timedelta(seconds=10))
    meeting = Meeting(comm, PLAN, rank, args["side"], 0 if rank == 0 else 1)
    if rank == 0:
        side = RefitSender.__new__(RefitSender)
        side.params = weights(0)
    else:
        side = RefitReceiver.__new__(RefitReceiver)
        side.targets = {n: torch.zeros(DST[n].local_shape(rank)) for n in DST}
        side.staging = "shadow"
    side._meet_args = dict(args, layouts={})
    Side.__init__(side, meeting, policy=None, budget_bytes=1 << 20, progress=False,
                   refit_timeout=timedelta(seconds=10), checksum=checksum)
    if rank:
        side.shadow = {n: t.clone() for n, t in side.targets.items()}
    return side


def refit(side, version: int):
    if isinstance(side, RefitSender):
        for n, t in weights(version).items():
            side.params[n] = t
        return side.refit(version)
    return side.refit()


def live(side) -> int | None:
    """Which version the receiver's live weights are, or None if torn/unknown."""
    for v in range(0, 10):
        if all(torch.equal(side.targets[n], DST[n].shard(weights(v)[n], side.rank))
               for n in DST):
            return v
    return None


@pytest.fixture
def sides():
    """Three thread ranks built on one world; returns (sides, a function that runs a
    step on every rank and returns per-rank (ok, value))."""
    world = World(3)
    built = run_ranks(3, lambda c: make(FaultyComm(world, c.rank)))
    assert all(ok for ok, _ in built), built
    ss = [s for _, s in built]

    def step(fn):
        return run_ranks(3, lambda c: fn(ss[c.rank]))

    return ss, step


def test_versions_are_steps_from_0_and_a_step_not_newer_is_refused_everywhere(sides):
    """A fresh side holds no version (its weights are the checkpoint's): the weights a
    trainer holds before its first step go in as version 0, and a fresh receiver's sparse
    base is none, never 0, so a sender at version 0 sends it dense. Then a repeated step
    and a negative one are refused on every rank before a byte moves."""
    ss, step = sides
    assert [s.version for s in ss] == [NO_VERSION] * 3
    assert [s.sparse_refits.view()[0] for s in ss] == [None] * 3
    assert SparseRefits.decide([(0, True, False), (None, False, False),
                                (None, False, False)]) is None  # dense
    assert all(ok for ok, _ in step(lambda s: refit(s, 0)))
    assert [s.version for s in ss] == [0, 0, 0] and [live(s) for s in ss[1:]] == [0, 0]
    assert [s.sparse_refits.view()[0] for s in ss[1:]] == [0, 0]
    for bad, message in ((0, "refit version 0 is not newer than the current version 0"),
                         (-1, "a refit version is the trainer's step, >= 0; got -1")):
        out = step(lambda s, bad=bad: refit(s, bad))
        assert all(not ok and message in str(e) for ok, e in out), out
    assert [s.version for s in ss] == [0, 0, 0] and [live(s) for s in ss[1:]] == [0, 0]
    assert all(ok for ok, _ in step(lambda s: refit(s, 1)))
    assert [live(s) for s in ss[1:]] == [1, 1]


def _reconnect_all(ss, step, monkeypatch):
    world = World(3)
    meetings = {}
    for r in range(3):
        comm = ThreadComm(world, r)
        meetings[r] = Meeting(comm, PLAN, r, "trainer" if r == 0 else "inference",
                              0 if r == 0 else 1)

    def fake_meet(host, port, **args):
        return meetings[args["side_rank"] + (args["side"] == "inference")]

    monkeypatch.setattr(refit_mod, "meet", fake_meet)
    out = step(lambda s: s.reconnect("127.0.0.1", 1))
    assert all(ok for ok, _ in out), out


def test_in_doubt_version_rolls_forward_when_another_rank_committed(sides, monkeypatch):
    ss, step = sides
    assert all(ok for ok, _ in step(lambda s: refit(s, 1)))
    ss[2].comm.fail_commit = True  # rank 2's commit breaks after everyone reported OK
    out = step(lambda s: refit(s, 2))
    assert [ok for ok, _ in out] == [True, True, False]
    assert isinstance(out[2][1], R.TransferError)
    assert ss[2].version == 1 and ss[2].pending == 2 and ss[2].broken and live(ss[2]) == 1
    assert ss[1].version == 2 and live(ss[1]) == 2  # the other TP rank went ahead: torn
    _reconnect_all(ss, step, monkeypatch)
    assert ss[2].version == 2 and live(ss[2]) == 2 and ss[2].pending is None  # made whole
    assert all(ok for ok, _ in step(lambda s: refit(s, 3)))
    assert [live(s) for s in ss[1:]] == [3, 3]


def test_in_doubt_version_dropped_when_nobody_committed(sides, monkeypatch):
    ss, step = sides
    assert all(ok for ok, _ in step(lambda s: refit(s, 1)))
    for s in ss:
        s.comm.fail_commit = True
    out = step(lambda s: refit(s, 2))
    assert not any(ok for ok, _ in out)
    assert [s.version for s in ss] == [1, 1, 1] and ss[1].pending == ss[2].pending == 2
    _reconnect_all(ss, step, monkeypatch)
    assert [s.version for s in ss] == [1, 1, 1] and [live(s) for s in ss[1:]] == [1, 1]


def test_broken_side_refuses_until_reconnected(sides, monkeypatch):
    ss, step = sides
    ss[1].broken = True
    out = step(lambda s: refit(s, 1) if s.rank == 1 else None)
    assert not out[1][0] and "reconnect" in str(out[1][1])
    _reconnect_all(ss, step, monkeypatch)
    assert all(ok for ok, _ in step(lambda s: refit(s, 1)))
    assert [live(s) for s in ss[1:]] == [1, 1]


def test_checksum_catches_a_flipped_bit_in_process():
    world = World(3)
    built = run_ranks(3, lambda c: make(ThreadComm(world, c.rank), checksum="crc32"))
    ss = [s for _, s in built]

    def flip(k, peer, buf):
        buf.view(torch.uint8)[0] ^= 1

    assert all(ok for ok, _ in run_ranks(3, lambda c: refit(ss[c.rank], 1)))
    ss[2].executors[0]._runner.on_receive = flip
    out = run_ranks(3, lambda c: refit(ss[c.rank], 2))
    assert all(not ok and isinstance(v, R.TransferError) for ok, v in out), out
    assert "checksum mismatch" in str(out[2][1])
    assert [live(s) for s in ss[1:]] == [1, 1] and not any(s.broken for s in ss)
