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


def _freed_then_reallocated(rank: int, world: int) -> list[bool]:
    """Every refit the trainer frees its weights before it makes new ones: the new
    storage's fd number and address are those of the freed one, which must not pass
    for it (a reader would keep reading the freed copy)."""
    plan = R.plan({"w": SRC}, {"w": DST})
    ex = Executor(plan, method="colocated")
    _, dst = _locals(rank, FULL)
    exact = []
    for step in range(3):
        src, _ = _locals(rank, FULL + step)  # the only reference to this step's source
        ex.run(src, dst)
        del src
        exact.append(not dst or torch.equal(dst["w"], DST.shard(FULL + step, rank)))
    return exact


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


def test_a_freed_storage_never_passes_for_the_next_one_at_its_fd_and_address():
    results = run_processes(_freed_then_reallocated, 4, timeout=120)
    assert results == [[True] * 3] * 4, results


def test_a_rank_on_another_machine_is_refused_on_every_rank():
    errors = run_processes(_other_machine, 4, timeout=120)
    assert all(e and "needs every rank on one machine" in e for e in errors), errors


def _trainer_dies(rank: int, world: int, port: int) -> dict:
    """Refit 1 lands; during refit 2 the trainer process dies after exporting (while the
    engine ranks read its memory): they raise TransferError and keep version 1."""
    import os
    from datetime import timedelta

    from reshard._transport.shm import SharedMemoryRunner
    from reshard.refit import RefitReceiver, RefitSender

    full = {"w": FULL.clone()}
    lay_src = {"w": R.Layout((12, 10), R.Mesh([0]), [R.Replicate()])}
    lay_dst = {"w": R.Layout((12, 10), R.Mesh([0, 1]), [R.Shard(1)])}
    common = dict(host="127.0.0.1", port=port, trainer_size=1, inference_size=2,
                  refit_timeout=timedelta(seconds=20))
    if rank == 0:
        side = RefitSender(full, layouts=lay_src, rank=0, policy={"w": "colocated"}, **common)
        side.refit(1)
        full["w"].mul_(2)

        def die(self, src, dst):
            os._exit(0)

        SharedMemoryRunner._copy = die  # the trainer exits once the readers hold its export
        side.refit(2)
        return {}
    target = {"w": torch.zeros(lay_dst["w"].local_shape(rank - 1))}
    side = RefitReceiver(target, lay_dst, rank=rank - 1, **common)
    side.refit()
    first = torch.equal(target["w"], lay_dst["w"].shard(FULL, rank - 1))
    try:
        side.refit()
        error = None
    except R.TransferError as e:
        error = str(e)
    kept = torch.equal(target["w"], lay_dst["w"].shard(FULL, rank - 1))
    return {"first": first, "error": error, "kept": kept, "version": side.version}


def _report(queue, rank: int, port: int) -> None:
    torch.set_num_threads(1)
    try:
        queue.put((rank, _trainer_dies(rank, 3, port)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"raised": repr(e)}))


def test_trainer_dying_while_the_engine_reads_keeps_the_previous_version():
    import multiprocessing as mp

    from reshard.tools.launch import free_port

    ctx, port = mp.get_context("fork"), free_port()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(queue, r, port), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in range(2))  # the engine ranks
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert sorted(results) == [1, 2], results
    for res in results.values():
        assert res["first"] and res["error"] and res["kept"] and res["version"] == 1, res
