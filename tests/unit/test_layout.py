"""Layouts: local shapes, strided shards, explicit pieces, and errors pinned by message."""

from __future__ import annotations

import pytest
import torch

import reshard as R


def test_uneven_shards_follow_torch_chunk():
    lay = R.Layout((10, 3), R.Mesh([0, 1, 2, 3]), [R.Shard(0)])
    assert [lay.local_shape(r)[0] for r in range(4)] == [3, 3, 3, 1]
    lay = R.Layout((5,), R.Mesh(list(range(4))), [R.Shard(0)])
    # torch.chunk(5, 4) gives 2,2,1 and DTensor fills the missing chunk with an empty one
    assert [lay.local_shape(r) for r in range(4)] == [(2,), (2,), (1,), (0,)]


def test_nested_shards_left_to_right():
    lay = R.Layout((8, 4), R.Mesh([[0, 1], [2, 3]]), [R.Shard(0), R.Shard(0)])
    g = torch.arange(32).reshape(8, 4)
    assert torch.equal(lay.shard(g, 1), g[2:4])
    assert torch.equal(lay.shard(g, 2), g[4:6])


def test_strided_shard_is_fsdp_over_tp():
    # The docstring example of torch's _StridedShard: rank (dp=1, tp=0) holds rows 2-3.
    lay = R.Layout((8, 8), R.Mesh([[0, 1], [2, 3]]),
                   [R.StridedShard(0, split_factor=2), R.Shard(0)])
    g = torch.arange(64).reshape(8, 8)
    assert torch.equal(lay.shard(g, 0), g[0:2])
    assert torch.equal(lay.shard(g, 1), g[4:6])
    assert torch.equal(lay.shard(g, 2), g[2:4])
    assert torch.equal(lay.shard(g, 3), g[6:8])


def test_zero_dim_tensor_replicated():
    lay = R.Layout((), R.Mesh([0, 1]), [R.Replicate()])
    assert lay.local_shape(1) == ()
    dst = R.Layout((), R.Mesh([2]), [R.Replicate()])
    out = R.execute_local(R.plan(lay, dst), {0: torch.tensor(5), 1: torch.tensor(5)})
    assert out[2].item() == 5


def _fused_qkv(q: int, kv: int, hidden: int, tp: int, first_rank: int) -> R.Layout:
    """vLLM's qkv_proj: the global tensor is [q; k; v] and TP rank r holds [q_r; k_r; v_r]."""
    views = {}
    for r in range(tp):
        qs, ks = q // tp, kv // tp
        pieces = [((r * qs, 0), (qs, hidden), (0, 0)),
                  ((q + r * ks, 0), (ks, hidden), (qs, 0)),
                  ((q + kv + r * ks, 0), (ks, hidden), (qs + ks, 0))]
        views[first_rank + r] = ((qs + 2 * ks, hidden), pieces)
    return R.Layout.explicit((q + 2 * kv, hidden), views)


def test_explicit_fused_qkv_gets_only_its_bytes():
    q, kv, hidden = 16, 8, 4
    src = R.Layout((q + 2 * kv, hidden), R.Mesh([0, 1, 2, 3]), [R.Shard(0)])
    dst = _fused_qkv(q, kv, hidden, tp=2, first_rank=4)
    g = torch.arange((q + 2 * kv) * hidden, dtype=torch.float32).reshape(-1, hidden)
    out = R.execute_local(R.plan(src, dst), {r: src.shard(g, r) for r in src.ranks})
    expected = torch.cat([g[0:8], g[16:20], g[24:28]])
    assert torch.equal(out[4], expected)
    p = R.plan(src, dst)
    assert p.stats().max_recv_bytes == (q + 2 * kv) * hidden * 4 // 2


def test_explicit_padded_vocab_leaves_padding_alone():
    vocab, hidden = 10, 3
    views = {0: ((8, hidden), [((0, 0), (5, hidden), (0, 0))]),
             1: ((8, hidden), [((5, 0), (5, hidden), (0, 0))])}
    dst = R.Layout.explicit((vocab, hidden), views)
    assert dst.local_shape(1) == (8, hidden)
    src = R.Layout((vocab, hidden), R.Mesh([2]), [R.Replicate()])
    g = torch.arange(30.0).reshape(vocab, hidden)
    out = R.execute_local(R.plan(src, dst), {2: g})
    assert torch.equal(out[1][:5], g[5:])
    assert torch.equal(out[1][5:], torch.zeros(3, hidden))


def test_explicit_ragged_experts():
    # 5 experts stacked on dim 0 split 3 + 2 over two ranks
    views = {0: ((3, 4), [((0, 0), (3, 4), (0, 0))]), 1: ((2, 4), [((3, 0), (2, 4), (0, 0))])}
    dst = R.Layout.explicit((5, 4), views)
    src = R.Layout((5, 4), R.Mesh([2, 3]), [R.Shard(1)])
    g = torch.arange(20.0).reshape(5, 4)
    out = R.execute_local(R.plan(src, dst), {r: src.shard(g, r) for r in (2, 3)})
    assert torch.equal(out[1], g[3:])


@pytest.mark.parametrize("build, message", [
    (lambda: R.Mesh([0, 1, 1]), r"mesh has rank 1 more than once"),
    (lambda: R.Layout((4,), R.Mesh([0, 1]), [R.Shard(0), R.Shard(0)]),
     r"expected 1 placements \(one per mesh dim\), got 2"),
    (lambda: R.Layout((4,), R.Mesh([0, 1]), [R.Shard(1)]),
     r"shards tensor dim 1, but the tensor of shape \[4\] has 1 dims"),
    (lambda: R.Layout((4,), R.Mesh([[0, 1], [2]]), [R.Shard(0)]),
     r"mesh rows must all have the same shape"),
    (lambda: R.Layout((4,), R.Mesh([0]), ["Partial"]), r"expected a placement string"),
    (lambda: R.Layout.explicit((4,), {0: ((3,), [((0,), (3,), (0,))]),
                                      1: ((2,), [((2,), (2,), (0,))])}),
     r"explicit boxes overlap without being equal"),
    (lambda: R.Layout.explicit((4,), {0: ((3,), [((0,), (3,), (0,))])}),
     r"explicit boxes cover 3 of the 4 elements"),
    (lambda: R.Layout.explicit((4,), {0: ((3,), [((0,), (4,), (0,))])}),
     r"rank 0: piece at local offset \[0\] of size \[4\] lies outside its local shape \[3\]"),
    (lambda: R.Layout((4,), R.Mesh([0]), [R.Shard(0)], dtype="float13"),
     r"unsupported dtype 'float13'"),
])
def test_bad_layouts_are_refused_with_clear_errors(build, message):
    with pytest.raises(R.LayoutError, match=message):
        build()


def test_plan_refuses_mismatches_naming_the_tensor():
    a = R.Layout((4, 4), R.Mesh([0]), [R.Replicate()])
    b = R.Layout((4, 5), R.Mesh([1]), [R.Replicate()])
    c = R.Layout((4, 4), R.Mesh([1]), [R.Replicate()], dtype="bfloat16")
    with pytest.raises(R.PlanError, match=r"tensor 'w': shape mismatch, source \[4, 4\] vs "
                                          r"destination \[4, 5\]"):
        R.plan({"w": a}, {"w": b})
    with pytest.raises(R.PlanError, match=r"tensor 'w': dtype mismatch, source float32 vs "
                                          r"destination bfloat16"):
        R.plan({"w": a}, {"w": c})
    with pytest.raises(R.PlanError, match=r"only in the source: \['v'\]"):
        R.plan({"w": a, "v": a}, {"w": c})
    assert R.plan({"w": a}, {"w": c}, allow_cast=True).stats().bytes_sent == 32
    assert isinstance(R.PlanError("x"), ValueError)


def test_torch_placements_are_accepted():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    lay = R.Layout((8,), R.Mesh([[0, 1], [2, 3]]), [_StridedShard(0, split_factor=2), Shard(0)])
    assert lay.placements == (R.StridedShard(0, 2), R.Shard(0))
    assert R.Layout((8,), R.Mesh([0]), [Replicate()]).placements == (R.Replicate(),)
