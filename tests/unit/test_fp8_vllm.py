"""The reference quantizer against vLLM's own ``per_block_cast_to_fp8``
(vllm/utils/deep_gemm.py): bit for bit on random tensors of every source dtype, ragged
and all-zero blocks, plain and UE8M0 scales; its Python body (what ``torch.compile``
wraps) over many examples, the compiled function itself once. The one documented
difference: UE8M0 of a scale a few ulps above a power of two."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard.quant import BlockFormat, quantize_reference

deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM is not installed")
VLLM_CAST = deep_gemm.per_block_cast_to_fp8
VLLM_BODY = getattr(VLLM_CAST, "_torchdynamo_orig_callable", VLLM_CAST)


def _same(ours, theirs) -> bool:
    (q, s), (qv, sv) = ours, theirs
    return (torch.equal(q.view(torch.uint8), qv.view(torch.uint8))
            and torch.equal(s.view(torch.int32), sv.contiguous().view(torch.int32)))


def _tensor(shape, block, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-14, 14, (shape[0], 1), generator=g)
    x[: block[0], : block[1]] = 0  # an all-zero block
    x[-1, -1] = 1e-6  # a block under the amax floor
    return x.to(dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from([(4, 4), (8, 16), (16, 8)]),
       st.booleans(), st.sampled_from([torch.bfloat16, torch.float32, torch.float16,
                                       torch.float64]), st.integers(0, 2**31))
def test_reference_is_vllms_formula(m, n, block, ue8m0, dtype, seed):
    x = _tensor((m, n), block, seed, dtype)
    assert _same(quantize_reference(x, BlockFormat(block, ue8m0)),
                 VLLM_BODY(x, list(block), use_ue8m0=ue8m0))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_reference_is_vllms_formula_at_128(ue8m0):
    x = _tensor((300, 200), (128, 128), 5, torch.bfloat16)
    assert _same(quantize_reference(x, BlockFormat(ue8m0=ue8m0)),
                 VLLM_BODY(x, [128, 128], use_ue8m0=ue8m0))


def test_reference_is_vllms_compiled_function():
    """The function vLLM calls (torch.compile'd; its first call compiles, ~30 s here)."""
    x = _tensor((300, 200), (128, 128), 11, torch.bfloat16)
    assert _same(quantize_reference(x), VLLM_CAST(x, [128, 128]))


def test_ue8m0_a_few_ulps_above_a_power_of_two():
    """vLLM's ``2 ** ceil(log2(s))`` in float32: log2 of 2**-10 * (1 + 2**-23) rounds to
    -10, so vLLM's scale is 2**-10, just below amax / 448 (the code saturates at 448);
    ours is exactly the smallest power of two >= amax / 448, 2**-9 (code 224)."""
    s = torch.nextafter(torch.tensor(2.0 ** -10), torch.tensor(1.0))
    x = torch.zeros(4, 4)
    x[0, 0] = s * 448
    assert x[0, 0] / 448 == s
    q, scale = quantize_reference(x, BlockFormat((4, 4), ue8m0=True))
    qv, scale_v = VLLM_BODY(x, [4, 4], use_ue8m0=True)
    assert (scale.item(), q[0, 0].float().item()) == (2.0 ** -9, 224.0)
    assert (scale_v.item(), qv[0, 0].float().item()) == (2.0 ** -10, 448.0)
