"""The sparse refit's encodings: every one exact (bit for bit, -0.0 and NaN included),
the cheapest chosen by bytes, and a region of any strides written in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
