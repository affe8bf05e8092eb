"""HF -> SGLang mapping (``reshard.integrations.sglang.mapping``): SGLang's per-rank
parameter shapes (fused ``qkv_proj`` / ``gate_up_proj``, the vocabulary padded to 64 and
split) all filled from the trainer's HF tensors, each rank's bytes its shard's; the
family gate and the refusals, pinned. Pure Python: no SGLang."""

from __future__ import annotations

import pytest

from reshard.errors import MappingError
from reshard.integrations.sglang.mapping import SGLANG_CHECKED_FAMILIES, check_family, hf_to_sglang
from reshard.sim.models import model_from_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "vocab_size": 500, "tie_word_embeddings": False}


def sglang_shapes(cfg: dict, tp: int) -> dict[str, tuple[int, ...]]:
    """What SGLang's Llama holds per rank (``named_parameters``), written by hand."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd // tp
    vocab = -(-cfg["vocab_size"] // 64) * 64 // tp
    out = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
           "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {f"{p}.self_attn.qkv_proj.weight": (qkv, h),
                f"{p}.self_attn.o_proj.weight": (h, cfg["num_attention_heads"] * hd // tp),
                f"{p}.mlp.gate_up_proj.weight": (2 * inter // tp, h),
                f"{p}.mlp.down_proj.weight": (h, inter // tp),
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,)}
    return out


def hf_tensors(cfg: dict) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.shape) for t in model_from_config(cfg).tensors}


@pytest.mark.parametrize("tp", [1, 2])
def test_every_sglang_parameter_filled_each_rank_its_shard(tp):
    m = hf_to_sglang(LLAMA, tp, sglang_shapes(LLAMA, tp), hf_tensors(LLAMA), "bfloat16")
    assert set(m.param_shapes) == set(sglang_shapes(LLAMA, tp))
    h, real = 64, 500
    # q, k, v, o; gate, up, down; two norms a layer
    whole = 2 * (real * h) + h + 2 * (12 * 32 * h + 3 * 128 * h + 2 * h)
    # the ranks together hold the model once, the 5 norms once per rank, padding nowhere
    replicated = 5 * h * (tp - 1)
    assert sum(m.shard_bytes(r) for r in range(tp)) == 2 * (whole + replicated)
    if tp == 2:  # rank 1 holds 256 - (512 - 500) real vocabulary rows
        assert m.layouts["lm_head.weight"].view(1).pieces[0].numel == 244 * h


def test_a_parameter_no_trainer_tensor_fills_is_refused():
    shapes = sglang_shapes(LLAMA, 2) | {"model.layers.0.self_attn.extra.weight": (4, 4)}
    with pytest.raises(MappingError, match=r"SGLang parameters that no trainer tensor fills: "
                       r"\['model.layers.0.self_attn.extra.weight'\] \(first: "):
        hf_to_sglang(LLAMA, 2, shapes, hf_tensors(LLAMA), "bfloat16")


def test_a_trainer_tensor_no_rule_maps_is_refused():
    tensors = hf_tensors(LLAMA) | {"model.layers.0.adapter.weight": (8, 64)}
    with pytest.raises(MappingError, match=r"no rule maps the Hugging Face tensor "
                       r"'model.layers.0.adapter.weight'"):
        hf_to_sglang(LLAMA, 2, sglang_shapes(LLAMA, 2), tensors, "bfloat16")


def test_family_gate(monkeypatch):
    monkeypatch.delenv("RESHARD_UNCHECKED_FAMILIES", raising=False)
    assert {"llama", "qwen3"} == SGLANG_CHECKED_FAMILIES
    with pytest.raises(MappingError, match=r"model_type 'gemma2' is not among the families "
                       r"whose refit into SGLang was checked end to end \(llama, qwen3\)"):
        check_family({"model_type": "gemma2"})
    assert check_family({"model_type": "gemma2"}, unchecked_ok=True) == "gemma2"
    monkeypatch.setenv("RESHARD_UNCHECKED_FAMILIES", "1")
    assert check_family({"model_type": "gemma2"}) == "gemma2"
    with pytest.raises(MappingError, match="a quantized checkpoint"):
        check_family({"model_type": "llama", "quantization_config": {"quant_method": "fp8"}})


def test_weights_repacked_for_amx_are_refused_at_the_meeting():
    import torch

    from reshard.integrations.sglang.rank import SglangRank

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(4, 4)
    model.proj.use_intel_amx_backend = True  # what SGLang sets where it repacked
    rank = SglangRank.__new__(SglangRank)  # the meeting's step alone, no receiver
    rank.context = type("Context", (), {"model": model})()
    with pytest.raises(MappingError, match=r"SGLang repacked the weights of 1 modules for "
                       r"Intel AMX \(first: 'proj'\)"):
        rank._prepare({})
