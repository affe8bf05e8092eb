"""The amax exchange of FP8 block quantization over a process group: each source rank
quantizes its own shard of every tensor, and the blocks split across sources get their
amax from one ``all_reduce(MAX)`` of just those blocks' floats (4 bytes a shared block,
all tensors in one call; no call at all when no block is shared)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from reshard.layout import Layout
from reshard.quant.blocks import Fp8Plan
from reshard.quant.fp8 import (
    Fp8Shard,
    amax_grid,
    quantize_local,
    scales_from_amax,
    set_shared,
    shared_amax,
)

__all__ = ["exchange_amax", "quantize_on_rank"]


def exchange_amax(plan: Fp8Plan, grids: Mapping[str, torch.Tensor], group: Any = None) -> int:
    """Replace the shared blocks' partial amax in ``grids`` by their max over the group;
    every rank of ``group`` calls it with the same plan. Returns the floats reduced."""
    if not plan.num_shared:
        return 0
    vec = torch.cat([shared_amax(grids[t.name], t) for t in plan.tensors])
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    for t, part in zip(plan.tensors, vec.split([len(t.shared) for t in plan.tensors])):
        set_shared(grids[t.name], t, part)
    return vec.numel()


def quantize_on_rank(plan: Fp8Plan, layouts: Mapping[str, Layout],
                     locals_: Mapping[str, torch.Tensor], rank: int,
                     group: Any = None) -> dict[str, Fp8Shard]:
    """This rank's FP8 shards of every tensor it holds (``rank`` is its rank in the
    layouts, which are the group's ranks); every rank of ``group`` calls it."""
    device = next((x.device for x in locals_.values()), None)
    grids = {t.name: amax_grid(locals_.get(t.name), layouts[t.name], rank, t, device)
             for t in plan.tensors}
    exchange_amax(plan, grids, group)
    return {t.name: quantize_local(locals_[t.name], layouts[t.name], rank, t,
                                   scales_from_amax(grids[t.name], plan.fmt))
            for t in plan.tensors if rank in layouts[t.name].rank_set}
