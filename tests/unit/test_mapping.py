"""HF -> vLLM mapping: applying the mapping to a full HF state dict (each rank's
``layout.shard`` written into views of zero logical tensors) gives exactly the per-rank
tensors vLLM's own loaders build. The expected tensors are built here by hand, the way
vLLM's loaders slice and concatenate (QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear, VocabParallelEmbedding, FusedMoE w13/w2), not through the mapping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reshard as R
import reshard.integrations.vllm.mapping
from reshard.integrations.vllm.mapping import MappingError, hf_to_vllm, padded_vocab
from reshard.sim.models import model_from_config

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "vocab_size": 100, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
         "vocab_size": 130, "tie_word_embeddings": False}
QWEN3 = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 200, "tie_word_embeddings": False}
QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
CONFIGS = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}
W13 = "experts.routed_experts.w13_weight"
W2 = "experts.routed_experts.w2_weight"


def full_state(cfg: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: torch.randn(t.shape, generator=g) for t in model_from_config(cfg).tensors}


def vllm_reference(cfg: dict, sd: dict[str, torch.Tensor], tp: int, r: int) -> dict:
    """Rank ``r``'s logical vLLM tensors, sliced and concatenated like vLLM's loaders."""
    nh, nkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or h // nh
    q_size = nh // tp * hd
    kv_size = max(1, nkv // tp) * hd
    kv_rank = r // (tp // nkv) if tp >= nkv else r  # tp_rank // num_kv_head_replicas
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            if f"{a}.q_proj.{kind}" in sd:
                out[f"{a}.qkv_proj.{kind}"] = torch.cat([
                    sd[f"{a}.q_proj.{kind}"][r * q_size:(r + 1) * q_size],
                    sd[f"{a}.k_proj.{kind}"][kv_rank * kv_size:(kv_rank + 1) * kv_size],
                    sd[f"{a}.v_proj.{kind}"][kv_rank * kv_size:(kv_rank + 1) * kv_size]])
        out[f"{a}.o_proj.weight"] = sd[f"{a}.o_proj.weight"].chunk(tp, dim=1)[r]
        for norm in ("q_norm", "k_norm"):
            if f"{a}.{norm}.weight" in sd:
                out[f"{a}.{norm}.weight"] = sd[f"{a}.{norm}.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            name = f"model.layers.{i}.{norm}.weight"
            out[name] = sd[name]
        if f"{m}.gate.weight" in sd:  # MoE block
            out[f"{m}.gate.weight"] = sd[f"{m}.gate.weight"]
            n = cfg["num_experts"]
            out[f"{m}.{W13}"] = torch.stack([torch.cat([
                sd[f"{m}.experts.{e}.gate_proj.weight"].chunk(tp)[r],
                sd[f"{m}.experts.{e}.up_proj.weight"].chunk(tp)[r]]) for e in range(n)])
            out[f"{m}.{W2}"] = torch.stack([
                sd[f"{m}.experts.{e}.down_proj.weight"].chunk(tp, dim=1)[r] for e in range(n)])
        else:
            out[f"{m}.gate_up_proj.weight"] = torch.cat([
                sd[f"{m}.gate_proj.weight"].chunk(tp)[r], sd[f"{m}.up_proj.weight"].chunk(tp)[r]])
            out[f"{m}.down_proj.weight"] = sd[f"{m}.down_proj.weight"].chunk(tp, dim=1)[r]
    out["model.norm.weight"] = sd["model.norm.weight"]
    vocab = cfg["vocab_size"]
    per = padded_vocab(vocab) // tp
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in sd:
            local = torch.zeros(per, h)  # VocabParallelEmbedding: padding rows are zero
            lo = r * per
            real = max(0, min(per, vocab - lo))
            local[:real] = sd[name][lo:lo + real]
            out[name] = local
    return out


def apply_mapping(mapping, sd: dict, rank: int) -> tuple[dict, int]:
    """Zero logical tensors, each HF tensor's shard written into its view; bytes moved."""
    params = mapping.allocate(rank)
    moved = 0
    for name, view in mapping.targets(rank, params).items():
        local = mapping.tensors[name].layout.shard(sd[name], rank)
        view.copy_(local)
        moved += sum(p.numel for p in mapping.tensors[name].layout.view(rank).pieces) * 4
    return params, moved


def expected_bytes(cfg: dict, ref: dict, tp: int, rank: int) -> int:
    """Every logical element but the vocabulary padding, in float32."""
    vocab, per = cfg["vocab_size"], padded_vocab(cfg["vocab_size"]) // tp
    pad = per - max(0, min(per, vocab - rank * per))
    n = sum(t.numel() for t in ref.values())
    n -= sum(pad * cfg["hidden_size"] for k in ref if k in ("model.embed_tokens.weight",
                                                             "lm_head.weight"))
    return n * 4


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_mapping_reproduces_vllm_loaders(family: str, tp: int) -> None:
    cfg = CONFIGS[family]
    sd = full_state(cfg)
    mapping = hf_to_vllm(cfg, tp, dtype="float32")
    for rank in range(tp):
        ref = vllm_reference(cfg, sd, tp, rank)
        params, moved = apply_mapping(mapping, sd, rank)
        assert set(params) == set(ref)
        for name, expected in ref.items():
            assert torch.equal(params[name], expected), (family, tp, rank, name)
        # each rank receives exactly its own shard bytes, never a full sharded tensor
        assert moved == mapping.shard_bytes(rank) == expected_bytes(cfg, ref, tp, rank)
        for t in mapping.tensors.values():
            got = sum(p.numel for p in t.layout.view(rank).pieces)
            assert got <= t.layout.numel
            if t.name.endswith(("norm.weight", "mlp.gate.weight")):
                assert got == t.layout.numel  # replicated
            elif ".k_proj." in t.name or ".v_proj." in t.name:  # heads replicated if tp > nkv
                assert got == t.layout.numel // min(tp, cfg["num_key_value_heads"])
            elif tp > 1:
                assert got < t.layout.numel, (t.name, rank)  # never the full tensor


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_transformers5_experts(tp: int) -> None:
    """transformers 5 holds experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    cfg = QWEN3_MOE
    sd = full_state(cfg)
    fused = dict(sd)
    m = "model.layers.0.mlp"
    n = cfg["num_experts"]
    for e in range(n):
        for w in ("gate", "up", "down"):
            fused.pop(f"{m}.experts.{e}.{w}_proj.weight")
    fused[f"{m}.experts.gate_up_proj"] = torch.stack([torch.cat([
        sd[f"{m}.experts.{e}.gate_proj.weight"], sd[f"{m}.experts.{e}.up_proj.weight"]])
        for e in range(n)])
    fused[f"{m}.experts.down_proj"] = torch.stack([sd[f"{m}.experts.{e}.down_proj.weight"]
                                                   for e in range(n)])
    mapping = hf_to_vllm(cfg, tp, dtype="float32",
                         hf_tensors={k: v.shape for k, v in fused.items()})
    for rank in range(tp):
        ref = vllm_reference(cfg, sd, tp, rank)
        params, moved = apply_mapping(mapping, fused, rank)
        assert all(torch.equal(params[k], v) for k, v in ref.items())
        assert moved == expected_bytes(cfg, ref, tp, rank)


def test_refit_plan_moves_only_shard_bytes() -> None:
    """Through the real planner: an FSDP-sharded trainer (2 ranks) to TP2 inference; the
    bytes each inference rank receives equal its shard size, and the result is exact."""
    cfg, tp, trainers = QWEN3_MOE, 2, 2
    sd = full_state(cfg)
    mapping = hf_to_vllm(cfg, tp, dtype="float32")
    mesh = R.Mesh([0, 1])
    src = {n: R.Layout(tuple(t.shape), mesh, [R.Shard(0)], "float32") for n, t in sd.items()}
    dst = {n: lay.shifted(trainers) for n, lay in mapping.layouts.items()}
    plan = R.plan(src, dst)
    srcs = {r: {n: lay.shard(sd[n], r) for n, lay in src.items()} for r in range(trainers)}
    out = R.execute_local(plan, srcs)
    for rank in range(tp):
        received = sum(t.nbytes for t in plan.transfers(trainers + rank)
                       if t.dst_rank == trainers + rank)
        assert received == mapping.shard_bytes(rank)
        params = mapping.allocate(rank)
        for name, view in mapping.targets(rank, params).items():
            view.copy_(out[trainers + rank][name])
        ref = vllm_reference(cfg, sd, tp, rank)
        assert all(torch.equal(params[k], v) for k, v in ref.items())


def test_load_full_matches_reference() -> None:
    sd = full_state(QWEN2)
    mapping = hf_to_vllm(QWEN2, 2, dtype="float32")
    for rank in range(2):
        got = mapping.load_full(sd, rank)
        ref = vllm_reference(QWEN2, sd, 2, rank)
        assert all(torch.equal(got[k], v) for k, v in ref.items())


def test_layouts_kinds() -> None:
    m = hf_to_vllm(QWEN2, 4)
    lay = m.layouts
    assert lay["model.layers.0.self_attn.q_proj.weight"].placements == (R.Shard(0),)
    assert lay["model.layers.0.self_attn.o_proj.weight"].placements == (R.Shard(1),)
    assert lay["model.layers.0.input_layernorm.weight"].placements == (R.Replicate(),)
    # one kv head, four ranks: every rank holds the same single head (explicit, replicated)
    k = lay["model.layers.0.self_attn.k_proj.weight"]
    assert k.placements is None
    assert {k.view(r).pieces[0].offset for r in range(4)} == {(0, 0)}
    # vocab 130 -> padded 192 -> 48 rows per rank; the last rank holds only padding
    emb = lay["model.embed_tokens.weight"]
    assert [emb.local_shape(r) for r in range(4)] == [(48, 32)] * 4
    assert [sum(p.numel for p in emb.view(r).pieces) // 32 for r in range(4)] == [48, 48, 34, 0]
    slots = m.slots(3)
    assert slots["model.layers.0.self_attn.v_proj.bias"] == reshard.integrations.vllm.mapping.Slot(
        "model.layers.0.self_attn.qkv_proj.bias", rows=(16, 24))  # [q 8 | k 8 | v 8]
    assert slots["model.layers.0.mlp.up_proj.weight"].rows == (12, 24)


def test_tied_embeddings_map_lm_head_to_nothing() -> None:
    cfg = {**LLAMA, "tie_word_embeddings": True}
    m = hf_to_vllm(cfg, 2, hf_tensors={**{t.name: t.shape for t in
                                           model_from_config(cfg).tensors},
                                        "lm_head.weight": (100, 32)})
    assert "lm_head.weight" not in m.tensors and "lm_head.weight" not in m.param_shapes


def test_logical_shapes_are_checked_and_pick_vllm_names() -> None:
    m = hf_to_vllm(QWEN3_MOE, 2)
    shapes = dict(m.param_shapes)
    assert hf_to_vllm(QWEN3_MOE, 2, shapes).param_shapes == shapes
    old = {k.replace("experts.routed_experts.", "experts."): v for k, v in shapes.items()}
    old_names = hf_to_vllm(QWEN3_MOE, 2, old).param_shapes
    assert "model.layers.0.mlp.experts.w13_weight" in old_names
    bad = {**shapes, "model.layers.0.self_attn.qkv_proj.weight": (99, 32)}
    with pytest.raises(MappingError, match="qkv_proj"):
        hf_to_vllm(QWEN3_MOE, 2, bad)
    assert m.uncovered([*shapes, "model.layers.0.extra.weight"]) == ["model.layers.0.extra.weight"]


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(MappingError, match="no rule"):
        hf_to_vllm(QWEN3, 2, hf_tensors={"model.layers.0.weird.weight": (4, 4)})
    with pytest.raises(MappingError, match="divisible"):
        hf_to_vllm(QWEN3, 8)  # 4 attention heads over 8 ranks
    with pytest.raises(MappingError, match="missing or given twice"):
        hf_to_vllm(QWEN3, 2, hf_tensors={"model.layers.0.self_attn.q_proj.weight": (64, 32)})
    with pytest.raises(MappingError, match="outside"):
        hf_to_vllm(QWEN3, 2).slots(2)


def test_model_spec_and_transformers5_config_keys() -> None:
    cfg = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    cfg["num_local_experts"] = 4  # what transformers 5 writes to config.json
    a = hf_to_vllm(cfg, 2)
    b = hf_to_vllm(model_from_config(QWEN3_MOE), 2)
    assert a.param_shapes == b.param_shapes and set(a.tensors) == set(b.tensors)


def test_mapping_module_imports_no_vllm_or_transformers() -> None:
    for module in (reshard.integrations.vllm.mapping, reshard.integrations.vllm.rules):
        source = Path(module.__file__).read_text()
        for mod in ("vllm", "transformers"):
            assert f"import {mod}" not in source and f"from {mod}" not in source, module


def test_mapping_loads_no_vllm_through_its_package():
    """The package's door loads its names on first use: the pure mapping modules beneath
    it load no vLLM (nor does the plugin's module, which vLLM imports in every process)."""
    code = ("import sys, reshard.integrations.vllm.mapping, reshard.integrations.vllm.plugin; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False"]


def test_unmapped_tensors_are_named_on_each_side():
    """An architecture the rules do not know: the first trainer tensor no rule maps and
    the first vLLM parameter no trainer tensor reaches, both named."""
    from reshard.integrations.vllm.mapping import unmapped_sides

    mapping = hf_to_vllm(QWEN3, 2)
    names = {n: t.shape for n, t in mapping.tensors.items()}
    names.pop("model.norm.weight")
    names["model.layers.0.mlp.router_bias"] = (8,)
    clause = unmapped_sides(QWEN3, 2, mapping.param_shapes, names)
    assert "trainer tensors no rule maps: 1 (first: 'model.layers.0.mlp.router_bias')" in clause
    assert "vLLM parameters no trainer tensor reaches: 1 (first: 'model.norm.weight')" in clause
    assert unmapped_sides(QWEN3, 2, mapping.param_shapes,
                          {n: t.shape for n, t in mapping.tensors.items()}) == ""
