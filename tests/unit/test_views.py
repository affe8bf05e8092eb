"""Region views: their geometry is kept across runs while the same tensors come back,
rebuilt when the tensors change, and no view of a caller's tensor outlives a run."""

from __future__ import annotations

import gc
import weakref

import torch

import reshard as R
from reshard.executor import Executor

from ._inproc import run_ranks

# 1 MiB regions: each is contiguous on one side only, so both the unpacked paths
# (straight from the source, straight into the destination) and packing are used
SRC = {"w": R.Layout((1024, 1024), R.Mesh([0, 1]), [R.Shard(0)]),
       "o": R.Layout((1024, 1024), R.Mesh([0, 1]), [R.Shard(1)]),
       "n": R.Layout((48,), R.Mesh([0, 1]), [R.Replicate()])}
DST = {"w": R.Layout((1024, 1024), R.Mesh([2, 3]), [R.Shard(1)]),
       "o": R.Layout((1024, 1024), R.Mesh([2, 3]), [R.Shard(0)]),
       "n": R.Layout((48,), R.Mesh([2, 3]), [R.Replicate()])}
PLAN = R.plan(SRC, DST)


def _full(step: int) -> dict[str, torch.Tensor]:
    return {n: torch.arange(float(lay.numel)).view(lay.shape) + 1000 * step
            for n, lay in SRC.items()}


def _transposed_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, other strides (column-major memory)."""
    return t.t().contiguous().t() if t.dim() == 2 else t.clone()


def test_same_tensors_reuse_new_layouts_rebuild_and_nothing_is_kept():
    def rank_fn(comm):
        r = comm.rank
        ex = Executor(PLAN, comm, method="p2p")
        src = {n: lay.shard(_full(0)[n], r) for n, lay in SRC.items() if r in lay.rank_set}
        dst = {n: torch.zeros(lay.local_shape(r)) for n, lay in DST.items()
               if r in lay.rank_set}
        ok, direct = [], []
        for step in range(3):  # same tensor objects, new values each step
            for n, t in src.items():
                t.copy_(SRC[n].shard(_full(step)[n], r))
            direct.append(ex.run(src, dst).direct_messages)
            ok.append(all(torch.equal(dst[n], DST[n].shard(_full(step)[n], r)) for n in dst))
        # other tensors, other strides: the kept geometry must not be used for them
        src = {n: _transposed_like(SRC[n].shard(_full(3)[n], r)) for n in src}
        dst = {n: _transposed_like(t) for n, t in dst.items()}
        ex.run(src, dst)
        ok.append(all(torch.equal(dst[n], DST[n].shard(_full(3)[n], r)) for n in dst))
        refs = [weakref.ref(t) for t in [*src.values(), *dst.values()]]
        storages = [weakref.ref(t.untyped_storage()) for t in [*src.values(), *dst.values()]]
        del src, dst
        gc.collect()
        kept = sum(ref() is not None for ref in refs + storages)
        return ok, kept, direct

    for ok, (exact, kept, direct) in run_ranks(4, rank_fn):
        assert ok and all(exact), exact
        assert min(direct) > 0, direct  # the unpacked paths were taken, every time
        assert kept == 0, f"{kept} of the caller's tensors are still alive after the run"
