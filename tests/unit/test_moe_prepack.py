"""vLLM CPU's unquantized MoE experts written in place by a commit
(``kernels.prepack_experts``), against vLLM's own processing after loading: its
intermediate padding (``CPUUnquantizedExperts._pad_moe_intermediate``) and its prepacking
(``cpu_prepack_moe_weight``), run on a stand-alone layer, bit for bit. The engine end of
it (a refitted MoE engine answering as a fresh one) is in
``tests/integration/test_vllm_families.py`` (Mixtral, DeepSeek-V3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reshard.integrations.vllm import kernels
from reshard.integrations.vllm.mapping import MappingError

cpu_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.experts.cpu_moe")
from vllm._custom_ops import cpu_prepack_moe_weight  # noqa: E402

#: the portable kernel's layout (the refusal test's)
ISA = "vec"
#: (layout, dtype) as vLLM CPU's experts pick them: "vec" (any dtype) where the host has
#: no AMX, "amx" (bf16 only) where it has. Prepacking is a reordering that runs on any
#: x86 host (the AMX layout too, measured on an AVX2-only one), so both are checked here.
LAYOUTS = [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)]


def vllm_processed(w13: torch.Tensor, w2: torch.Tensor, padded: int,
                   isa: str = ISA) -> torch.nn.Module:
    """A layer holding ``w13`` / ``w2`` as vLLM CPU's experts leave it after loading."""
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    experts = SimpleNamespace(
        moe_config=SimpleNamespace(intermediate_size_per_partition=w2.shape[2]),
        _padded_intermediate_size=lambda config: padded)
    cpu_moe.CPUUnquantizedExperts._pad_moe_intermediate(experts, layer)
    for attr in ("w13_weight", "w2_weight"):
        setattr(layer, attr, torch.nn.Parameter(
            cpu_prepack_moe_weight(getattr(layer, attr).data, isa), requires_grad=False))
    return layer


@pytest.fixture
def as_cpu_experts(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_experts", lambda module: SimpleNamespace(isa=ISA))


@pytest.mark.parametrize("isa,dtype", LAYOUTS)
@pytest.mark.parametrize("intermediate,padded", [(32, 32), (16, 32), (48, 64)])
def test_prepacked_in_place_equals_vllms_processing(monkeypatch, isa, dtype, intermediate,
                                                     padded):
    monkeypatch.setattr(kernels, "cpu_experts", lambda module: SimpleNamespace(isa=isa))
    experts, hidden = 4, 64
    gen = torch.Generator().manual_seed(intermediate)
    old = [torch.randn(experts, 2 * intermediate, hidden, generator=gen).to(dtype),
           torch.randn(experts, hidden, intermediate, generator=gen).to(dtype)]
    new = [torch.randn_like(t, dtype=torch.float32).to(dtype) for t in old]
    live = vllm_processed(*old, padded, isa)  # the engine as loaded with the old weights
    storages = [live.w13_weight.data_ptr(), live.w2_weight.data_ptr()]
    kernels.prepack_experts(live, {"w13_weight": new[0], "w2_weight": new[1]})
    fresh = vllm_processed(*new, padded, isa)  # a fresh engine loaded with the new ones
    for attr in ("w13_weight", "w2_weight"):
        assert torch.equal(getattr(live, attr).view(torch.uint8),
                           getattr(fresh, attr).view(torch.uint8)), attr
    # written into the same storage: the kernel and every view of the weights stay valid
    assert [live.w13_weight.data_ptr(), live.w2_weight.data_ptr()] == storages
    reference = {"w13_weight": new[0], "w2_weight": new[1]}
    assert kernels.packed_expert_mismatches(live, reference, [""]) == []
    reference["w2_weight"] = old[1]
    assert kernels.packed_expert_mismatches(live, reference, [""]) == [
        "w2_weight (prepacked experts)"]


def test_a_shape_that_is_no_padding_is_refused_before_anything_is_written(as_cpu_experts):
    live = vllm_processed(torch.zeros(2, 64, 32), torch.zeros(2, 32, 32), 32)
    before = [live.w13_weight.clone(), live.w2_weight.clone()]
    with pytest.raises(MappingError, match=r"w2_weight: vLLM holds \(2, 32, 32\)"):
        kernels.prepack_experts(live, {"w13_weight": torch.ones(2, 64, 32),
                                              "w2_weight": torch.ones(2, 32, 48)})
    assert torch.equal(live.w13_weight, before[0]) and torch.equal(live.w2_weight, before[1])
