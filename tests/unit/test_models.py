"""Model presets: parameter counts, HF names/shapes, config loading, synthetic models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reshard.sim.models
from reshard.sim.models import (
    PRESETS,
    PUBLISHED_PARAMS,
    ModelSpec,
    TensorSpec,
    load_config,
    model_from_config,
    model_from_path,
    preset,
    synthetic_model,
)

LARGE = sorted(PUBLISHED_PARAMS)


@pytest.fixture(scope="module")
def specs() -> dict[str, ModelSpec]:
    return {name: preset(name) for name in LARGE}


def shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    return spec.by_name[name].shape


def test_models_module_is_pure_python() -> None:
    source = Path(reshard.sim.models.__file__).read_text()
    assert "import torch" not in source and "from torch" not in source


def test_every_large_preset_is_published() -> None:
    assert {n for n in PRESETS if not n.startswith("tiny-")} == set(PUBLISHED_PARAMS)
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2",
                 "llama-3.1-70b", "llama-3.1-8b", "qwen3-8b", "qwen2.5-7b"):
        assert name in PUBLISHED_PARAMS


@pytest.mark.parametrize("name", LARGE)
def test_param_count_matches_published(specs: dict[str, ModelSpec], name: str) -> None:
    spec = specs[name]
    assert spec.num_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)
    assert spec.nbytes == 2 * spec.num_params  # bfloat16
    assert len({t.name for t in spec.tensors}) == len(spec.tensors)


def test_tensor_spec_sizes() -> None:
    t = TensorSpec("w", (3, 4))
    assert (t.numel, t.nbytes, t.dtype) == (12, 24, "bfloat16")
    assert TensorSpec("w", (3, 4), "float32").nbytes == 48
    assert TensorSpec("w", (3, 4), "float8_e4m3fn").nbytes == 12
    assert TensorSpec("b", (5,), "int8").nbytes == 5
    assert TensorSpec("w", (3, 4), "float16").nbytes == 24


def test_llama_names(specs: dict[str, ModelSpec]) -> None:
    s = specs["llama-3.1-8b"]
    assert s.tensors[0].name == "model.embed_tokens.weight"
    assert shape(s, "model.embed_tokens.weight") == (128256, 4096)
    assert shape(s, "model.layers.0.self_attn.q_proj.weight") == (4096, 4096)
    assert shape(s, "model.layers.31.self_attn.k_proj.weight") == (1024, 4096)
    assert shape(s, "model.layers.31.self_attn.o_proj.weight") == (4096, 4096)
    assert shape(s, "model.layers.5.mlp.gate_proj.weight") == (14336, 4096)
    assert shape(s, "model.layers.5.mlp.down_proj.weight") == (4096, 14336)
    assert shape(s, "model.layers.5.post_attention_layernorm.weight") == (4096,)
    assert shape(s, "model.norm.weight") == (4096,)
    assert s.tensors[-1].name == "lm_head.weight"
    assert s.num_layers == 32 and s.family == "llama" and s.name == "llama-3.1-8b"
    assert not any(t.name.endswith(".bias") for t in s.tensors)


def test_qwen3_moe_names(specs: dict[str, ModelSpec]) -> None:
    s = specs["qwen3-30b-a3b"]
    assert shape(s, "model.layers.0.self_attn.q_proj.weight") == (4096, 2048)
    assert shape(s, "model.layers.0.self_attn.q_norm.weight") == (128,)
    assert shape(s, "model.layers.47.self_attn.k_norm.weight") == (128,)
    assert shape(s, "model.layers.0.mlp.gate.weight") == (128, 2048)
    assert shape(s, "model.layers.47.mlp.experts.127.gate_proj.weight") == (768, 2048)
    assert shape(s, "model.layers.47.mlp.experts.127.down_proj.weight") == (2048, 768)
    assert "model.layers.0.mlp.gate_proj.weight" not in s.by_name


def test_qwen3_moe_dense_layers() -> None:
    cfg = {**PRESETS["tiny-qwen3-moe"], "num_hidden_layers": 4, "mlp_only_layers": [0],
           "decoder_sparse_step": 2}
    s = model_from_config(cfg)
    moe = {i for i in range(4) if f"model.layers.{i}.mlp.gate.weight" in s.by_name}
    assert moe == {1, 3}  # layer 0 is mlp-only, layer 2 fails (i + 1) % 2 == 0
    assert shape(s, "model.layers.0.mlp.gate_proj.weight") == (128, 64)
    assert shape(s, "model.layers.1.mlp.experts.7.up_proj.weight") == (32, 64)


def test_deepseek_v3_names(specs: dict[str, ModelSpec]) -> None:
    s = specs["deepseek-v3"]
    a = "model.layers.60.self_attn"
    assert shape(s, f"{a}.q_a_proj.weight") == (1536, 7168)
    assert shape(s, f"{a}.q_a_layernorm.weight") == (1536,)
    assert shape(s, f"{a}.q_b_proj.weight") == (128 * 192, 1536)
    assert shape(s, f"{a}.kv_a_proj_with_mqa.weight") == (576, 7168)
    assert shape(s, f"{a}.kv_a_layernorm.weight") == (512,)
    assert shape(s, f"{a}.kv_b_proj.weight") == (128 * 256, 512)
    assert shape(s, f"{a}.o_proj.weight") == (7168, 16384)
    assert shape(s, "model.layers.2.mlp.gate_proj.weight") == (18432, 7168)
    assert "model.layers.2.mlp.experts.0.gate_proj.weight" not in s.by_name
    assert shape(s, "model.layers.3.mlp.experts.255.up_proj.weight") == (2048, 7168)
    assert shape(s, "model.layers.3.mlp.gate.weight") == (256, 7168)
    assert shape(s, "model.layers.3.mlp.gate.e_score_correction_bias") == (256,)
    assert shape(s, "model.layers.3.mlp.shared_experts.down_proj.weight") == (7168, 2048)
    assert s.num_layers == 61
    assert not any(t.name.startswith("model.layers.61.") for t in s.tensors)  # MTP omitted


def test_kimi_k2_is_deepseek_v3(specs: dict[str, ModelSpec]) -> None:
    s = specs["kimi-k2"]
    assert s.family == "deepseek_v3" and s.config["model_type"] == "kimi_k2"
    assert shape(s, "model.embed_tokens.weight") == (163840, 7168)
    assert shape(s, "model.layers.0.mlp.up_proj.weight") == (18432, 7168)
    assert shape(s, "model.layers.1.mlp.experts.383.down_proj.weight") == (7168, 2048)
    assert shape(s, "model.layers.1.self_attn.q_b_proj.weight") == (64 * 192, 1536)
    assert shape(s, "model.layers.1.self_attn.o_proj.weight") == (7168, 64 * 128)
    experts = sum(".mlp.experts." in t.name for t in s.tensors)
    assert experts == 60 * 384 * 3


def test_qwen2_has_qkv_bias(specs: dict[str, ModelSpec]) -> None:
    s = specs["qwen2.5-7b"]
    assert shape(s, "model.layers.0.self_attn.q_proj.bias") == (3584,)
    assert shape(s, "model.layers.0.self_attn.k_proj.bias") == (512,)
    assert shape(s, "model.layers.27.self_attn.v_proj.bias") == (512,)
    assert "model.layers.0.self_attn.o_proj.bias" not in s.by_name
    assert "model.layers.0.self_attn.q_norm.weight" not in s.by_name


def test_tie_word_embeddings_drops_lm_head() -> None:
    untied = preset("tiny-qwen3")
    tied = model_from_config({**PRESETS["tiny-qwen3"], "tie_word_embeddings": True})
    assert "lm_head.weight" in untied.by_name and "lm_head.weight" not in tied.by_name
    assert untied.num_params - tied.num_params == 512 * 64


def test_dtype_and_unknown_dtype() -> None:
    s = preset("tiny-qwen3", dtype="float32")
    assert {t.dtype for t in s.tensors} == {"float32"} and s.nbytes == 4 * s.num_params
    with pytest.raises(ValueError, match="unknown dtype 'float64'"):
        preset("tiny-qwen3", dtype="float64")


def test_unsupported_model_type() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        model_from_config({"model_type": "gpt2"})


def test_local_config_json_loads(tmp_path) -> None:
    cfg = {**PRESETS["tiny-qwen3-moe"], "architectures": ["Qwen3MoeForCausalLM"]}
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    assert load_config(model_dir) == load_config(model_dir / "config.json") == cfg
    s = model_from_path(model_dir)
    assert s.name == "my-model" and s.family == "qwen3_moe"
    assert s.tensors == preset("tiny-qwen3-moe").tensors


def test_text_config_is_unwrapped() -> None:
    s = model_from_config({"model_type": "kimi_k25", "text_config": PRESETS["tiny-qwen3"]})
    assert s.tensors == preset("tiny-qwen3").tensors


def test_tiny_presets_are_tiny() -> None:
    assert preset("tiny-qwen3").num_params < 200_000
    moe = preset("tiny-qwen3-moe")
    assert moe.num_params < 300_000
    assert sum(".mlp.experts." in t.name for t in moe.tensors) == 2 * 8 * 3


@pytest.mark.parametrize("total", [64 << 20, 256 << 20, 1 << 30])
def test_synthetic_model_hits_byte_target(total: int) -> None:
    s = synthetic_model(total)
    assert s.nbytes == pytest.approx(total, rel=0.05)
    assert {t.dtype for t in s.tensors} == {"float32"}
    assert s.num_layers >= 3 and len(s.tensors) < 500
    assert min(min(t.shape) for t in s.tensors) >= 8
    h = s.config["hidden_size"]
    assert shape(s, "model.layers.0.mlp.up_proj.weight") == (s.config["intermediate_size"], h)
    assert s.config["intermediate_size"] % 64 == 0
    assert s.config["intermediate_size"] == pytest.approx(3.5 * h, rel=0.05)


def test_synthetic_model_options() -> None:
    assert synthetic_model(1 << 30).config["hidden_size"] == 2048
    s = synthetic_model(256 << 20, dtype="bfloat16", hidden=1024, name="bench")
    assert s.name == "bench" and s.nbytes == pytest.approx(256 << 20, rel=0.05)
    with pytest.raises(ValueError, match="multiple of 64"):
        synthetic_model(64 << 20, hidden=100)
    with pytest.raises(ValueError, match="cannot build"):
        synthetic_model(1 << 20, hidden=4096)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(ValueError, match=r"unknown preset 'gpt-5'; known presets: .*kimi-k2"):
        preset("gpt-5")
