"""The trainer side with Hugging Face transformers: tiny models and their sharding.

* :func:`tiny_config` / :func:`build_tiny_model`: a small random model (Qwen3, Qwen3-MoE,
  Llama, Qwen2, Mistral, Mixtral, Gemma 2, Gemma 3 text, DeepSeek-V3, NemotronH) built
  locally (no hub access) and saved with ``save_pretrained`` (bf16 safetensors),
  ``head_dim`` >= 32 so that vLLM's CPU attention accepts it; beside it the word-level
  tokenizer of :func:`tiny_tokenizer` (one word per id), so that transformers'
  ``AutoTokenizer`` and vLLM load it and token ids print as text.
* :func:`shard_fsdp2`: FSDP2 (``fully_shard`` on every decoder layer, then the root).
* :func:`shard_tp`: tensor parallelism with ``parallelize_module`` (q/k/v/gate/up
  column-parallel, o/down row-parallel; ``q_norm``/``k_norm`` replicated with their
  gradients all-reduced, as transformers' own ``replicated_with_grad_allreduce``).
* :func:`refit_params`: ``(params, layouts)`` under the Hugging Face names for
  :class:`reshard.refit.RefitSender` (DTensors keep their own layout, plain replicated
  tensors get a replicated one; wrapper prefixes such as ``_orig_mod.`` are stripped).
* :func:`full_state_dict`, :func:`checkpoint_state_dict`, :func:`greedy_tokens`: the
  references the tests and the demo check vLLM against.
"""

from __future__ import annotations

import itertools
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from reshard.errors import ConfigError
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.placement import Replicate

__all__ = [
    "build_tiny_model", "checkpoint_state_dict", "full_state_dict", "greedy_tokens",
    "hf_name", "load_model", "param_shapes", "refit_params", "save_checkpoint",
    "save_fp8_checkpoint", "shard_fsdp2",
    "shard_tp", "tiny_config", "tiny_tokenizer",
]

_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_fsdp_wrapped_module|_checkpoint_wrapped_module)\.|"
                       r"^module\.")  # torch.compile, FSDP1, activation checkpointing, DDP
_FUSED_EXPERTS = re.compile(r"^(?P<p>.+\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")


def tiny_config(kind: str = "qwen3", **overrides: Any) -> Any:
    """A tiny transformers config: hidden 64, 2 layers, 4 heads of 32, 2 kv heads (Qwen2
    derives its head size from the hidden size: hidden 128 there, as vLLM's CPU attention
    rejects heads of 16). Kinds: ``qwen3``, ``qwen3_moe``, ``llama``, ``qwen2`` (q/k/v
    biases), ``mistral``, ``mixtral`` (MoE), ``gemma2``, ``gemma3`` (text), ``deepseek_v3``
    (MLA + MoE), ``nemotron_h`` (Mamba2 hybrid)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, intermediate_size=128, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if kind == "qwen3":
        return Qwen3Config(**{**common, **overrides})
    if kind == "qwen3_moe":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        return Qwen3MoeConfig(**{**common, **moe, **overrides})
    if kind == "llama":
        return LlamaConfig(**{**common, **overrides})
    if kind == "qwen2":
        return Qwen2Config(**{**common, "hidden_size": 128, **overrides})
    if kind in _MORE_KINDS:
        return _MORE_KINDS[kind](common, overrides)
    raise ConfigError(f"unknown tiny model kind {kind!r}; expected one of 'qwen3', "
                      f"'qwen3_moe', 'llama', 'qwen2', {', '.join(map(repr, _MORE_KINDS))}")


def _mistral(common: dict, overrides: dict) -> Any:
    from transformers import MistralConfig

    return MistralConfig(**{**common, "sliding_window": None, **overrides})


def _gemma3(common: dict, overrides: dict) -> Any:
    """Gemma 3 text: tied embeddings, q/k norms, four norms a layer, one sliding-window
    layer and one full; its (1 + weight) norms and sqrt(hidden) embedding scale live in
    the model code, not in the weights."""
    from transformers import Gemma3TextConfig

    gemma = dict(tie_word_embeddings=True, query_pre_attn_scalar=32, sliding_window=16,
                 layer_types=["sliding_attention", "full_attention"])
    return Gemma3TextConfig(**{**common, **gemma, **overrides})


def _deepseek_v3(common: dict, overrides: dict) -> Any:
    """DeepSeek-V3: MLA (vLLM CPU's MLA backend takes only head size 576 =
    kv_lora_rank 512 + qk_rope_head_dim 64), one dense layer then one MoE layer with a
    shared expert and a sigmoid router with its score-correction bias."""
    from transformers import DeepseekV3Config

    mla = dict(q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
               v_head_dim=32, num_key_value_heads=4, head_dim=64)
    moe = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
               topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
               routed_scaling_factor=1.0, num_nextn_predict_layers=0)
    return DeepseekV3Config(**{**common, **mla, **moe, **overrides})


def _nemotron_h(common: dict, overrides: dict) -> Any:
    """NemotronH: a Mamba2 layer (4 heads of 32, 2 groups, state 16), an attention layer
    and a relu^2 MLP layer."""
    from transformers import NemotronHConfig

    mamba = dict(layers_block_type=["linear_attention", "full_attention", "mlp"],
                 mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
                 conv_kernel=4, expand=2, chunk_size=16, use_mamba_kernels=False)
    base = {k: v for k, v in common.items() if k != "num_hidden_layers"}
    return NemotronHConfig(**{**base, **mamba, **overrides})


def _gemma2(common: dict, overrides: dict) -> Any:
    """Gemma 2: tied embeddings, attention and final logit softcaps, one sliding-window
    layer (64) and one full, a single key/value head (replicated over vLLM's TP ranks)
    and an odd vocabulary (509: padded rows on the last rank)."""
    from transformers import Gemma2Config

    gemma = dict(tie_word_embeddings=True, num_key_value_heads=1, query_pre_attn_scalar=32,
                 sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0, vocab_size=509)
    return Gemma2Config(**{**common, **gemma, **overrides})


def _mixtral(common: dict, overrides: dict) -> Any:
    """Mixtral: every layer a MoE of 4 experts (top 2) with a softmax router; vLLM names
    the block ``block_sparse_moe`` where transformers 5 says ``mlp`` (fused experts in
    memory, per-expert ``w1``/``w2``/``w3`` on disk)."""
    from transformers import MixtralConfig

    moe = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
               sliding_window=None)
    return MixtralConfig(**{**common, **moe, **overrides})


_MORE_KINDS = {"mistral": _mistral, "gemma3": _gemma3, "deepseek_v3": _deepseek_v3,
               "nemotron_h": _nemotron_h, "gemma2": _gemma2, "mixtral": _mixtral}


def build_tiny_model(path: str | Path, kind: str = "qwen3", *, seed: int = 0,
                     std: float = 0.2, **overrides: Any) -> Path:
    """Build a random tiny model and ``save_pretrained`` it (bf16) into ``path``.

    Matrices are drawn from N(0, std) (wider than the default init, so that greedy
    outputs are far from ties); norms keep their ones."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind, **overrides)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    model.config.dtype = torch.bfloat16
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(path)
    return path


#: The tiny tokenizer's first words, in order (then made-up words of two or three
#: syllables fill the vocabulary).
_TEXT = """
the trainer sends its weights to an engine that answers with words and after every step
a new version of each layer moves from one layout into another so rank by rank only the
bytes a shard needs travel over the wire while old tokens wait in cache for fresh keys
model prompt reward loss batch token head expert query value gate norm bias row column
plan mesh slice block page queue group stage pipe tensor vector matrix sum mean max zero
one two three four five six seven eight nine ten red blue green gold grey white black
river stone cloud wind rain snow sun moon star tree leaf root seed bird fish wolf bear
fox deer owl cat dog horse road bridge tower gate door room wall field hill lake sea
ship boat sail map key lamp fire ice salt bread milk tea cup bowl coin ring bell drum
song book page line word name story light dark warm cold fast slow high low near far
early late small large short long old young true false open closed left right up down
"""
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _tiny_vocabulary(num_words: int) -> list[str]:
    """``num_words`` distinct words: those of :data:`_TEXT`, then made-up words (``ba``...``zu``
    syllables, two then three of them)."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    words = list(dict.fromkeys(_TEXT.split()))
    seen = set(words)
    for n in (2, 3):
        for parts in itertools.product(syllables, repeat=n):
            if len(words) >= num_words:
                return words[:num_words]
            word = "".join(parts)
            if word not in seen:
                seen.add(word)
                words.append(word)
    raise ConfigError(f"tiny tokenizer: at most {len(words)} words, asked for {num_words}")


def tiny_tokenizer(vocab_size: int, max_length: int = 512) -> Any:
    """A word-level tokenizer of exactly ``vocab_size`` ids, made locally with the
    ``tokenizers`` library (no hub access), as a transformers fast tokenizer
    (``save_pretrained`` writes ``tokenizer.json`` and ``tokenizer_config.json``).

    Ids 0, 1, 2 are ``<pad>``, ``<s>``, ``</s>`` (as in :func:`tiny_config`), the last
    id is ``<unk>`` (out of the way of token-id prompts that use low ids), every other id
    one word (:func:`_tiny_vocabulary`): any sequence of ids decodes to words separated by
    spaces. Encoding splits on whitespace and starts with ``<s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    if vocab_size <= len(specials) + 1:
        raise ConfigError(f"tiny tokenizer: vocab_size must exceed {len(specials) + 1} (its "
                          f"special tokens), got {vocab_size}")
    words = specials + _tiny_vocabulary(vocab_size - len(specials) - 1) + ["<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """``from_pretrained`` of a local directory, eager attention, training mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 attn_implementation="eager")
    return model.train()


def save_checkpoint(model_dir: str | Path, state: Mapping[str, torch.Tensor],
                    out: str | Path) -> Path:
    """``state`` (a full state dict in the model's in-memory names) saved in float32 as a
    Hugging Face checkpoint of ``model_dir``'s model in ``out``: what a fresh engine of
    one step loads (it casts on load as a sender casts on send). A tied embedding may be
    given once (as a trainer sends it)."""
    model = load_model(model_dir, torch.float32)
    if model.config.tie_word_embeddings and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state)
    model.config.dtype = torch.float32
    model.save_pretrained(out, safe_serialization=True)
    for name in _TOKENIZER_FILES:  # the model's tokenizer goes with it
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, Path(out) / name)
    return Path(out)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_fp8_checkpoint(model_dir: str | Path, state: Mapping[str, torch.Tensor],
                        out: str | Path) -> Path:
    """``state`` (full, in checkpoint names) saved as an FP8 block checkpoint of
    ``model_dir``'s model in ``out``, as DeepSeek-V3 and Qwen3 FP8 checkpoints are laid
    out: the linear weights in float8_e4m3fn with their float32 ``weight_scale_inv``
    (the reference quantizer, :func:`reshard.integrations.vllm.fp8.fp8_state`), the rest
    in float32, and ``quantization_config`` in ``config.json``: what a fresh FP8 engine
    of one step loads."""
    import json

    from safetensors.torch import save_file

    from reshard.integrations.vllm.fp8 import FP8_BLOCK_CONFIG, fp8_state

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    full = {n: t.detach().float().contiguous() for n, t in state.items()}
    save_file(fp8_state(full), str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = dict(FP8_BLOCK_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*_TOKENIZER_FILES, "generation_config.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copyfile(Path(model_dir) / name, out / name)
    return out


def _layers(model: Any) -> Sequence[Any]:
    return model.model.layers


def shard_fsdp2(model: Any, mesh: Any = None) -> Any:
    """FSDP2 over ``mesh`` (default: the whole world): every decoder layer, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_tp(model: Any, mesh: Any = None) -> Any:
    """Megatron-style tensor parallelism over ``mesh`` (default: the whole world).

    Embeddings, norms and ``lm_head`` stay replicated plain tensors; ``q_norm`` and
    ``k_norm`` act on each rank's own heads, so their gradients are summed over the
    ranks after backward (otherwise the replicas drift apart)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    if getattr(model.config, "num_experts", None) or getattr(model.config,
                                                             "num_local_experts", None):
        raise NotImplementedError("shard_tp covers dense models; shard MoE models with "
                                  "shard_fsdp2")
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    group = mesh.get_group()
    for layer in _layers(model):
        parallelize_module(layer, mesh, plan)
        for norm in (getattr(layer.self_attn, "q_norm", None),
                     getattr(layer.self_attn, "k_norm", None)):
            for p in norm.parameters() if norm is not None else ():
                p.register_post_accumulate_grad_hook(
                    lambda p: dist.all_reduce(p.grad, group=group))
    model._reshard_tp_mesh = mesh
    return model


def hf_name(name: str) -> str:
    """A parameter name without FSDP / compile / DDP wrapper prefixes."""
    return _WRAPPERS.sub(lambda m: m.group(1) or "", name)


def refit_params(model: Any, ranks: Sequence[int] | None = None
                 ) -> tuple[dict[str, Any], dict[str, Layout]]:
    """``(params, layouts)`` for :class:`reshard.refit.RefitSender`, by HF name.

    DTensors keep their own layout; plain tensors (replicated under tensor parallelism,
    and persistent buffers) get a replicated layout over ``ranks`` (default: the whole
    world)."""
    import torch.distributed as dist

    params, layouts = {}, {}
    world = list(ranks) if ranks is not None else list(range(dist.get_world_size()))
    for name, p in _checkpoint_tensors(model):
        params[name] = p
        if hasattr(p, "placements") and hasattr(p, "to_local"):
            layouts[name] = Layout.from_dtensor(p)
        else:
            layouts[name] = Layout(tuple(p.shape), Mesh(world), [Replicate()], p.dtype)
    return params, layouts


def _checkpoint_tensors(model: Any) -> list[tuple[str, Any]]:
    """(HF name, tensor) of every parameter and every persistent buffer (DeepSeek-V3's
    router ``e_score_correction_bias``: in the checkpoint, not trained): what an
    inference engine loads."""
    out = [(hf_name(n), p) for n, p in model.named_parameters()]
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            if b is not None and bname not in module._non_persistent_buffers_set:
                out.append((hf_name(f"{mname}.{bname}" if mname else bname), b))
    return out


def param_shapes(model: Any) -> dict[str, list[int]]:
    """HF name -> global shape of every parameter and persistent buffer (what a
    receiver must map)."""
    return {n: list(p.shape) for n, p in _checkpoint_tensors(model)}


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and persistent buffers by HF name; a collective
    under FSDP2 / TP."""
    out = {}
    for name, p in _checkpoint_tensors(model):
        data = p.detach()
        out[name] = (data.full_tensor() if hasattr(data, "full_tensor") else data).clone()
    return out


#: Families whose checkpoint names the MoE block otherwise than transformers 5 does in
#: memory (``mlp``, experts ``gate_proj``/``up_proj``/``down_proj``): model_type -> (block,
#: gate, up, down) as ``save_pretrained`` writes them.
_CHECKPOINT_MOE = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_MLP = re.compile(r"\.mlp\.(?=gate\.|experts\.)")


def checkpoint_state_dict(state: Mapping[str, torch.Tensor], model_type: str | None = None
                          ) -> dict[str, torch.Tensor]:
    """The on-disk checkpoint form of a state dict: transformers 5's fused experts
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) split into
    per-expert ``experts.{e}.{gate,up,down}_proj.weight``, as ``save_pretrained`` does;
    for Mixtral (``model_type``) the router and experts under ``block_sparse_moe`` and
    the experts' ``w1`` / ``w3`` / ``w2``."""
    block, *names = _CHECKPOINT_MOE.get(model_type or "", ("mlp", "gate_proj", "up_proj",
                                                             "down_proj"))
    gate_n, up_n, down_n = names
    out = {}
    for name, t in state.items():
        m = _FUSED_EXPERTS.match(name)
        if not m:
            out[_MLP.sub(f".{block}.", name)] = t
            continue
        p = _MLP.sub(f".{block}.", m["p"] + ".")[:-1]
        for e in range(t.shape[0]):
            if m["w"] == "down_proj":
                out[f"{p}.{e}.{down_n}.weight"] = t[e]
            else:
                gate, up = t[e].chunk(2, dim=0)
                out[f"{p}.{e}.{gate_n}.weight"] = gate
                out[f"{p}.{e}.{up_n}.weight"] = up
    return out


@torch.no_grad()
def greedy_tokens(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int
                  ) -> list[list[int]]:
    """Greedy continuation of each token-id prompt (no EOS stop, no KV cache)."""
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        new: list[int] = []
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[0, -1]
            nxt = int(torch.argmax(logits.float()))
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        out.append(new)
    return out
