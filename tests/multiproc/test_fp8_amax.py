"""FP8 block quantization across real processes: 4 gloo ranks each build only their own
shards of a set of tensors (FSDP2 row shards of random sizes, TP column splits, an
FSDP x TP mesh, the q, k and v of a Megatron fused QKV interleaved by query group),
exchange the amax of the blocks split across them in one ``all_reduce(MAX)`` of just
those blocks' floats, and quantize their rows; the parent puts the shards together and
checks them bit for bit against the reference quantizer on the full tensors, which no
rank ever builds. The layouts are drawn in the parent from a fixed seed."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import reshard as R
from reshard.layout import box_slices
from reshard.quant import BlockFormat, plan_fp8, quantize_reference
from reshard.quant.fp8 import Fp8Shard, assemble
from reshard.refit.amax import quantize_on_rank
from reshard.tools.launch import run_processes

pytestmark = pytest.mark.multiproc

WORLD = 4
SEED = 20261202


def values(offset, size, seed, dtype):
    """Element (i, j) of tensor ``seed``, from integer hashing of its global index (so a
    rank makes its box alone, the parent the whole, bit for bit the same): magnitudes
    over 2**-12..2**12 by row, zero blocks of 8 x 8 here and there."""
    i = torch.arange(offset[0], offset[0] + size[0], dtype=torch.int64)[:, None]
    j = torch.arange(offset[1], offset[1] + size[1], dtype=torch.int64)[None, :]
    h = (i * 1000003 + j * 7919 + seed * 104729) % 2147483647
    h = (h * 1103515245 + 12345) % 2147483648
    v = ((h % 20001) - 10000).double() / 10000 * 2.0 ** ((i * 7 + seed) % 25 - 12).double()
    zero = ((i // 8) * 3 + (j // 8) + seed) % 7 == 0
    return torch.where(zero, 0.0, v).to(dtype)


def rows(cuts, ncols, dtype):
    return R.Layout.explicit((cuts[-1], ncols), {
        i: ((b - a, ncols), [((a, 0), (b - a, ncols), (0, 0))])
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}, dtype)


def cols(nrows, cuts, dtype):
    return R.Layout.explicit((nrows, cuts[-1]), {
        i: ((nrows, b - a), [((0, a), (nrows, b - a), (0, 0))])
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}, dtype)


def megatron(part, groups, q_rows, kv_rows, hidden, dtype):
    """q, k or v of Megatron's fused QKV over TP = 4: each rank's local tensor is its
    query groups' [q, k, v] rows one group after the other."""
    rows_of = {"q": q_rows, "k": kv_rows, "v": kv_rows}[part]
    before = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[part]
    per, fused = groups // WORLD, q_rows + 2 * kv_rows
    views = {t: ((per * fused, hidden), [
        ((g * rows_of, 0), (rows_of, hidden), ((g - t * per) * fused + before, 0))
        for g in range(t * per, (t + 1) * per)]) for t in range(WORLD)}
    return R.Layout.explicit((groups * rows_of, hidden), views, dtype)


def draw_cases(seed):
    """name -> (layout, values seed): random shapes and cuts, blocks of 8 x 8."""
    rng = random.Random(seed)
    out = {}
    for k in range(4):
        m, n = rng.randint(20, 70), rng.randint(9, 40)
        cuts = sorted(rng.sample(range(1, m), WORLD - 1))
        out[f"fsdp{k}"] = rows([0, *cuts, m], n, rng.choice(["bfloat16", "float32"]))
    out["three"] = rows([0, 3, 5, 6, 20], 12, "bfloat16")  # block row 0 on four sources
    n = rng.randint(20, 60)
    out["tp_cols"] = cols(rng.randint(5, 30), [0, *sorted(rng.sample(range(1, n), 3)), n],
                          "bfloat16")
    mesh = R.Mesh([[0, 1], [2, 3]])
    out["fsdp_tp"] = R.Layout((rng.randint(9, 50), rng.randint(9, 50)), mesh,
                              [R.Shard(0), R.Shard(1)], "bfloat16")
    for part in "qkv":
        out[f"qkv_{part}"] = megatron(part, 8, 6, 3, 20, "bfloat16")
    return {name: (lay, 100 + i) for i, (name, lay) in enumerate(out.items())}


def _local(layout, rank, seed):
    view = layout.view(rank)
    dtype = getattr(torch, layout.dtype)
    local = torch.zeros(view.local_shape, dtype=dtype)
    for p in view.pieces:
        local[box_slices(p.local_offset, p.size)] = values(p.offset, p.size, seed, dtype)
    return local


def _rank(rank, _world, cases, fmt):
    layouts = {name: lay for name, (lay, _) in cases.items()}
    locals_ = {name: _local(lay, rank, seed) for name, (lay, seed) in cases.items()
               if rank in lay.rank_set}
    calls = []
    reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):  # the real collective, counted
        calls.append(tensor.numel())
        return reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    shards = quantize_on_rank(plan_fp8(layouts, fmt), layouts, locals_, rank)
    held = {n: sum(p.numel for p in layouts[n].view(rank).pieces) for n in locals_}
    return {"calls": calls, "held": held, "shards": {  # numpy: plain pickles to the parent
        n: (s.qdata.view(torch.uint8).numpy(), [(b, x.numpy()) for b, x in s.scales])
        for n, s in shards.items()}}


def _shards(results, name):
    return {r: Fp8Shard(torch.from_numpy(res["shards"][name][0]).view(torch.float8_e4m3fn),
                        tuple((b, torch.from_numpy(x)) for b, x in res["shards"][name][1]))
            for r, res in enumerate(results) if name in res["shards"]}


@pytest.mark.parametrize("ue8m0", [False, True], ids=["plain", "ue8m0"])
def test_shards_across_processes_are_bit_identical_to_the_reference(ue8m0):
    cases = draw_cases(SEED)
    fmt = BlockFormat((8, 8), ue8m0)
    plan = plan_fp8({n: lay for n, (lay, _) in cases.items()}, fmt)
    results = run_processes(_rank, WORLD, cases, fmt, timeout=120)
    assert plan.num_shared > 0
    assert max(len(s.ranks) for t in plan.tensors for s in t.shared) == 4
    assert all(r["calls"] == [plan.num_shared] for r in results)  # one reduce, shared only
    for name, (lay, seed) in cases.items():
        full = values((0, 0), lay.shape, seed, getattr(torch, lay.dtype))
        assert all(r["held"].get(name, 0) < full.numel() for r in results), name
        q, scale = assemble(_shards(results, name), lay, plan[name])
        q_ref, scale_ref = quantize_reference(full, fmt)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), name
        assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32)), name


def test_no_shared_block_no_collective():
    aligned = {"w": (rows([0, 128, 256, 384, 400], 300, "bfloat16"), 1),
               "o": (R.Layout((256, 512), R.Mesh([0, 1, 2, 3]), [R.Shard(1)], "bfloat16"), 2)}
    fmt = BlockFormat()
    results = run_processes(_rank, WORLD, aligned, fmt, timeout=120)
    assert all(r["calls"] == [] for r in results)
    for name, (lay, seed) in aligned.items():
        q, _ = assemble(_shards(results, name), lay, plan_fp8(lay, fmt).tensors[0])
        q_ref, _ = quantize_reference(values((0, 0), lay.shape, seed, torch.bfloat16), fmt)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), name
