"""Megatron-Core names and shards -> Hugging Face tensors and explicit layouts (plain data).

Each test builds Megatron's local tensors from full Hugging Face tensors the way Megatron
lays them out (interleaved QKV by query group, [gate; up] per TP rank, padded vocabulary,
local experts), then rebuilds the full tensors from the pieces the rules give: every
element must come back, from the right place, and padding must never be covered.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from reshard.errors import MappingError
from reshard.integrations.megatron import Coords, check_family, hf_entries
from reshard.layout import Layout, box_slices

H, HEADS, GROUPS, HD = 8, 4, 2, 4


def coords(**kw) -> Coords:
    return Coords(**{**dict(hidden=H, heads=HEADS, groups=GROUPS, head_dim=HD, vocab=10), **kw})


def rebuild(per_rank: dict[int, tuple[str, torch.Tensor]], c_of) -> dict[str, torch.Tensor]:
    """Full HF tensors from each rank's (Megatron name, local tensor), via the rules,
    also checking that the pieces make a valid explicit layout over the ranks."""
    views: dict[str, dict] = {}
    shapes, out = {}, {}
    for rank, (name, local) in per_rank.items():
        for e in hf_entries(name, local.shape, c_of(rank)):
            shapes[e.name] = e.shape
            views.setdefault(e.name, {})[rank] = e.view
            full = out.setdefault(e.name, torch.full(e.shape, float("nan")))
            for p in e.view.pieces:
                full[box_slices(p.offset, p.size)] = local[box_slices(p.local_offset, p.size)]
    for name in views:
        Layout.explicit(shapes[name], views[name])  # tiles the tensor, no stray overlap
    return out


def test_interleaved_qkv_by_query_group_over_tp2():
    q, k, v = torch.randn(HEADS * HD, H), torch.randn(GROUPS * HD, H), torch.randn(GROUPS * HD, H)
    qpg = HEADS // GROUPS
    groups = [torch.cat([q[g * qpg * HD:(g + 1) * qpg * HD], k[g * HD:(g + 1) * HD],
                         v[g * HD:(g + 1) * HD]]) for g in range(GROUPS)]
    fused = torch.cat(groups)  # Megatron's linear_qkv, full; TP rank r holds group r
    name = "decoder.layers.3.self_attention.linear_qkv.weight"
    got = rebuild({r: (name, fused.chunk(2)[r]) for r in range(2)},
                  lambda r: coords(tp_rank=r, tp_size=2))
    a = "model.layers.3.self_attn."
    assert torch.equal(got[a + "q_proj.weight"], q)
    assert torch.equal(got[a + "k_proj.weight"], k)
    assert torch.equal(got[a + "v_proj.weight"], v)


def test_qkv_bias_is_split_like_its_weight():
    e = hf_entries("decoder.layers.0.self_attention.linear_qkv.bias", (8 * HD,), coords())
    assert [(x.name, x.shape) for x in e] == [
        ("model.layers.0.self_attn.q_proj.bias", (HEADS * HD,)),
        ("model.layers.0.self_attn.k_proj.bias", (GROUPS * HD,)),
        ("model.layers.0.self_attn.v_proj.bias", (GROUPS * HD,))]


def test_fc1_is_gate_shard_then_up_shard_on_each_rank():
    gate, up = torch.randn(12, H), torch.randn(12, H)
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    local = {r: (name, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])) for r in range(2)}
    got = rebuild(local, lambda r: coords(tp_rank=r, tp_size=2))
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], up)


def test_row_parallel_and_replicated():
    o = torch.randn(H, HEADS * HD)
    name = "decoder.layers.1.self_attention.linear_proj.weight"
    got = rebuild({r: (name, o.chunk(2, dim=1)[r]) for r in range(2)},
                  lambda r: coords(tp_rank=r, tp_size=2))
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"], o)
    [e] = hf_entries("decoder.layers.1.self_attention.k_layernorm.weight", (HD,), coords())
    assert e.name == "model.layers.1.self_attn.k_norm.weight" and e.shape == (HD,)


def test_vocab_padding_is_never_covered():
    """Vocabulary 10 padded to 16 over TP2: rank 1 holds rows 8..15, of which 8, 9 real."""
    [e] = hf_entries("output_layer.weight", (8, H), coords(tp_rank=1, tp_size=2))
    assert e.name == "lm_head.weight" and e.shape == (10, H)
    assert [(p.offset, p.size, p.local_offset) for p in e.view.pieces] == [
        ((8, 0), (2, H), (0, 0))]
    with pytest.raises(MappingError, match="fewer than the vocabulary of 10"):
        hf_entries("embedding.word_embeddings.weight", (4, H), coords(tp_size=2))


def test_tied_output_layer_of_the_last_stage_is_not_sent_twice():
    c = coords(tied=True, first_stage=False)
    assert hf_entries("output_layer.weight", (10, H), c) == []


@pytest.mark.parametrize("fmt", [
    "decoder.layers.2.mlp.experts.local_experts.{i}.linear_fc{k}.weight",  # SequentialMLP
    "decoder.layers.2.mlp.experts.linear_fc{k}.weight{i}"])  # grouped GEMM
def test_local_expert_i_of_ep_rank_e_is_global_expert(fmt):
    c = coords(ep_rank=1, ep_size=2, local_experts=4)
    names = [e.name for e in hf_entries(fmt.format(i=1, k=1), (6, H), c)]
    assert names == ["model.layers.2.mlp.experts.5.gate_proj.weight",
                     "model.layers.2.mlp.experts.5.up_proj.weight"]
    [down] = hf_entries(fmt.format(i=3, k=2), (H, 3), c)
    assert down.name == "model.layers.2.mlp.experts.7.down_proj.weight"


def test_expert_tensor_parallel_splits_each_expert():
    gate, up = torch.randn(6, H), torch.randn(6, H)
    name = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    local = {r: (name, torch.cat([gate.chunk(2)[r], up.chunk(2)[r]])) for r in range(2)}
    got = rebuild(local, lambda r: coords(etp_rank=r, etp_size=2, local_experts=1))
    assert torch.equal(got["model.layers.0.mlp.experts.0.gate_proj.weight"], gate)


def test_router_and_shared_experts():
    [r] = hf_entries("decoder.layers.0.mlp.router.weight", (8, H), coords())
    assert r.name == "model.layers.0.mlp.gate.weight"
    names = [e.name for e in hf_entries("decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                                        (12, H), coords())]
    assert names == ["model.layers.0.mlp.shared_expert.gate_proj.weight",
                     "model.layers.0.mlp.shared_expert.up_proj.weight"]


def test_unsupported_names_and_shapes_raise():
    with pytest.raises(MappingError, match="linear_q_down_proj.weight' has no Hugging Face rule"):
        hf_entries("decoder.layers.0.self_attention.linear_q_down_proj.weight", (4, H), coords())
    with pytest.raises(MappingError, match="2 query groups of 4 heads do not split over 4"):
        hf_entries("decoder.layers.0.self_attention.linear_qkv.weight", (8, H),
                   coords(tp_size=4))
    with pytest.raises(MappingError, match="expected 32 rows"):
        hf_entries("decoder.layers.0.self_attention.linear_qkv.weight", (30, H), coords())


def test_family_checks_name_each_mismatch():
    cfg = SimpleNamespace(qk_layernorm=True, add_qkv_bias=False, num_moe_experts=None,
                          gated_linear_unit=True, add_bias_linear=False,
                          multi_latent_attention=False, normalization="RMSNorm")
    check_family(cfg, "qwen3")
    with pytest.raises(MappingError, match=r"not a llama model: qk_layernorm=True \(expected "
                                           r"False\)"):
        check_family(cfg, "llama")
    with pytest.raises(MappingError, match="unknown family 'gpt2'"):
        check_family(cfg, "gpt2")
    cfg.add_bias_linear = True
    with pytest.raises(MappingError, match=r"add_bias_linear=True \(expected False\)"):
        check_family(cfg, "qwen3")
