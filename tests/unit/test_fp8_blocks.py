"""FP8 block quantization shard by shard: which blocks are split across sources (against
a brute-force count of who holds each element), and the shards quantized with the
exchanged amax put together bit for bit as the reference quantizer's output on the
gathered tensor. Random FSDP2 row shards of any size, TP column and row splits, 2-D
meshes with strided shards and replicas, Megatron's QKV interleaved by query group;
small blocks (4, 8) make straddling common, a few cases use 128."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.quant import BlockFormat, check_engine_split, fp8_bytes, plan_fp8
from reshard.quant.blocks import scale_layout
from reshard.quant.fp8 import assemble, quantize_reference, quantize_shards

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def rows_layout(cuts, ncols, dtype="float32"):
    """Source ``i`` holds rows ``[cuts[i], cuts[i+1])`` (an FSDP2 shard of any size)."""
    return R.Layout.explicit((cuts[-1], ncols), {
        i: ((b - a, ncols), [((a, 0), (b - a, ncols), (0, 0))])
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}, dtype)


def grid_layout(row_cuts, col_cuts):
    """Source ``i * len(cols) + j`` holds row range i x col range j (FSDP x TP)."""
    views, cells = {}, [(r, c) for r in zip(row_cuts, row_cuts[1:])
                        for c in zip(col_cuts, col_cuts[1:])]
    for k, ((r0, r1), (c0, c1)) in enumerate(cells):
        views[k] = ((r1 - r0, c1 - c0), [((r0, c0), (r1 - r0, c1 - c0), (0, 0))])
    return R.Layout.explicit((row_cuts[-1], col_cuts[-1]), views)


def megatron_q_layout(num_groups, q_rows, kv_rows, tp, hidden):
    """The q of a Megatron fused QKV: TP rank t holds its query groups' q rows, each at
    its place in the fused local tensor [q_g, k_g, v_g, q_g+1, ...] (k, v rows unlisted)."""
    per = num_groups // tp
    fused = q_rows + 2 * kv_rows
    views = {}
    for t in range(tp):
        pieces = [((g * q_rows, 0), (q_rows, hidden), ((g - t * per) * fused, 0))
                  for g in range(t * per, (t + 1) * per)]
        views[t] = ((per * fused, hidden), pieces)
    return R.Layout.explicit((num_groups * q_rows, hidden), views)


def _cuts(draw, total, max_parts):
    inner = draw(st.lists(st.integers(0, total), max_size=max_parts - 1))
    return [0, *sorted(inner), total]


@st.composite
def layouts(draw):
    kind = draw(st.sampled_from(["rows", "rows", "cols", "grid", "grid", "placed", "megatron",
                                 "whole+rows"]))
    if kind == "megatron":
        tp = draw(st.integers(1, 3))
        groups = tp * draw(st.integers(1, 3))
        return megatron_q_layout(groups, draw(st.integers(1, 9)), 0, tp,
                                 draw(st.integers(1, 20)))
    m, n = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    if kind == "rows":
        return rows_layout(_cuts(draw, m, 6), n)
    if kind == "whole+rows":  # rank 0 holds every row shard, ranks 1.. one shard each
        cuts = _cuts(draw, m, 5)
        boxes = [((a, 0), (b - a, n), (a, 0)) for a, b in zip(cuts, cuts[1:])]
        shards = {i + 1: ((size[0], n), [(off, size, (0, 0))])
                  for i, (off, size, _) in enumerate(boxes)}
        return R.Layout.explicit((m, n), {0: ((m, n), boxes), **shards})
    if kind == "cols":
        return grid_layout([0, m], _cuts(draw, n, 5))
    if kind == "grid":
        return grid_layout(_cuts(draw, m, 3), _cuts(draw, n, 3))
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    kinds = st.sampled_from([R.Replicate(), R.Shard(0), R.Shard(1), R.StridedShard(0, 2),
                             R.StridedShard(1, 3)])
    return R.Layout((m, n), R.Mesh.from_shape(mesh_shape), [draw(kinds) for _ in mesh_shape])


def brute_force_shared(layout, block):
    """{block: ranks} of blocks touched by 2+ ranks, one holding only part, element by element."""
    m, n = layout.shape
    holds = {r: torch.zeros(m, n, dtype=torch.bool) for r in layout.ranks}
    for r in layout.ranks:
        for p in layout.view(r).pieces:
            holds[r][p.offset[0]:p.offset[0] + p.size[0], p.offset[1]:p.offset[1] + p.size[1]] = 1
    out = {}
    for i in range(0, m, block[0]):
        for j in range(0, n, block[1]):
            parts = {r: h[i:i + block[0], j:j + block[1]] for r, h in holds.items()}
            touch = [r for r, h in parts.items() if h.any()]
            if len(touch) > 1 and not all(parts[r].all() for r in touch):
                out[(i // block[0], j // block[1])] = tuple(touch)
    return out


def random_tensor(shape, block, seed, dtype):
    """Values over 24 binades by row and column, some whole blocks zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-12, 12, (shape[0], 1), generator=g)
    x *= 2.0 ** torch.randint(-6, 6, (1, shape[1]), generator=g)
    gm, gn = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    zero = torch.rand(gm, gn, generator=g) < 0.2
    mask = zero.repeat_interleave(block[0], 0)[:shape[0]].repeat_interleave(block[1], 1)
    x[mask[:, :shape[1]]] = 0
    return x.to(dtype)


def floored(x, fmt):
    """Whether some block of ``x`` has its amax at the floor (all zero, or nearly)."""
    scale = quantize_reference(x, BlockFormat(fmt.block))[1]
    return bool((scale == torch.tensor(1e-4) / 448).any())


def check_bit_identical(layout, fmt, x):
    p = plan_fp8(layout, fmt)
    t = p.tensors[0]
    shards = quantize_shards({r: layout.shard(x, r) for r in layout.ranks}, layout, t, fmt)
    q, scale = assemble(shards, layout, t)
    q_ref, scale_ref = quantize_reference(x, fmt)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), (layout, fmt)
    assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32)), (layout, fmt)
    return p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.sampled_from([(4, 4), (8, 8), (4, 8), (8, 3), (1, 5)]))
def test_shared_blocks_are_those_split_across_sources(layout, block):
    t = plan_fp8(layout, BlockFormat(block)).tensors[0]
    assert {s.block: s.ranks for s in t.shared} == brute_force_shared(layout, block)
    assert list(t.shared) == sorted(t.shared, key=lambda s: s.block)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.sampled_from([(4, 4), (8, 8), (4, 8), (8, 3)]), st.booleans(),
       st.sampled_from(DTYPES), st.integers(0, 2**31))
def test_shards_quantize_bit_identical_to_the_reference(layout, block, ue8m0, dtype, seed):
    x = random_tensor(layout.shape, block, seed, dtype)
    t = check_bit_identical(layout, BlockFormat(block, ue8m0), x).tensors[0]
    event(f"most sources sharing a block: {max((len(s.ranks) for s in t.shared), default=0)}")
    event(f"ragged edge: {any(n % b for n, b in zip(layout.shape, block))}")
    event(f"a block at the amax floor (all zero): {floored(x, BlockFormat(block))}")


def retyped(layout, dtype):
    """The same layout, of another dtype (the FP8 codes of a bf16 shard)."""
    return R.Layout.explicit(layout.shape, {r: layout.view(r) for r in layout.ranks}, dtype)


@st.composite
def source_and_engine(draw):
    """A random trainer split and a vLLM-like TP split on block boundaries."""
    block = draw(st.sampled_from([(4, 4), (8, 8), (4, 8)]))
    tp, dim = draw(st.integers(1, 4)), draw(st.integers(0, 1))
    shape = [block[0] * draw(st.integers(1, 4)), block[1] * draw(st.integers(1, 4))]
    shape[dim] = block[dim] * tp * draw(st.integers(1, 3))
    shape[1 - dim] -= draw(st.integers(0, block[1 - dim] - 1))  # the unsplit dim ragged
    m, n = shape
    src = draw(st.sampled_from(["rows", "grid"]))
    src = (rows_layout(_cuts(draw, m, 6), n) if src == "rows"
           else grid_layout(_cuts(draw, m, 3), _cuts(draw, n, 3)))
    dst = R.Layout((m, n), R.Mesh(list(range(10, 10 + tp))), [R.Shard(dim)])
    return src, dst, BlockFormat(block, draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source_and_engine(), st.integers(0, 2**31))
def test_codes_and_scale_rows_reach_each_engine_rank(case, seed):
    """The shards' FP8 codes and owned scales, moved by the ordinary planner, give each
    engine rank its part of the reference: the scale rows vLLM's loader narrows to it."""
    src, dst, fmt = case
    check_engine_split("w", dst, fmt.block)
    x = random_tensor(src.shape, fmt.block, seed, torch.bfloat16)
    t = plan_fp8(src, fmt).tensors[0]
    shards = quantize_shards({r: src.shard(x, r) for r in src.ranks}, src, t, fmt)
    q_ref, scale_ref = quantize_reference(x, fmt)
    codes = R.execute_local(R.plan(retyped(src, "float8_e4m3fn"), retyped(dst, "float8_e4m3fn")),
                            {r: s.qdata for r, s in shards.items()})
    scales = R.execute_local(R.plan(scale_layout(src, fmt.block), scale_layout(dst, fmt.block)),
                             {r: s.scale_local for r, s in shards.items()})
    dim = dst.placements[0].dim
    for k, r in enumerate(dst.ranks):
        assert torch.equal(codes[r].view(torch.uint8), dst.shard(q_ref, r).view(torch.uint8))
        per = dst.local_shape(r)[dim] // fmt.block[dim]  # vLLM: narrow(dim, k * per, per)
        assert torch.equal(scales[r], scale_ref.narrow(dim, k * per, per))


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("layout", [
    rows_layout([0, 75, 150, 225, 300], 200),  # FSDP2 of 300 rows: block 1 on 3 sources
    rows_layout([0, 1, 130, 131, 257, 300], 130),  # ragged, thin shards
    grid_layout([0, 100, 300], [0, 64, 200]),  # FSDP x TP, the TP cut mid-block
    megatron_q_layout(8, 48, 0, 2, 136),  # query groups of 48 rows: blocks hold 3 groups
], ids=["fsdp-4", "fsdp-ragged", "fsdp-tp", "megatron-q"])
def test_128_blocks(layout, ue8m0):
    x = random_tensor(layout.shape, (128, 128), 7, torch.bfloat16)
    p = check_bit_identical(layout, BlockFormat((128, 128), ue8m0), x)
    assert p.num_shared > 0


def test_a_block_on_three_sources():
    layout = rows_layout([0, 3, 5, 20], 8)
    t = plan_fp8(layout, BlockFormat((8, 8))).tensors[0]
    assert [(s.block, s.ranks) for s in t.shared] == [((0, 0), (0, 1, 2))]
    for seed in range(20):
        check_bit_identical(layout, BlockFormat((8, 8)), random_tensor((20, 8), (8, 8), seed,
                                                                        torch.bfloat16))


def test_aligned_shards_share_nothing():
    assert plan_fp8(rows_layout([0, 256, 512, 600], 300)).num_shared == 0
    tp = R.Layout((512, 384), R.Mesh([0, 1, 2]), [R.Shard(1)])
    assert plan_fp8(tp).num_shared == 0


def test_whole_holders_need_no_exchange_but_part_holders_do():
    # two replicas of the whole tensor: nothing to exchange
    rep = R.Layout((10, 10), R.Mesh([0, 1]), [R.Replicate()])
    assert plan_fp8(rep, BlockFormat((4, 4))).num_shared == 0
    # replicated row shards: every holder of an edge block holds part of it
    mixed = R.Layout((10, 10), R.Mesh([[0, 1], [2, 3]]), [R.Replicate(), R.Shard(0)])
    shared = plan_fp8(mixed, BlockFormat((4, 4))).tensors[0].shared
    assert {s.block for s in shared} == {(1, 0), (1, 1), (1, 2)}
    assert {s.ranks for s in shared} == {(0, 1, 2, 3)}
    # rank 0 holds block 0 whole (in two pieces), rank 1 a part of it: rank 1 needs it
    whole_and_part = R.Layout.explicit((10, 8), {
        0: ((10, 8), [((0, 0), (4, 8), (0, 0)), ((4, 0), (6, 8), (4, 0))]),
        1: ((4, 8), [((0, 0), (4, 8), (0, 0))])})
    t = plan_fp8(whole_and_part, BlockFormat((8, 8))).tensors[0]
    assert [(s.block, s.ranks) for s in t.shared] == [((0, 0), (0, 1))]


def test_megatron_groups_within_a_rank_need_no_exchange():
    # head rows 6, block 8: groups straddle blocks inside one TP rank; only the TP cut
    # (row 18, mid-block) is a shared block row
    t = plan_fp8(megatron_q_layout(6, 6, 2, 2, 16), BlockFormat((8, 8))).tensors[0]
    assert [s.block for s in t.shared] == [(2, 0), (2, 1)]
    assert {s.ranks for s in t.shared} == {(0, 1)}


def test_all_zero_block_gets_the_floor_scale_and_zero_codes():
    x = torch.zeros(8, 8, dtype=torch.bfloat16)
    x[4:, 4:] = 1.0
    q, scale = quantize_reference(x, BlockFormat((4, 4)))
    assert torch.equal(scale[0, 0], torch.tensor(1e-4, dtype=torch.float32) / 448)
    assert scale[1, 1] == 1.0 / 448
    assert not q[:4, :4].float().any() and bool((q[4:, 4:].float() == 448).all())


def test_ue8m0_scale_is_the_smallest_power_of_two_not_below_amax_over_448():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g) * 2.0 ** torch.randint(-20, 20, (64, 1), generator=g)
    _, plain = quantize_reference(x, BlockFormat((4, 4)))
    _, pow2 = quantize_reference(x, BlockFormat((4, 4), ue8m0=True))
    mantissa, _ = torch.frexp(pow2)
    assert bool((mantissa == 0.5).all())
    assert bool((pow2 >= plain).all()) and bool((pow2 < 2 * plain).all())
    exact = torch.tensor(2.0 ** -10)  # a scale that is a power of two stays as it is
    _, s = quantize_reference(torch.full((4, 4), float(exact * 448)), BlockFormat((4, 4), True))
    assert s.item() == exact.item()


def test_the_plan_is_frozen_data():
    p = plan_fp8({"a": rows_layout([0, 5, 9], 8), "b": rows_layout([0, 4, 9], 8)},
                 BlockFormat((4, 4), ue8m0=True))
    assert repr(p) == "Fp8Plan(2 tensors, fp8[4x4,ue8m0], 2 shared blocks)"
    assert p.exchange_offsets() == {"a": 0, "b": 2} and p.exchange_bytes == 8
    assert hash(p) == hash(plan_fp8({"a": rows_layout([0, 5, 9], 8),
                                     "b": rows_layout([0, 4, 9], 8)},
                                    BlockFormat((4, 4), ue8m0=True)))
    assert p["a"].boxes_of(1) == ((1, 2, 0, 2),) and p["a"].shared_of(1) == (0, 1)
    with pytest.raises(KeyError, match="no tensor 'c' in this FP8 plan of 2 tensors"):
        p["c"]


def test_bytes_fp8_and_scales_against_bf16():
    b = fp8_bytes((7168, 18432))
    assert (b.fp8, b.scales, b.source) == (7168 * 18432, 4 * 56 * 144, 2 * 7168 * 18432)
    assert 0.5 < b.ratio < 0.5002
    ragged = fp8_bytes((300, 200), (128, 128), "float32")
    assert (ragged.scales, ragged.total, ragged.source) == (4 * 3 * 2, 60024, 240000)


def test_engine_splits_vllm_refuses_are_refused_by_name():
    ok = R.Layout((512, 256), R.Mesh([0, 1]), [R.Shard(0)])
    check_engine_split("q_proj", ok)
    check_engine_split("embed", R.Layout((300, 7), R.Mesh([0, 1]), [R.Replicate()]))
    cols = R.Layout((256, 384), R.Mesh([0, 1]), [R.Shard(1)])  # 192 input cols per rank
    with pytest.raises(R.MappingError, match=r"tensor 'o_proj': engine rank 0 holds an input "
                       r"size \(cols\) of 192 of 384, not a multiple of the FP8 block's 128"):
        check_engine_split("o_proj", cols)
    rows = R.Layout((384, 256), R.Mesh([4, 5, 6, 7]), [R.Shard(0)])  # 96 rows per rank
    with pytest.raises(R.ReshardError, match=r"'k_proj': engine rank 4 holds an output size "
                       r"\(rows\) of 96 of 384"):
        check_engine_split("k_proj", rows)


def test_bad_input_is_refused():
    with pytest.raises(R.LayoutError, match=r"expected block = \(rows, cols\), two ints > 0"):
        BlockFormat((128, 0))
    with pytest.raises(R.MappingError, match="tensor 'norm': FP8 block quantization needs a "
                       r"2-D tensor, got shape \[64\]"):
        plan_fp8({"norm": R.Layout((64,), R.Mesh([0]), [R.Shard(0)])})
    layout = rows_layout([0, 5, 9], 8)
    t = plan_fp8(layout, BlockFormat((4, 4))).tensors[0]
    with pytest.raises(R.TensorMismatchError, match=r"rank 1 expected a local tensor of "
                       r"shape \[4, 8\], got \[5, 8\]"):
        quantize_shards({0: torch.zeros(5, 8), 1: torch.zeros(5, 8)}, layout, t,
                        BlockFormat((4, 4)))
