"""Property tests: any pair of layouts, planned and carried out locally, gives every
destination rank exactly ``dst.shard(global, rank)``."""

from __future__ import annotations

from math import prod

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R


@st.composite
def layouts(draw, shape, first_rank=0, max_ranks=64):
    ndim = len(shape)
    mesh_ndim = draw(st.integers(1, 4))
    mesh_shape = []
    for _ in range(mesh_ndim):
        cap = max_ranks // max(prod(mesh_shape), 1)
        mesh_shape.append(draw(st.integers(1, max(1, min(4, cap)))))
    placements = []
    for _ in mesh_shape:
        kinds = ["R"] + (["S", "SS"] if ndim else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "R":
            placements.append(R.Replicate())
        elif kind == "S":
            placements.append(R.Shard(draw(st.integers(0, ndim - 1))))
        else:
            placements.append(R.StridedShard(draw(st.integers(0, ndim - 1)),
                                             draw(st.integers(1, 3))))
    mesh = R.Mesh.from_shape(mesh_shape, start=first_rank)
    return R.Layout(shape, mesh, placements, dtype="int64")


@st.composite
def layout_pairs(draw):
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=0, max_size=5)))
    while prod(shape) > 6000:
        shape = shape[:-1]
    src = draw(layouts(shape))
    overlap = draw(st.sampled_from(["disjoint", "overlap", "identical"]))
    if overlap == "identical":
        first = 0
    elif overlap == "overlap":
        first = draw(st.integers(1, max(1, len(src.ranks) - 1)))
    else:
        first = len(src.ranks)
    dst = draw(layouts(shape, first_rank=first))
    return src, dst


def _global(shape):
    return torch.arange(prod(shape), dtype=torch.int64).reshape(shape)


def _check(src: R.Layout, dst: R.Layout) -> R.Plan:
    p = R.plan(src, dst)
    g = _global(src.shape)
    out = R.execute_local(p, {r: src.shard(g, r) for r in src.ranks})
    for r in dst.ranks:
        expected = dst.shard(g, r)
        assert out[r].shape == expected.shape
        assert torch.equal(out[r], expected), (src, dst, r)
    return p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_random_layouts_reshard_exactly(pair):
    src, dst = pair
    p = _check(src, dst)
    s = p.stats()
    # every destination element is written exactly once: bytes in == dst shares
    assert s.bytes_sent + s.bytes_local == s.dst_bytes
    assert s.max_send_bytes >= s.send_lower_bound
    for rank in set(src.ranks) | set(dst.ranks):
        assert all(rank in (t.src_rank, t.dst_rank) for t in p.transfers(rank))


@settings(max_examples=150, deadline=None)
@given(layout_pairs())
def test_each_destination_element_written_once(pair):
    src, dst = pair
    p = R.plan(src, dst)
    for r in dst.ranks:
        hits = torch.zeros(dst.local_shape(r), dtype=torch.int32)
        for t in p.transfers(r):
            if t.dst_rank == r:
                hits[tuple(slice(o, o + n) for o, n in zip(t.dst_offset, t.size))] += 1
        assert bool((hits == 1).all())


def test_brief_example_row_to_column():
    src = R.Layout((8, 8), R.Mesh([0, 1]), [R.Shard(0)])
    dst = R.Layout((8, 8), R.Mesh([2, 3, 4, 5]), [R.Shard(1)])
    p = _check(src, dst)
    sizes = {t.size for t in p.transfers()}
    assert sizes == {(4, 2)}
    assert p.stats().bytes_sent == 64 * 4
    assert max(t.nbytes for t in p.transfers()) == 4 * 2 * 4


def test_local_regions_are_copies_not_messages():
    src = R.Layout((8, 4), R.Mesh([0, 1]), [R.Shard(0)])
    dst = R.Layout((8, 4), R.Mesh([0, 1]), [R.Replicate()])
    p = _check(src, dst)
    s = p.stats()
    assert s.bytes_local == 8 * 4 * 4  # each rank keeps its own half
    assert s.bytes_sent == 8 * 4 * 4  # and receives the other half
    assert all(t.is_local == (t.src_rank == t.dst_rank) for t in p.transfers())


def test_replicated_sources_share_the_send_load():
    # 4 replicas of the source, 8 destination shards: each replica sends 2 shards
    src = R.Layout((64, 8), R.Mesh([0, 1, 2, 3]), [R.Replicate()])
    dst = R.Layout((64, 8), R.Mesh(list(range(10, 18))), [R.Shard(0)])
    p = _check(src, dst)
    s = p.stats()
    assert s.max_send_bytes == s.send_lower_bound == 64 * 8 * 4 // 4


def test_plan_is_deterministic():
    src = R.Layout((30, 7), R.Mesh([[0, 1], [2, 3]]), [R.Replicate(), R.Shard(0)])
    dst = R.Layout((30, 7), R.Mesh([4, 5, 6]), [R.Shard(1)])
    assert R.plan(src, dst).fingerprint() == R.plan(src, dst).fingerprint()
    other = R.Layout((30, 7), R.Mesh([4, 5, 6]), [R.Shard(0)])
    assert R.plan(src, dst).fingerprint() != R.plan(src, other).fingerprint()
