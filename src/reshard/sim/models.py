"""Model presets: the weight tensors (names, shapes, dtype) of real LLMs.

Everything is derived from Hugging Face ``config.json`` values, in pure Python (no torch,
no network). Names are the exact HF checkpoint names (``model.layers.{i}.self_attn.q_proj
.weight``, ``model.embed_tokens.weight``, ``lm_head.weight`` ...) and shapes follow the
``nn.Linear`` convention ``(out_features, in_features)``.

Supported ``model_type`` values: ``llama``, ``qwen2`` (q/k/v biases), ``qwen3`` (per-head
q/k RMSNorm), ``qwen3_moe`` and ``deepseek_v3`` (MLA + routed/shared experts; ``kimi_k2``
is the same architecture). A multimodal wrapper with a ``text_config`` is unwrapped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from reshard.errors import ConfigError

__all__ = [
    "DTYPE_BYTES", "PRESETS", "PUBLISHED_PARAMS", "ModelSpec", "TensorSpec", "dtype_bytes",
    "load_config", "model_from_config", "model_from_path", "preset", "synthetic_model",
]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1,
                               "int8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name without the ``torch.`` prefix)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named weight tensor: its shape and element dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class ModelSpec:
    """A model's full list of weight tensors (in HF state-dict order) and its config."""

    name: str
    family: str
    tensors: tuple[TensorSpec, ...] = field(repr=False)
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @cached_property
    def num_params(self) -> int:
        """Total number of parameters (elements over all tensors)."""
        return sum(t.numel for t in self.tensors)

    @cached_property
    def nbytes(self) -> int:
        """Total size in bytes."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_layers(self) -> int:
        """Number of decoder layers (``num_hidden_layers``; MTP layers are not built)."""
        cfg = _text_config(self.config)
        if "num_hidden_layers" in cfg:
            return int(cfg["num_hidden_layers"])
        names = (t.name for t in self.tensors if t.name.startswith("model.layers."))
        return len({n.split(".")[2] for n in names})

    @cached_property
    def by_name(self) -> dict[str, TensorSpec]:
        """The tensors keyed by name."""
        return {t.name: t for t in self.tensors}


# ----------------------------------------------------------------------------- builders

Tensors = list[TensorSpec]


def _linear(out: Tensors, prefix: str, shape: tuple[int, int], dt: str, bias: bool = False) -> None:
    out.append(TensorSpec(f"{prefix}.weight", shape, dt))
    if bias:
        out.append(TensorSpec(f"{prefix}.bias", (shape[0],), dt))


def _norm(out: Tensors, prefix: str, size: int, dt: str) -> None:
    out.append(TensorSpec(f"{prefix}.weight", (size,), dt))


def _mlp(out: Tensors, prefix: str, hidden: int, inter: int, dt: str, bias: bool = False) -> None:
    """SwiGLU MLP: gate_proj, up_proj, down_proj."""
    _linear(out, f"{prefix}.gate_proj", (inter, hidden), dt, bias)
    _linear(out, f"{prefix}.up_proj", (inter, hidden), dt, bias)
    _linear(out, f"{prefix}.down_proj", (hidden, inter), dt, bias)


def _experts(out: Tensors, prefix: str, n: int, hidden: int, inter: int, dt: str) -> None:
    """``n`` routed experts ``{prefix}.experts.{e}.{gate,up,down}_proj.weight``."""
    up, down = (inter, hidden), (hidden, inter)
    for e in range(n):
        p = f"{prefix}.experts.{e}"
        out.append(TensorSpec(f"{p}.gate_proj.weight", up, dt))
        out.append(TensorSpec(f"{p}.up_proj.weight", up, dt))
        out.append(TensorSpec(f"{p}.down_proj.weight", down, dt))


def _gqa_attention(out: Tensors, cfg: dict[str, Any], p: str, dt: str) -> None:
    """Llama / Qwen2 / Qwen3 grouped-query attention (+ Qwen3's q_norm/k_norm)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    qwen2 = cfg["model_type"] == "qwen2"
    qkv_bias = qwen2 or bool(cfg.get("attention_bias", False))
    o_bias = not qwen2 and bool(cfg.get("attention_bias", False))
    _linear(out, f"{p}.q_proj", (nh * hd, h), dt, qkv_bias)
    _linear(out, f"{p}.k_proj", (nkv * hd, h), dt, qkv_bias)
    _linear(out, f"{p}.v_proj", (nkv * hd, h), dt, qkv_bias)
    _linear(out, f"{p}.o_proj", (h, nh * hd), dt, o_bias)
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        _norm(out, f"{p}.q_norm", hd, dt)
        _norm(out, f"{p}.k_norm", hd, dt)


def _mla_attention(out: Tensors, cfg: dict[str, Any], p: str, dt: str) -> None:
    """DeepSeek-V3 multi-head latent attention (low-rank q and joint compressed kv)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    bias = bool(cfg.get("attention_bias", False))
    if q_rank is None:
        _linear(out, f"{p}.q_proj", (nh * (nope + rope), h), dt)
    else:
        _linear(out, f"{p}.q_a_proj", (q_rank, h), dt, bias)
        _norm(out, f"{p}.q_a_layernorm", q_rank, dt)
        _linear(out, f"{p}.q_b_proj", (nh * (nope + rope), q_rank), dt)
    _linear(out, f"{p}.kv_a_proj_with_mqa", (kv_rank + rope, h), dt, bias)
    _norm(out, f"{p}.kv_a_layernorm", kv_rank, dt)
    _linear(out, f"{p}.kv_b_proj", (nh * (nope + v), kv_rank), dt)
    _linear(out, f"{p}.o_proj", (h, nh * v), dt, bias)


def _dense_mlp(out: Tensors, cfg: dict[str, Any], i: int, p: str, dt: str) -> None:
    _mlp(out, p, cfg["hidden_size"], cfg["intermediate_size"], dt, bool(cfg.get("mlp_bias")))


def _qwen3_moe_mlp(out: Tensors, cfg: dict[str, Any], i: int, p: str, dt: str) -> None:
    """Sparse block (router ``mlp.gate`` + experts) unless layer ``i`` is dense."""
    n, step = cfg.get("num_experts", 0), cfg.get("decoder_sparse_step", 1)
    if i in cfg.get("mlp_only_layers", ()) or n <= 0 or (i + 1) % step:
        _dense_mlp(out, cfg, i, p, dt)
        return
    h = cfg["hidden_size"]
    _linear(out, f"{p}.gate", (n, h), dt)
    _experts(out, p, n, h, cfg["moe_intermediate_size"], dt)


def _deepseek_mlp(out: Tensors, cfg: dict[str, Any], i: int, p: str, dt: str) -> None:
    """Dense MLP for the first ``first_k_dense_replace`` layers, MoE after."""
    n = cfg.get("n_routed_experts")
    if n is None or i < cfg.get("first_k_dense_replace", 0) or i % cfg.get("moe_layer_freq", 1):
        _dense_mlp(out, cfg, i, p, dt)
        return
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    _experts(out, p, n, h, inter, dt)
    _linear(out, f"{p}.gate", (n, h), dt)
    if cfg.get("topk_method", "noaux_tc") == "noaux_tc":
        out.append(TensorSpec(f"{p}.gate.e_score_correction_bias", (n,), dt))
    if cfg.get("n_shared_experts"):
        _mlp(out, f"{p}.shared_experts", h, inter * cfg["n_shared_experts"], dt)


_Part = Callable[..., None]
_FAMILIES: dict[str, tuple[_Part, _Part]] = {
    "llama": (_gqa_attention, _dense_mlp),
    "qwen2": (_gqa_attention, _dense_mlp),
    "qwen3": (_gqa_attention, _dense_mlp),
    "qwen3_moe": (_gqa_attention, _qwen3_moe_mlp),
    "deepseek_v3": (_mla_attention, _deepseek_mlp),
}
_ALIASES = {"kimi_k2": "deepseek_v3"}


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of ``config`` (a multimodal wrapper's ``text_config``)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def _layer(out: Tensors, cfg: dict[str, Any], family: str, i: int, dt: str) -> None:
    attention, mlp = _FAMILIES[family]
    p, h = f"model.layers.{i}", cfg["hidden_size"]
    attention(out, cfg, f"{p}.self_attn", dt)
    mlp(out, cfg, i, f"{p}.mlp", dt)
    _norm(out, f"{p}.input_layernorm", h, dt)
    _norm(out, f"{p}.post_attention_layernorm", h, dt)


def model_from_config(
    config: dict[str, Any], *, name: str | None = None, dtype: str = "bfloat16"
) -> ModelSpec:
    """All weight tensors of the HF model described by ``config`` (a parsed config.json).

    DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``, stored in
    the checkpoint as ``model.layers.61.*``) is inference-optional and not built, matching
    the published 671B total. FP8 ``weight_scale_inv`` tensors are not listed either.
    """
    cfg = _text_config(config)
    model_type = cfg.get("model_type")
    family = _ALIASES.get(model_type, model_type)
    if family not in _FAMILIES:
        known = ", ".join(sorted([*_FAMILIES, *_ALIASES]))
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {known}")
    dtype_bytes(dtype)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out: Tensors = [TensorSpec("model.embed_tokens.weight", (vocab, h), dtype)]
    for i in range(cfg["num_hidden_layers"]):
        _layer(out, cfg, family, i, dtype)
    _norm(out, "model.norm", h, dtype)
    if not cfg.get("tie_word_embeddings", False):
        out.append(TensorSpec("lm_head.weight", (vocab, h), dtype))
    label = name or config.get("_name_or_path") or str(model_type)
    return ModelSpec(label, family, tuple(out), dict(config))


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a local ``config.json`` (``path`` is the file or the directory holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    with p.open(encoding="utf-8") as f:
        return json.load(f)


def model_from_path(path: str | Path, *, dtype: str = "bfloat16") -> ModelSpec:
    """:func:`model_from_config` of a local config.json; named after its directory."""
    p = Path(path)
    name = (p if p.is_dir() else p.parent).resolve().name
    return model_from_config(load_config(p), name=name, dtype=dtype)


# ------------------------------------------------------------------------------ presets

_LLAMA31: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 128256, "rope_theta": 500000.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
_QWEN3: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
_QWEN3_MOE: dict[str, Any] = {
    **_QWEN3, "model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
}
_QWEN25: dict[str, Any] = {
    "model_type": "qwen2", "vocab_size": 152064, "rope_theta": 1000000.0,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_theta": 10000,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}

def _cfg(
    base: dict[str, Any], repo: str, hidden: int, inter: int, layers: int, heads: int, kv: int,
    **extra: Any,
) -> dict[str, Any]:
    """``base`` plus the size keys every HF config has (and ``extra``)."""
    return {**base, "_name_or_path": repo, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, **extra}


_TINY = {"head_dim": 16, "vocab_size": 512}

#: Embedded HF config values (only the keys that matter here), keyed by preset name.
PRESETS: dict[str, dict[str, Any]] = {
    # name:           _cfg(base, HF repo, hidden, intermediate, layers, heads, kv_heads, ...)
    "llama-3.1-8b": _cfg(_LLAMA31, "meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8),
    "llama-3.1-70b": _cfg(_LLAMA31, "meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8),
    "llama-3.1-405b": _cfg(_LLAMA31, "meta-llama/Llama-3.1-405B", 16384, 53248, 126, 128, 8),
    "qwen2.5-7b": _cfg(_QWEN25, "Qwen/Qwen2.5-7B", 3584, 18944, 28, 28, 4),
    "qwen2.5-72b": _cfg(_QWEN25, "Qwen/Qwen2.5-72B", 8192, 29568, 80, 64, 8),
    "qwen3-8b": _cfg(_QWEN3, "Qwen/Qwen3-8B", 4096, 12288, 36, 32, 8),
    "qwen3-32b": _cfg(_QWEN3, "Qwen/Qwen3-32B", 5120, 25600, 64, 64, 8),
    "qwen3-30b-a3b": _cfg(_QWEN3_MOE, "Qwen/Qwen3-30B-A3B", 2048, 6144, 48, 32, 4,
                          moe_intermediate_size=768),
    "qwen3-235b-a22b": _cfg(_QWEN3_MOE, "Qwen/Qwen3-235B-A22B", 4096, 12288, 94, 64, 4,
                            moe_intermediate_size=1536),
    "deepseek-v3": {**_DEEPSEEK_V3, "_name_or_path": "deepseek-ai/DeepSeek-V3"},
    "kimi-k2": {**_DEEPSEEK_V3, "_name_or_path": "moonshotai/Kimi-K2-Instruct",
                "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1,
                "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
                "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
                "max_position_embeddings": 131072},
    "tiny-qwen3": _cfg(_QWEN3, "tiny-qwen3", 64, 128, 2, 4, 2, **_TINY),
    "tiny-qwen3-moe": _cfg(_QWEN3_MOE, "tiny-qwen3-moe", 64, 128, 2, 4, 2, **_TINY,
                           moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
}

#: Published total parameter counts (embeddings and lm_head included).
PUBLISHED_PARAMS: dict[str, float] = {
    "llama-3.1-8b": 8.03e9,
    "llama-3.1-70b": 70.6e9,
    "llama-3.1-405b": 405e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "qwen3-8b": 8.2e9,
    "qwen3-32b": 32.8e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    # Main model without the 14B MTP module (the HF repo's 685B includes it).
    "deepseek-v3": 671e9,
    # The model card says "1T" and the tech report 1.04T; the released checkpoint
    # (no MTP layer) holds 1026.5B, the count the Hugging Face hub reports for it.
    "kimi-k2": 1.0265e12,
}


def preset(name: str, *, dtype: str = "bfloat16") -> ModelSpec:
    """The :class:`ModelSpec` of preset ``name`` (see :data:`PRESETS`)."""
    try:
        config = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
    return model_from_config(config, name=name, dtype=dtype)


# ---------------------------------------------------------------------------- synthetic

_MAX_SYNTHETIC_TENSORS = 500


def _round_to(x: float, quantum: int) -> int:
    return max(quantum, int(x / quantum + 0.5) * quantum)


def _synthetic_config(params: int, hidden: int) -> dict[str, Any]:
    """A llama config of width ``hidden`` whose parameter count is close to ``params``.

    Layers take what fits while leaving a vocabulary of at least ``4 * hidden``; the
    vocabulary (a multiple of 64) then absorbs the remainder.
    """
    head_dim = 128 if hidden >= 2048 and hidden % 128 == 0 else 64
    heads = hidden // head_dim
    kv = max(1, heads // 4)
    inter = _round_to(3.5 * hidden, 64)
    per_layer = 2 * hidden * hidden + 2 * kv * head_dim * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, (params - 8 * hidden * hidden - hidden) // per_layer)
    vocab = _round_to((params - layers * per_layer - hidden) / (2 * hidden), 64)
    return {
        "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": head_dim, "vocab_size": vocab, "tie_word_embeddings": False,
    }


def synthetic_model(
    total_bytes: int, *, dtype: str = "float32", hidden: int | None = None,
    name: str = "synthetic",
) -> ModelSpec:
    """A llama-shaped model of about ``total_bytes`` (within 5%, else ``ValueError``).

    Proportions are realistic: intermediate ~3.5x hidden (multiple of 64), head_dim 64 or
    128, kv heads = heads / 4, embeddings ~1/4 of the total. Without ``hidden`` the width
    is chosen so that about four layers fit (1 GB of float32 -> hidden 2048, 4 layers).
    Every dim is >= 64 and there are fewer than 500 tensors.
    """
    params = total_bytes // dtype_bytes(dtype)
    if hidden is None:
        raw = math.sqrt(params / 68)
        hidden = _round_to(raw, 128 if raw >= 1024 else 64)
    if hidden < 64 or hidden % 64:
        raise ConfigError(f"hidden must be a positive multiple of 64, got {hidden}")
    spec = model_from_config(_synthetic_config(params, hidden), name=name, dtype=dtype)
    if abs(spec.nbytes - total_bytes) > 0.05 * total_bytes:
        raise ConfigError(f"cannot build ~{total_bytes} bytes with hidden={hidden} "
                         f"(closest: {spec.nbytes}); pick another hidden size")
    if len(spec.tensors) >= _MAX_SYNTHETIC_TENSORS:
        raise ConfigError(f"hidden={hidden} needs {len(spec.tensors)} tensors for "
                         f"{total_bytes} bytes; pick a larger hidden size")
    return spec
