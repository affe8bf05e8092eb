"""The models, methods and packed buckets of ``benchmarks/refit_real.py``: each model's
transformers config at its real size, vLLM's weight-transfer backends and why none runs
on a CPU-only host, and how gather-and-broadcast cuts its buckets (as vLLM's
``pack_tensors`` does, so both ends agree).
"""

from __future__ import annotations

from typing import Any

GiB = 1 << 30

_QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=32768, rms_norm_eps=1e-6)
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads of 128, 4 kv heads, experts of
# 768, top-8, vocabulary 151936 untied), 8 layers of 16 experts: 1.38B parameters
_QWEN3_MOE = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=16, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
    max_position_embeddings=40960, rms_norm_eps=1e-6)
#: (transformers model_type, config) of each model, sizes from the published configs.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5)),
    "qwen2.5-1.5b": ("qwen2", _QWEN25_15B),
    "qwen3-moe-1.4b": ("qwen3_moe", _QWEN3_MOE),
    # what fits a 12 GiB share of a 24 GiB host (expected_peak_bytes): Qwen2.5-0.5B, and
    # the shapes above cut to fewer layers and experts
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "qwen2.5-1.5b-12l": ("qwen2", {**_QWEN25_15B, "num_hidden_layers": 12}),
    "qwen3-moe-0.8b": ("qwen3_moe", {**_QWEN3_MOE, "num_hidden_layers": 3, "num_experts": 8}),
    # for developing the benchmark
    "tiny": ("qwen3", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=True)),
    "tiny-moe": ("qwen3_moe", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, vocab_size=4096, tie_word_embeddings=False)),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
METHODS = ("reshard", "gather_broadcast", "disk")

#: vLLM 0.32's weight-transfer backends (vllm/distributed/weight_transfer/) and why none
#: can run on a CPU-only host.
VLLM_BACKENDS = {
    "nccl": "PyNcclCommunicator (NCCL, CUDA only) and torch.cuda streams in its packed "
            "broadcast; its protocol (packed buckets + load_weights in layerwise reload) is "
            "what gather_broadcast runs here over gloo",
    "sparse_nccl": "PyNcclCommunicator and torch.cuda.current_stream (sparse patches)",
    "ipc": "CUDA IPC handles (rebuild_cuda_tensor, torch.cuda.get_device_properties)",
    "nccl_m2n": "ncclReshard (nccl-extensions, CUDA) and torch.cuda streams",
    "sharded_rdt": "Ray Direct Transport over NIXL with torch.cuda streams and events "
                   "(and distributed_executor_backend='ray')",
    "modelexpress": "an external package (ModelExpress), not installed with vLLM",
}


#: vLLM's default packed bucket (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``)
BUCKET_BYTES = GiB
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def packed_buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``meta`` (name, shape, dtype) per packed bucket, cut as vLLM's
    ``pack_tensors`` cuts them: a bucket closes after the tensor that takes it past
    ``bucket_bytes``."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        cur.append(i)
        size += nbytes(shape, dtype)
        if size > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def nbytes(shape: list[int], dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def count_params(kind: str, cfg: dict[str, Any]) -> int:
    """Parameters of the model (built on the meta device; tied tensors once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg))
    return sum(p.numel() for p in model.parameters())


def expected_peak_bytes(params: int) -> int:
    """This run's resident memory at its peak, as measured at Qwen3-0.6B (about 11 GB):
    fp32 trainer shards (4 B a parameter), the engine's bf16 weights and reshard's
    buffers of the same size (2 + 2 B), and about 6 GiB of processes (2 trainer ranks,
    the driver, vLLM's engine core and 2 workers)."""
    return 8 * params + 6 * GiB
