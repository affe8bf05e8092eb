"""A gloo collective is over only when gloo's worker thread has let go of its tensors.

Since torch 2.10 that thread's last reference to a tensor decrefs the tensor's Python
object, so it needs the GIL; a process that exits right after its last collective (the
README's ``redistribute`` example) could reach interpreter shutdown first and abort
("terminate called without an active exception"). :func:`reshard.comm.collective` waits
for the release. Here the main thread keeps the GIL (a switch interval of 100 s), which
is what makes the worker late: after every :class:`Comm` collective, no tensor it used is
still referenced from C++. For contrast each rank also counts how often a bare
``wait()`` leaves them referenced (reported, not asserted: it is a race).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from reshard.comm import Comm, collective
from reshard.tools.launch import run_processes

pytestmark = pytest.mark.multiproc

ROUNDS = 100


def _worker(rank: int, world: int) -> tuple[int, int, int]:
    comm = Comm.from_group()
    pg = dist.group.WORLD
    sys.setswitchinterval(100.0)  # the GIL changes hands only where a thread releases it
    try:
        bare = held = 0
        for i in range(ROUNDS):
            mine = torch.full((64,), float(rank + i))
            outs = [torch.empty(64) for _ in range(world)]
            pg.allgather([outs], [mine]).wait()
            bare += any(t._use_count() > 1 for t in (mine, *outs))

            mine = torch.full((64,), float(rank + i))
            outs = [torch.empty(64) for _ in range(world)]
            collective(lambda o=outs, m=mine: pg.allgather([o], [m]), [mine, *outs])
            held += any(t._use_count() > 1 for t in (mine, *outs))
            assert all(torch.equal(o, torch.full((64,), float(r + i)))
                       for r, o in enumerate(outs))

            box = torch.tensor([float(rank)])
            comm.all_reduce_max(box)
            held += box._use_count() > 1
            assert box.item() == world - 1
        assert comm.all_gather_object(rank) == list(range(world))
    finally:
        sys.setswitchinterval(0.005)
    return rank, bare, held


def test_a_collective_returns_after_gloo_lets_go_of_its_tensors():
    results = run_processes(_worker, 2, timeout=240)
    counts = {rank: (bare, held) for rank, bare, held in results}
    assert all(held == 0 for _, held in counts.values()), (
        f"tensors still referenced by gloo's worker after a Comm collective (rank: "
        f"(bare wait, Comm) over {ROUNDS} rounds): {counts}")
    print(f"bare wait() left tensors referenced in {counts} of {ROUNDS} rounds")
