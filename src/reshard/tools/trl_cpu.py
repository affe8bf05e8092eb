"""What TRL 1.16 needs to train on a CPU, none of it reshard's concern, in one place (the
example ``reshard.tools.trl_grpo`` and its test call :func:`on_cpu` before building a
trainer):

1. **FSDP2 through accelerate**: accelerate 1.16 turns an FSDP plugin into an FSDP run
   only for GPU-like distributed types; on a CPU (``MULTI_CPU``, gloo) it silently trains
   data-parallel instead. The process's state is made to say ``MULTI_GPU`` before the
   trainer builds its ``Accelerator``: the device stays the CPU, the backend gloo, and
   ``fully_shard`` shards the model (its parameters become DTensors).
2. **AsyncGRPO's attention**: its tree attention fetches FlashAttention 3 from the Hub
   (``kernels.get_kernel("kernels-community/flash-attn3")``, in TRL's ``packing._flash_attn``),
   a CUDA kernel. :func:`flash_attn_varlen_func` in torch stands in for it (each packed
   segment's queries over its root-to-segment keys, causal from the bottom right, as
   FlashAttention aligns them).
3. **AsyncGRPO's MFU figure**: it asks ``torch.cuda.get_device_name``; on a CPU there is
   no peak to compare against, so the figure is off (``None``, as TRL does for unknown
   devices).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["flash_attn_varlen_func", "on_cpu"]


def on_cpu() -> None:
    """Apply the three changes above (idempotent); call it before building a trainer."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU  # FSDP2 on the CPU (item 1)
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    kernel = types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)
    packing._flash_attn = lambda: kernel  # item 2
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **kw: None  # item 3


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: float | None = None, causal: bool = True,
                           window_size: tuple[int, int] = (-1, -1), **_: Any) -> torch.Tensor:
    """FlashAttention's varlen call in torch: ``q`` [tokens, heads, dim], ``k``/``v``
    [keys, kv heads, dim]; segment ``s`` of queries ``cu_seqlens_q[s]:[s+1]`` attends to
    keys ``cu_seqlens_k[s]:[s+1]``. No sliding window (the tiny models have none)."""
    if window_size != (-1, -1):
        raise NotImplementedError("the CPU stand-in has no sliding window")
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for s in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        k0, k1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (x[k0:k1].repeat_interleave(groups, 1).transpose(0, 1) for x in (k, v))
        mask = None
        if causal:
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
        out[q0:q1] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=softmax_scale).transpose(0, 1)
    return out
