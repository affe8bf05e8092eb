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


def test_copy_regions_moves_every_bit_in_words_and_casts_the_rest():
    """A message's regions copied together: same-dtype pairs as 8-byte words where the
    geometry allows (strided bf16 columns, NaN payloads kept), small contiguous ones in
    one batch, an odd start, a cast and a region too narrow for words element by
    element, nothing outside the regions touched."""
    from reshard._transport.views import _words, copy_regions

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**15, 2**15, (64, 96), generator=g, dtype=torch.int16)
    src = bits.view(torch.bfloat16)  # every bit pattern, NaNs with payloads included
    dst = torch.zeros(64, 192, dtype=torch.bfloat16)
    cols = dst[:, 8:104]  # strided: row stride 192, start 8 elements in
    odd = torch.zeros(70, dtype=torch.bfloat16)[1:65]  # a start no word can take
    narrow = torch.zeros(64, 6, dtype=torch.bfloat16)[:, 1:4]  # 3 elements a row
    cast = torch.zeros(64, 96, dtype=torch.float32)
    assert _words(cols) is not None and _words(odd) is None and _words(narrow) is None
    rows = torch.zeros(8, 96, dtype=torch.bfloat16)
    pair = [rows[1:3], rows[5:6]]  # contiguous, in words: one batch of two
    copy_regions([cols, odd, narrow, cast, *pair],
                 [src, src[0, :64], src[:, :3], src, src[10:12], src[20:21]])
    assert torch.equal(rows[1:3].view(torch.int16), bits[10:12])
    assert torch.equal(rows[5].view(torch.int16), bits[20])
    assert rows[[0, 3, 4, 6, 7]].eq(0).all()
    assert torch.equal(cols.view(torch.int16), bits)
    assert torch.equal(odd.view(torch.int16), bits[0, :64])
    assert torch.equal(narrow.contiguous().view(torch.int16), bits[:, :3])
    finite = ~src.isnan()
    assert torch.equal(cast[finite], src.float()[finite])
    assert dst[:, :8].eq(0).all() and dst[:, 104:].eq(0).all()  # nothing outside
