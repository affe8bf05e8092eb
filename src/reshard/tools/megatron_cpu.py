"""Megatron-Core 0.19.2 training on CPU with gloo: every CUDA assumption patched HERE.

The Megatron trainers of the tests (``tests/integration/_megatron_trainer_job.py``) and
of the RL demo (``python -m reshard.tools.demo_rl --trainer megatron``) import this
module before anything of Megatron; the library itself (``reshard.integrations.megatron``)
patches nothing and reads a live Megatron model as it is. Each patch says why it is
needed; on a GPU with Transformer Engine none of them is wanted. What it enables: a tiny
``GPTModel`` built from the local (non-Transformer-Engine) layer spec, trained with
tensor, pipeline (1F1B, gloo point-to-point) and expert parallelism (allgather token
dispatcher) on CPU processes.

* :func:`patch_megatron_for_cpu`: call once per process, before importing Megatron.
* :func:`init_parallel`: ``torch.distributed`` (gloo) + Megatron's parallel state.
* :func:`build_gpt`: the tiny Qwen3 / Qwen3-MoE / Llama / Qwen2 ``GPTModel`` chunk.
* :func:`train_step`: one optimizer step through Megatron's own forward-backward
  schedule, then the gradient reductions Megatron's ``finalize_model_grads`` would do.
* :func:`reinforce_step`: the same on sampled rollouts (the RL demo's REINFORCE loss).
* :func:`rank_record`: this rank's parameters as they are, with its coordinates, what
  :mod:`reshard.tools.megatron_hf` rebuilds a Hugging Face state dict from.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_PATCHED = False


#: where the Makefile installs triton for the Megatron trainers alone (see below)
TRITON_DIR = Path(sys.prefix) / "megatron-triton"


def _use_triton() -> None:
    """megatron.core imports ``triton`` unconditionally (``pipeline_parallel/schedules.py``
    -> ``transformer/moe/paged_stash.py`` -> GPU kernels defined with ``@triton.jit`` at
    import; more in its fusions and inference modules). CPU training never launches
    them. The venv itself has no triton: the Makefile removes the one vLLM's dependencies
    pull in (vLLM CPU does not use it, and torch changes code paths when it finds one).
    So the Makefile installs triton 3.9.0 into ``.venv/megatron-triton``, and only the
    Megatron trainer processes put it on their path. (A stand-in module does not do:
    Megatron reads ``triton.__version__``, ``tl.int32``... at import, and torch probes
    the same module.)"""
    if importlib.util.find_spec("triton") is not None:
        return
    if not TRITON_DIR.is_dir():
        raise RuntimeError(f"megatron-core needs triton to import; expected it in {TRITON_DIR} "
                           "(make setup installs it there)")
    sys.path.append(str(TRITON_DIR))


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by Megatron's pipeline schedules: ``torch.zeros(...,
    device="cuda")`` (the token counter of every schedule) lands on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def patch_megatron_for_cpu() -> None:
    """Every CUDA assumption of Megatron-Core 0.19.2 met by the CPU training loop."""
    global _PATCHED
    if _PATCHED:
        return
    _use_triton()
    # rotary embeddings (inv_freq), p2p_communication (shape buffers) allocate on
    # torch.cuda.current_device(): the CPU is this process's only device
    torch.cuda.current_device = lambda: torch.device("cpu")
    # p2p_communication synchronizes the CUDA stream after its batched isend/irecv;
    # gloo's waits are already synchronous on CPU
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mrandom

    # the schedules count tokens in torch.zeros(..., device="cuda")
    schedules.torch = _CpuTorch("torch")

    # the CUDA RNG tracker's fork() swaps CUDA generator states around dropout in
    # tensor-parallel regions; the tiny models have no dropout, so fork does nothing
    class _CpuTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self.states_[name] = seed

        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            return contextlib.nullcontext()

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _PATCHED = True


def init_parallel(rank: int, world: int, port: int, *, tp: int = 1, pp: int = 1,
                  ep: int = 1) -> None:
    """gloo process group over ``world`` ranks, then Megatron's parallel state."""
    import torch.distributed as dist

    patch_megatron_for_cpu()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep)


#: the tiny models: hidden 64, 2 (or 4) layers, 4 heads of 32, 2 query groups
TINY = dict(hidden=64, heads=4, groups=2, head_dim=32, ffn=128, vocab=500, padded_vocab=512,
            moe_ffn=32, experts=8, topk=2, eps=1e-6, rope_base=1_000_000.0)


def transformer_config(kind: str, num_layers: int, *, tp: int = 1, pp: int = 1, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = TINY
    moe = kind == "qwen3_moe"
    kw = dict(num_layers=num_layers, hidden_size=t["hidden"], num_attention_heads=t["heads"],
              num_query_groups=t["groups"], kv_channels=t["head_dim"],
              ffn_hidden_size=t["ffn"], normalization="RMSNorm", layernorm_epsilon=t["eps"],
              gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              add_bias_linear=False, add_qkv_bias=kind == "qwen2",
              qk_layernorm=kind in ("qwen3", "qwen3_moe"), hidden_dropout=0.0,
              attention_dropout=0.0, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
              pipeline_dtype=torch.float32,  # asked for whenever pp > 1
              use_cpu_initialization=True, params_dtype=torch.float32,
              bf16=False, fp16=False, init_method_std=0.2,
              gradient_accumulation_fusion=False, bias_activation_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
              bias_dropout_fusion=False, sequence_parallel=False)
    if moe:
        kw.update(num_moe_experts=t["experts"], moe_router_topk=t["topk"],
                  moe_ffn_hidden_size=t["moe_ffn"], moe_token_dispatcher_type="allgather",
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_grouped_gemm=False)
    return TransformerConfig(**kw)


def build_gpt(kind: str, num_layers: int, *, tp: int = 1, pp: int = 1, ep: int = 1,
              seed: int = 0, grouped_gemm: bool = False) -> Any:
    """This rank's ``GPTModel`` chunk (local layer spec), float32, random N(0, 0.2)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = transformer_config(kind, num_layers, tp=tp, pp=pp, ep=ep)
    if grouped_gemm:
        cfg.moe_grouped_gemm = True
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts,
                                    moe_grouped_gemm=grouped_gemm,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
                      + 10 * parallel_state.get_tensor_model_parallel_rank()
                      + 1000 * parallel_state.get_expert_model_parallel_rank())
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=TINY["padded_vocab"],
                     max_sequence_length=512, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=TINY["rope_base"])
    _sync_replicas(model)
    return model


def _sync_replicas(model) -> None:
    """Parameters that Megatron replicates start equal on every replica: TP-replicated
    ones (norms, router) from TP rank 0, data-parallel copies from DP rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    with torch.no_grad():
        for name, p in model.named_parameters():
            expert = ".experts." in name
            if not getattr(p, "tensor_model_parallel", False):
                g = ps.get_tensor_model_parallel_group()
                dist.broadcast(p, dist.get_global_rank(g, 0), group=g)
            g = (ps.get_expert_data_parallel_group() if expert
                 else ps.get_data_parallel_group())
            dist.broadcast(p, dist.get_global_rank(g, 0), group=g)


def batch(step: int, dp_rank: int, seq: int = 16, micro: int = 2) -> list[torch.Tensor]:
    """The tests' synthetic micro-batches: random token ids, seeded by step and DP rank."""
    g = torch.Generator().manual_seed(1000 + 17 * step + dp_rank)
    return [torch.randint(3, TINY["vocab"], (1, seq), generator=g) for _ in range(micro)]


def _optimizer_step(model, opt, micro: list[torch.Tensor], loss_of) -> list[dict]:
    """Micro-batches ``[1, seq]`` (one length) through Megatron's forward-backward schedule
    (1F1B when pp > 1), the gradient reductions, the optimizer step. ``loss_of(i,
    per_token_losses)`` is micro-batch ``i``'s scalar loss from Megatron's per-token cross
    entropy ``[1, seq]`` (Megatron averages it over the micro-batches). Returns the last
    stage's ``[{"loss": ...}]`` per micro-batch (empty elsewhere)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = micro[0].shape[1]
    # Megatron's default mask needs a CUDA kernel path; pass the causal mask
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    pos = torch.arange(seq).unsqueeze(0)
    it = iter(enumerate(micro))

    def forward_step(_data_iterator, m):
        i, ids = next(it)
        labels = torch.roll(ids, -1, dims=1)
        out = m(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels)

        def loss_func(per_token):
            loss = loss_of(i, per_token.float())
            return loss, {"loss": loss.detach()}
        return out, loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=None, model=[model],
        num_microbatches=len(micro), seq_length=seq, micro_batch_size=1, forward_only=False)
    _reduce_grads(model, ps, dist)
    opt.step()
    opt.zero_grad()
    return losses


def train_step(model, opt, step: int) -> float:
    """One step on the synthetic batch of ``step`` (next-token loss). Returns this rank's
    mean loss (0 off the last stage)."""
    from megatron.core import parallel_state as ps

    losses = _optimizer_step(model, opt, batch(step, ps.get_data_parallel_rank()),
                             lambda _i, per_token: per_token.mean())
    return float(sum(d["loss"] for d in losses) / len(losses)) if losses else 0.0


def reinforce_step(model, opt, rollouts: Sequence[tuple[list[int], list[int]]],
                   reward) -> float:
    """One REINFORCE step on this data-parallel rank's ``rollouts`` (prompt ids,
    completion ids), as ``reshard.tools.rl_task.reinforce_step`` takes it with a
    transformers model: loss = -sum_i (r_i - mean r) * log p(completion_i) / n, where
    ``reward(completion)`` gives r_i. One micro-batch per rollout, right-padded to the
    longest (pipeline stages exchange one activation shape; the causal mask keeps the
    padding out of every position that counts). Returns this rank's loss on the last
    stage's first tensor-parallel rank, 0 on the others (so that a sum over ranks counts
    each data-parallel rank once)."""
    from megatron.core import parallel_state as ps

    rewards = torch.tensor([reward(c) for _, c in rollouts], dtype=torch.float32)
    advantages = rewards - rewards.mean()
    seq = max(len(p) + len(c) for p, c in rollouts)
    micro, spans = [], []
    for prompt, completion in rollouts:
        ids = prompt + completion
        micro.append(torch.tensor([ids + [0] * (seq - len(ids))]))
        # position t predicts token t + 1: the completion's tokens are predicted from
        # positions len(prompt) - 1 .. len(ids) - 2
        spans.append((len(prompt) - 1, len(ids) - 1))

    def loss_of(i: int, per_token: torch.Tensor) -> torch.Tensor:
        a, b = spans[i]
        # per-token loss = -log p(label): REINFORCE's -A * log p is A * loss; Megatron
        # divides by the number of micro-batches
        return advantages[i] * per_token[0, a:b].sum()

    losses = _optimizer_step(model, opt, micro, loss_of)
    if not losses or ps.get_tensor_model_parallel_rank() != 0:
        return 0.0
    return float(sum(d["loss"] for d in losses) / len(losses))


def _reduce_grads(model, ps, dist) -> None:
    """What ``finalize_model_grads`` does for these models: q/k layernorms act on each TP
    rank's own heads, so their gradients are summed over TP (else the copies drift);
    data-parallel copies average their gradients (expert weights over the expert-DP
    group)."""
    tp = ps.get_tensor_model_parallel_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if ("q_layernorm" in name or "k_layernorm" in name) and tp > 1:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        expert = ".experts." in name
        g = ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group()
        n = dist.get_world_size(g)
        if n > 1:
            dist.all_reduce(p.grad, group=g)
            p.grad /= n


def local_state(model) -> dict[str, torch.Tensor]:
    """This rank's Megatron parameters as they are (local shards), detached copies."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_record(model, rank: int) -> dict[str, Any]:
    """This rank's parameters (stage-local names), the global layer number of each local
    layer, and its TP / PP / EP / DP coordinates: one rank's share of a step, as
    :func:`reshard.tools.megatron_hf.to_hf` reads it."""
    from megatron.core import parallel_state as ps

    layers = {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    return {"state": local_state(model), "layers": layers,
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "rank": rank}


def save_rank_record(model, rank: int, out_dir: str | Path, step: int,
                     **extra: Any) -> Path:
    """:func:`rank_record` (plus ``extra``) as ``out_dir/step{step}.rank{rank}.pt``,
    written whole (renamed into place)."""
    out = Path(out_dir)
    tmp, path = out / f".step{step}.rank{rank}.pt", out / f"step{step}.rank{rank}.pt"
    torch.save({**rank_record(model, rank), **extra}, tmp)
    tmp.rename(path)
    return path
