"""The sparse refit's encodings: every one exact (bit for bit, -0.0 and NaN included),
the cheapest chosen by bytes, and a region of any strides written in place."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard._transport import native
from reshard._transport import sparse as codec

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float64]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def _roundtrip(new: torch.Tensor, old: torch.Tensor, kind: int | None = None):
    enc = codec.encode(new, old)
    if kind is not None:  # force an encoding: rebuild it by hand from the same mask
        mask = codec.changed(new, old)
        index = mask.nonzero().view(-1)
        parts = ([codec.pack_bits(mask)] if kind == codec.BITMAP else
                 [index.to(torch.int32 if kind == codec.OFFSETS32 else torch.int16)
                  .view(torch.uint8)])
        n, m = new.numel(), index.numel()
        enc = codec.Encoded(kind, m, codec.payload_nbytes(kind, n, m, new.element_size()),
                            parts + [new[index].reshape(-1).view(torch.uint8)], index,
                            new[index])
    body = torch.zeros(enc.nbytes, dtype=torch.uint8)
    codec.write_payload(enc, body)
    index, values = codec.decode(enc.kind, new.numel(), enc.count, body, new.dtype)
    out = old.clone()
    codec.apply(out, index, values)
    return enc, out


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 3000), frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31 - 1), specials=st.booleans())
def test_every_encoding_is_exact_and_the_cheapest_is_chosen(n, frac, dtype, seed, specials):
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 50).to(dtype)
    new = old.clone()
    hit = torch.rand(n, generator=g) < frac
    new[hit] = (torch.randn(int(hit.sum()), generator=g) * 50).to(dtype)
    if specials and n >= 4 and dtype.is_floating_point:  # bits, not values, are compared
        old[:2], new[:2] = torch.tensor([0.0, float("nan")]).to(dtype), torch.tensor(
            [-0.0, float("nan")]).to(dtype)
    mask = codec.changed(new, old)
    m = int(mask.sum())
    for kind in (None, codec.BITMAP, codec.OFFSETS32) + ((codec.OFFSETS16,) if n <= 65536
                                                         else ()):
        enc, out = _roundtrip(new, old, kind)
        assert torch.equal(_bits(out), _bits(new)), kind
    enc = codec.encode(new, old)
    best = min(codec.payload_nbytes(k, n, m, new.element_size())
               for k in (codec.DENSE, codec.BITMAP, codec.OFFSETS32, codec.OFFSETS16))
    assert enc.nbytes == best == codec.payload_nbytes(enc.kind, n, m, new.element_size())
    assert enc.count == m if enc.kind != codec.DENSE else True
    assert enc.nbytes <= n * new.element_size()  # never more than dense


def test_choices_at_the_corners():
    # nothing changed: no payload at all; everything changed: dense
    assert codec.payload_nbytes(codec.cheapest(1000, 0, 2), 1000, 0, 2) == 0
    assert codec.cheapest(1000, 1000, 2) == codec.DENSE
    assert codec.cheapest(1000, 3, 2) == codec.OFFSETS16  # 6 B offsets + 6 B values
    assert codec.cheapest(1 << 20, 3, 2) == codec.OFFSETS32  # beyond 16 bits
    assert codec.cheapest(1 << 20, 1 << 17, 2) == codec.BITMAP  # 1/8 changed, bf16
    assert codec.cheapest(1000, 3, 2, sparse=False) == codec.DENSE


def test_payloads_laid_in_one_call_as_one_at_a_time():
    """write_payloads (every part of a body in one native call on the host) lays each
    encoding where write_payload lays it alone: every kind, an empty one, a part whose
    bytes are not laid flat (copied by torch)."""
    g = torch.Generator().manual_seed(5)
    encs = []
    for n, frac, kind in [(1000, 0.01, codec.OFFSETS16), (300, 0.2, codec.OFFSETS32),
                          (4096, 0.3, codec.BITMAP), (77, 1.0, codec.DENSE),
                          (500, 0.0, None), (1 << 17, 0.001, None)]:
        old = torch.randn(n, generator=g).to(torch.bfloat16)
        new = old.clone()
        hit = torch.rand(n, generator=g) < frac
        new[hit] = torch.randn(int(hit.sum()), generator=g).to(torch.bfloat16)
        encs.append(_roundtrip(new, old, None if kind == codec.DENSE else kind)[0])
    odd = encs[1]
    strided = torch.stack([odd.parts[0], odd.parts[0]], 1)[:, 0]  # the same bytes, strided
    assert not strided.is_contiguous()
    encs.append(codec.Encoded(odd.kind, odd.count, odd.nbytes, [strided, odd.parts[1]],
                              odd.index, odd.values))
    offsets, pos = [], 0
    for enc in encs:
        pos = -(-pos // 8) * 8
        offsets.append(pos)
        pos += enc.nbytes
    alone, many = torch.zeros(pos, dtype=torch.uint8), torch.zeros(pos, dtype=torch.uint8)
    for enc, off in zip(encs, offsets):
        codec.write_payload(enc, alone[off:off + enc.nbytes])
    codec.write_payloads(encs, offsets, many)
    assert torch.equal(alone, many) and bool(alone.any())


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_the_cheapest_is_the_first_of_the_fewest_bytes_dense_first(itemsize):
    """Fewest payload bytes; on a tie dense, then offsets16, offsets32, bitmap (the rule
    both sides and the simulator count with), over sizes around every boundary."""
    order = (codec.DENSE, codec.OFFSETS16, codec.OFFSETS32, codec.BITMAP)
    for n in [0, 1, 7, 8, 9, 63, 64, 1000, 65535, 65536, 65537, 1 << 20]:
        for m in sorted({0, 1, 2, 3, n // 64, n // 33, n // 32, n // 16, n // 8, n // 5,
                         n // 2, n - 1, n} - {-1}):
            kinds = [k for k in order if k != codec.OFFSETS16 or n <= 65536]
            want = min(kinds, key=lambda k: (codec.payload_nbytes(k, n, m, itemsize),
                                             kinds.index(k)))
            assert codec.cheapest(n, m, itemsize) == want, (n, m)


@pytest.mark.parametrize("transpose", [False, True])
def test_apply_writes_a_strided_region_in_place(transpose):
    base = torch.zeros(8, 10)
    region = base[2:6, 3:9] if not transpose else base.t()[3:9, 2:6]
    new = torch.arange(24.0).view(region.shape)
    enc = codec.encode(new.reshape(-1), torch.zeros(24))
    body = torch.zeros(enc.nbytes, dtype=torch.uint8)
    codec.write_payload(enc, body)
    index, values = codec.decode(enc.kind, 24, enc.count, body, torch.float32)
    codec.apply(region, index, values)
    assert torch.equal(region, new) and base.sum() == new.sum()


def test_bits_pack_and_unpack():
    mask = torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0], dtype=torch.bool)
    packed = codec.pack_bits(mask)
    assert packed.tolist() == [0b00011001, 0b011] and torch.equal(codec.unpack_bits(
        packed, 11), mask)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 5000), frac=st.floats(0, 0.05), seed=st.integers(0, 2**31 - 1),
       run=st.integers(0, 40))
def test_few_changes_positions_read_off_the_packed_mask_are_exact(n, frac, seed, run):
    """At most FEW_CHANGED of a region changed, the positions come from its packed mask:
    the same as a scan of every element, and the copy updated at exactly them."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    hit = torch.rand(n, generator=g) < frac
    hit[:min(run, n)] = True  # a run of changes: whole bytes of the mask set
    new[hit] = (new[hit].float() * 3 + 1).to(torch.bfloat16)
    want = codec.changed(new, old).nonzero().view(-1)
    copy = old.clone()
    enc = codec.encode(new, copy, update=True)
    if enc.kind != codec.DENSE and enc.count:
        assert torch.equal(enc.index, want)
        assert torch.equal(_bits(enc.values), _bits(new[want]))
    assert torch.equal(_bits(copy), _bits(new))


def _scratch(dtype, n):
    return torch.full((n,), 0x5A if dtype != torch.bool else 1, dtype=torch.uint8).view(
        dtype)[:n] if dtype.itemsize == 1 else torch.empty(n, dtype=dtype)


needs_native = pytest.mark.skipif(
    native.library() is None, reason="no C compiler: the fused pass is not built here")


def test_the_fused_pass_is_built_where_a_compiler_is():
    assert (native.library() is not None) == (native.compiler() is not None) or (
        os.environ.get("RESHARD_NATIVE") == "0")


@needs_native
@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 3000), frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1),
       same=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float32, torch.int8]),
       specials=st.booleans())
def test_the_fused_pass_encodes_as_the_torch_cast_and_scans_do(n, frac, seed, same, specials):
    """float32 into bfloat16 (from any bit pattern: subnormals, infinities, ties of the
    rounding) or a source of the copy's own dtype: the fused pass gives the same
    encoding, payload and updated copy as torch's cast then :func:`codec.encode`; a
    NaN in a float32 source sends the region whole, as torch casts it."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    src = raw.view(torch.float32)
    if same is None:
        nan = torch.isnan(src)
        src[nan] = src[nan].sign_() * 1e-40  # NaNs only where asked (subnormals instead)
        if specials and n >= 8:
            ties = torch.tensor([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, -0x80000000,
                                 0x7F800000], dtype=torch.int64).to(torch.int32)
            src[:6] = ties.view(torch.float32)
            src[7] = float("nan")
        old = src.to(torch.bfloat16)
    else:
        src = src.view(torch.int8)[:n].clone().view(same) if same.itemsize == 1 else (
            raw.view(torch.int16)[:n].clone().view(same) if same.itemsize == 2 else src)
        old = src.clone()
    keep = torch.rand(n, generator=g) >= frac  # the copy holds these elements still
    flip = old.clone()
    w = {1: torch.int8, 2: torch.int16, 4: torch.int32}[old.element_size()]
    flip.view(w)[~keep] ^= 1  # one bit off: the copy is a version behind there
    copy_a, copy_b = flip.clone(), flip.clone()
    want = codec.encode(src.to(old.dtype), copy_a, update=True)
    got = codec.encode_fused(src, copy_b, _scratch)
    assert got is not None
    assert torch.equal(_bits(copy_b), _bits(copy_a))
    assert (got.kind, got.count, got.nbytes) == (want.kind, want.count, want.nbytes) or (
        specials and same is None and n >= 8 and got.kind == codec.DENSE)
    if got.kind == want.kind:
        a, b = (torch.zeros(e.nbytes, dtype=torch.uint8) for e in (want, got))
        codec.write_payload(want, a)
        codec.write_payload(got, b)
        assert torch.equal(a, b)


@needs_native
@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 300), frac=st.sampled_from([0, 0.01, 0.3, 1]),
       seed=st.integers(0, 2**31 - 1), nan=st.booleans(), small_cap=st.booleans())
def test_the_vector_pass_and_the_portable_pass_agree(rows, cols, frac, seed, nan, small_cap):
    """float32 into bfloat16: the host's vector pass (AVX-512 where the compiler targets
    it, else the portable pass itself) and the portable pass give the same count, values,
    positions (up to the cap), bits and updated copy, on rows of a wider tensor (a
    stride), from any bit pattern; a NaN: -1 from both."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-2**31, 2**31, (rows, cols + 5), generator=g, dtype=torch.int64)
    src = raw.to(torch.int32).view(torch.float32)[:, 2:2 + cols]
    src[torch.isnan(src)] = 1.5
    if nan:
        src[rows // 2, cols // 2] = float("nan")
    n = rows * cols
    old = src.reshape(-1).to(torch.bfloat16)
    change = torch.rand(n, generator=g) < frac
    old.view(torch.int16)[change] ^= 1
    cap = 3 if small_cap else n // 16 + 8
    out = []
    for portable in (False, True):
        copy, values = old.clone(), torch.zeros(n + 16, dtype=torch.bfloat16)
        pos, bits = torch.zeros(cap, dtype=torch.int32), torch.zeros(n // 8 + 8, dtype=torch.uint8)
        m = native.diff(src, copy, values, pos, bits, portable=portable)
        out.append((m, copy, values[:max(m, 0)], pos[:min(max(m, 0), cap)], bits))
    (m1, *a), (m2, *b) = out
    assert m1 == m2 and (m1 == -1) == nan
    if m1 >= 0:
        assert m1 == int(change.sum())
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))
        want = codec.pack_bits(change) if m1 > cap else torch.zeros(n // 8 + 8,
                                                                     dtype=torch.uint8)
        assert torch.equal(a[3][:want.numel()], want)  # bits only past the cap, all of them


@needs_native
@settings(max_examples=60, deadline=None)
@given(regions=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 200),
                                  st.sampled_from([0, 0.01, 0.1, 1]), st.booleans()),
                        min_size=1, max_size=6),
       seed=st.integers(0, 2**31 - 1))
def test_many_regions_in_one_call_encode_as_one_at_a_time(regions, seed):
    """encode_fused_many: the same encodings (kind, count, payload bytes) and updated
    copies as encode_fused region by region, for regions of any size and changed
    fraction (offsets, bitmap, dense, nothing changed; a NaN: sent whole) side by side
    in one batch's buffers."""
    g = torch.Generator().manual_seed(seed)
    pairs, copies = [], []
    for rows, cols, frac, nan in regions:
        src = torch.randn(rows, cols + 3, generator=g)[:, 1:1 + cols]  # rows at a stride
        if nan:
            src[rows // 2, cols // 2] = float("nan")
        old = src.reshape(-1).to(torch.bfloat16)
        old.view(torch.int16)[torch.rand(old.numel(), generator=g) < frac] ^= 1
        pairs.append((src, old))
        copies.append(old.clone())
    got = codec.encode_fused_many(pairs)
    for (src, copy_b), copy_a, enc in zip(pairs, copies, got):
        want = codec.encode_fused(src, copy_a, _scratch)
        assert (enc.kind, enc.count, enc.nbytes) == (want.kind, want.count, want.nbytes)
        assert torch.equal(_bits(copy_a), _bits(copy_b))
        a, b = (torch.zeros(e.nbytes, dtype=torch.uint8) for e in (want, enc))
        codec.write_payload(want, a)
        codec.write_payload(enc, b)
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("shape,cut", [((9, 70), (slice(2, 8), slice(3, 68))),
                                       ((4, 5, 130), (slice(1, 3), slice(None), slice(1, 129))),
                                       ((6, 64), (slice(None), slice(0, 64))),
                                       ((1, 1000), (slice(None), slice(5, 900))),
                                       # an expert stack cut inside each expert
                                       ((5, 12, 70), (slice(1, 4), slice(3, 9), slice(None))),
                                       ((4, 10, 70), (slice(None), slice(2, 7), slice(1, 66)))])
def test_the_fused_pass_reads_a_slice_of_rows_or_columns_in_place(shape, cut):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(shape, generator=g)
    src = base[cut]
    old = src.to(torch.bfloat16).reshape(-1)
    hit = torch.rand(src.shape, generator=g) < 0.05
    src[hit] += 1.0
    copy_a, copy_b = old.clone(), old.clone()
    want = codec.encode(src.reshape(-1).to(torch.bfloat16), copy_a, update=True)
    got = codec.encode_fused(src, copy_b, _scratch)
    assert got is not None and torch.equal(_bits(copy_a), _bits(copy_b))
    a, b = (torch.zeros(e.nbytes, dtype=torch.uint8) for e in (want, got))
    codec.write_payload(want, a)
    codec.write_payload(got, b)
    assert (got.kind, got.count) == (want.kind, want.count) and torch.equal(a, b)


@needs_native
def test_the_fused_pass_leaves_other_strides_to_the_scans():
    src = torch.randn(8, 6).t()  # a column of a row-major tensor is not a row
    assert codec.encode_fused(src, torch.zeros(48, dtype=torch.bfloat16), _scratch) is None
    assert codec.encode_fused(torch.randn(8, 6)[::2, :5], torch.zeros(20, dtype=torch.bfloat16),
                              _scratch) is not None  # rows at a stride: read in place
    assert codec.encode_fused(torch.randn(32), torch.zeros(32, dtype=torch.float16),
                              _scratch) is None  # a cast it does not do
    gappy = torch.randn(3, 4, 5, 6)[::2, :3, 1:4, :5]  # rows in groups in groups: numpy's
    assert codec.encode_fused(gappy, torch.zeros(gappy.numel(), dtype=torch.bfloat16),
                              _scratch) is None


@needs_native
def test_many_payloads_in_one_call_apply_as_one_at_a_time():
    """decode_into_many: regions the native pass writes (rows of a tensor, every sparse
    encoding), one it leaves to numpy (a transposed view), a dense one, side by side;
    each lands as decode_into lands it alone, and only the payload that does not fit
    its header is reported."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 70, generator=g).to(torch.bfloat16)
    regions = [lambda t: t[0:10], lambda t: t[10:20, 5:60], lambda t: t[20:30].t(),
               lambda t: t[30:34], lambda t: t[34:40]]
    kinds = [codec.OFFSETS16, codec.BITMAP, codec.OFFSETS32, codec.DENSE, codec.BITMAP]
    items, want = [], []
    for region_of, kind in zip(regions, kinds):
        region = region_of(base)
        n = region.numel()
        new = region.reshape(-1).clone()
        hit = torch.rand(n, generator=g) < 0.1
        new[hit] = torch.randn(int(hit.sum()), generator=g).to(torch.bfloat16)
        enc, _ = _roundtrip(new, region.reshape(-1).clone(), kind)
        body = torch.zeros(enc.nbytes, dtype=torch.uint8)
        codec.write_payload(enc, body)
        alone = region_of(base.clone())
        assert codec.decode_into(alone, kind, n, enc.count, body)
        want.append(alone)
        items.append((kind, n, enc.count, body))
    m_bad = items[-1][2] + 1  # the last one's header says one change more than its bits
    items[-1] = (*items[-1][:2], m_bad, torch.cat([items[-1][3],
                                                   torch.zeros(16, dtype=torch.uint8)]))
    got = base.clone()
    fits = codec.decode_into_many([(region_of(got), *item)
                                   for region_of, item in zip(regions, items)])
    assert fits == [True, True, True, True, False]
    for region_of, alone in list(zip(regions, want))[:-1]:
        assert torch.equal(_bits(region_of(got).reshape(-1)), _bits(alone.reshape(-1)))


@pytest.mark.parametrize("rows", [False, True], ids=["left to torch", "native"])
@pytest.mark.parametrize("fault", ["past the end", "negative", "values short",
                                   "bits short", "dense short"])
def test_a_payload_left_to_torch_that_does_not_fit_is_reported_not_applied(fault, rows):
    """The regions the native pass does not write (a transposed view here; every region
    on a device) are checked against their header before anything is written: a position
    outside the region, a payload cut short, fewer bits than the header's count. Each
    reported (False), the region untouched, the others written; nothing raised (on a
    device the scatter would stop the process). The same for regions the native pass
    writes, whose payload it must never read past (it may stop midway in a region it
    reports: the refit is then discarded)."""
    base = torch.arange(60, dtype=torch.float32).view(6, 10).to(torch.bfloat16)
    got = base.clone()
    good, bad = got[0:3].t(), got[3:6].t()  # 30 elements each, left to torch / numpy
    if rows:  # rows of the tensor: the native pass writes them (where it was built)
        good, bad = got[0:3], got[3:6]
    new = bad.reshape(-1).clone()
    new[[2, 7, 29]] = -1.0
    kind = {"past the end": codec.OFFSETS32, "negative": codec.OFFSETS32,
            "values short": codec.OFFSETS16, "bits short": codec.BITMAP,
            "dense short": codec.DENSE}[fault]
    if kind == codec.DENSE:
        body, m = new.view(torch.uint8).clone(), 30
    else:
        enc, _ = _roundtrip(new, bad.reshape(-1).clone(), kind)
        body = torch.zeros(enc.nbytes, dtype=torch.uint8)
        codec.write_payload(enc, body)
        m = enc.count
    if fault == "past the end":
        body[8:12].view(torch.int32)[0] = 30  # the last position, one past the region
    elif fault == "negative":
        body[0:4].view(torch.int32)[0] = -1
    elif fault in ("values short", "dense short"):
        body = body[:-2]
    else:
        body[0] &= ~(1 << 2) & 0xFF  # one change's bit cleared: two bits for three values
    fine = good.reshape(-1).clone()
    fine[0] = 7.0
    enc_good, _ = _roundtrip(fine, good.reshape(-1).clone(), codec.OFFSETS16)
    body_good = torch.zeros(enc_good.nbytes, dtype=torch.uint8)
    codec.write_payload(enc_good, body_good)
    before = bad.clone()
    fits = codec.decode_into_many([(good, codec.OFFSETS16, 30, enc_good.count, body_good),
                                   (bad, kind, 30, m, body)])
    assert fits == [True, False]
    if not rows:  # checked before any write (the native pass may stop midway: the region
        assert torch.equal(_bits(bad), _bits(before))  # is then not to be trusted)
    assert float(good.reshape(-1)[0] if rows else good[0, 0]) == 7.0


@needs_native
@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 150), frac=st.floats(0, 1),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(
           [torch.bfloat16, torch.float32, torch.int8]),
       cut=st.sampled_from(["whole", "rows", "experts"]), experts=st.integers(1, 3))
def test_the_native_apply_writes_every_encoding_as_numpy_does(rows, cols, frac, seed, dtype,
                                                               cut, experts):
    """A payload of each sparse encoding written into a region (all of a tensor, a slice
    of its rows and columns, or of an expert stack's middle dimension) by the native
    pass: the same bits as numpy's decode and scatter; a payload that does not fit its
    header is reported."""
    g = torch.Generator().manual_seed(seed)
    if cut == "experts":
        base = (torch.randn(experts + 1, rows + 2, cols + 3, generator=g) * 40).to(dtype)

        def region_of(t):
            return t[1:, 1:1 + rows, 2:2 + cols]
    else:
        base = (torch.randn(rows + 2, cols + 3, generator=g) * 40).to(dtype)

        def region_of(t):
            return t[1:1 + rows, 2:2 + cols] if cut == "rows" else t[:rows, :cols]
    region = region_of(base)
    n = region.numel()
    new = (torch.randn(n, generator=g) * 40).to(dtype)
    old = region.reshape(-1).clone()
    keep = torch.rand(n, generator=g) >= frac
    new[keep] = old[keep]
    for kind in (codec.BITMAP, codec.OFFSETS32) + ((codec.OFFSETS16,) if n <= 65536 else ()):
        enc, want = _roundtrip(new, old, kind)
        body = torch.zeros(enc.nbytes, dtype=torch.uint8)
        codec.write_payload(enc, body)
        got = region_of(base.clone())
        assert codec.decode_into(got, kind, n, enc.count, body)
        assert torch.equal(_bits(got.reshape(-1)), _bits(want)), kind
        if enc.count:  # one changed element fewer than the header says: caught
            assert not codec.decode_into(got, kind, n, enc.count + 1, torch.cat(
                [body, torch.zeros(16, dtype=torch.uint8)])) or kind != codec.BITMAP


@pytest.mark.parametrize("bad", [("kind", 9), ("count", -1), ("count", 10**9)])
def test_a_header_no_sender_writes_fails_the_receivers_not_the_process(bad):
    """The real sparse transport on thread ranks (2 float32 senders, 2 bfloat16
    receivers): a step's header that says an encoding that does not exist, or a count
    outside its region, is reported as corrupt by the receivers (their refit fails, to be
    discarded), never decoded."""
    import reshard as R
    from reshard._transport.sparse_copies import Copies
    from reshard._transport.sparse_runner import SparseRunner
    from reshard.errors import TransferError
    from reshard.executor import Executor

    from ._inproc import run_ranks

    src_l = R.Layout((64, 32), R.Mesh([0, 1]), [R.Shard(0)], dtype="float32")
    dst_l = R.Layout((64, 32), R.Mesh([2, 3]), [R.Shard(1)], dtype="bfloat16")
    plan = R.plan({"w": src_l}, {"w": dst_l}, allow_cast=True)
    full = torch.randn(64, 32)
    real = SparseRunner._encode

    def tampered(self, *args, **kwargs):
        head, parts, used = real(self, *args, **kwargs)
        if self.base is not None:  # the sparse refit: its first region's header entry
            head[3 if bad[0] == "kind" else 4] = bad[1]
        return head, parts, used

    def rank_fn(comm):
        r = comm.rank
        src = {"w": src_l.shard(full, r).clone()} if r < 2 else {}
        dst = {"w": torch.zeros(dst_l.local_shape(r), dtype=torch.bfloat16)} if r >= 2 else {}
        runner = Executor(plan, comm, method="p2p").sparse_runner(Copies())
        runner.run(src, dst, sparse_to=set(), base=None)
        runner.copies.commit(1)
        if r < 2:
            src["w"][::7] += 1.0
        try:
            runner.run(src, dst, sparse_to={2, 3}, base=1)
        except TransferError as e:
            return str(e)
        return None

    SparseRunner._encode = tampered
    try:
        results = run_ranks(4, rank_fn)
    finally:
        SparseRunner._encode = real
    assert all(ok for ok, _ in results), results
    assert [got for _, got in results][:2] == [None, None]  # the senders finish
    for _, got in results[2:]:
        assert got is not None and "a header no sender writes" in got, got
