"""The colocated transport (ranks on one machine read each other's tensors in place):
a source whose storage moves between runs is exported again and read from its new
place (never from the freed one); a rank on another machine is refused on every rank;
the sources' storage is moved into shared memory in place (their tensors and every
view of them stay valid and keep their values)."""

from __future__ import annotations

import pytest
import torch

import reshard as R
from reshard.executor import Executor
from reshard.tools.launch import run_processes

pytestmark = pytest.mark.multiproc

SRC = R.Layout((12, 10), R.Mesh([0, 1]), [R.Shard(0)])
DST = R.Layout((12, 10), R.Mesh([2, 3]), [R.Shard(1)])
FULL = torch.arange(120.0).reshape(12, 10)


def _locals(rank: int, full: torch.Tensor):
    src = {"w": SRC.shard(full, rank).clone()} if rank in SRC.rank_set else {}
    dst = {"w": torch.zeros(DST.local_shape(rank))} if rank in DST.rank_set else {}
    return src, dst


def _moves(rank: int, world: int) -> dict:
    plan = R.plan({"w": SRC}, {"w": DST})
    ex = Executor(plan, method="colocated")
    src, dst = _locals(rank, FULL)
    view = src["w"][:2] if src else None  # a view of the source, taken before the export
    ex.run(src, dst)
    first = not dst or torch.equal(dst["w"], DST.shard(FULL, rank))
    shared = not src or (src["w"].is_shared() and bool((view == src["w"][:2]).all()))
    # the trainer reallocates (a new storage with new values) and frees the old one
    src2, _ = _locals(rank, FULL * 2 + 1)
    src.clear()
    src.update(src2)
    ex.run(src, dst)
    second = not dst or torch.equal(dst["w"], DST.shard(FULL * 2 + 1, rank))
    return {"first": first, "shared": shared, "second": second,
            "exports": ex._runner.exports}


def _other_machine(rank: int, world: int) -> str | None:
    import reshard._transport.shm as shm

    if rank == 3:  # isolate the unit: this rank says it is elsewhere
        shm.machine_id = lambda: "elsewhere"
    src, dst = _locals(rank, FULL)
    try:
        Executor(R.plan({"w": SRC}, {"w": DST}), method="colocated").run(src, dst)
    except R.TransferError as e:
        return str(e)
    return None


def test_moved_storage_is_exported_again_and_read_from_its_new_place():
    results = run_processes(_moves, 4, timeout=120)
    for rank, res in enumerate(results):
        assert res["first"] and res["shared"] and res["second"], (rank, res)
    assert [r["exports"] for r in results] == [2, 2, 0, 0]


def test_a_rank_on_another_machine_is_refused_on_every_rank():
    errors = run_processes(_other_machine, 4, timeout=120)
    assert all(e and "needs every rank on one machine" in e for e in errors), errors
