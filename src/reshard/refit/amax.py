"""The amax exchange of FP8 block quantization over a process group: each source rank
quantizes its own shard of every tensor, and the blocks split across sources get their
amax from one ``all_reduce(MAX)`` of just those blocks' floats (4 bytes a shared block,
all tensors in one call; no call at all when no block is shared).

:func:`quantize_for_refit` is the step a :class:`~reshard.refit.RefitSender` takes
before every refit into FP8 engine tensors: the FP8 codes and the scales it sends."""

from __future__ import annotations

from collections.abc import Callable, Mapping
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
from reshard.quant.targets import Fp8Refit, scale_name

__all__ = ["exchange_amax", "quantize_for_refit", "quantize_on_rank"]

#: ``reduce(vector)``: the elementwise max of ``vector`` over the exchanging ranks, in place.
Reduce = Callable[[torch.Tensor], None]


def exchange_amax(plan: Fp8Plan, grids: Mapping[str, torch.Tensor], group: Any = None,
                  reduce: Reduce | None = None) -> int:
    """Replace the shared blocks' partial amax in ``grids`` by their max over the group;
    every rank of ``group`` calls it with the same plan. Returns the floats reduced.
    ``reduce`` replaces the all_reduce over ``group`` (a stateless group's own call)."""
    if not plan.num_shared:
        return 0
    vec = torch.cat([shared_amax(grids[t.name], t) for t in plan.tensors])
    if reduce is None:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    else:
        reduce(vec)
    for t, part in zip(plan.tensors, vec.split([len(t.shared) for t in plan.tensors])):
        set_shared(grids[t.name], t, part)
    return vec.numel()


def quantize_on_rank(plan: Fp8Plan, layouts: Mapping[str, Layout],
                     locals_: Mapping[str, torch.Tensor], rank: int,
                     group: Any = None, reduce: Reduce | None = None) -> dict[str, Fp8Shard]:
    """This rank's FP8 shards of every tensor it holds (``rank`` is its rank in the
    layouts, which are the group's ranks); every rank of ``group`` calls it."""
    device = next((x.device for x in locals_.values()), None)
    grids = {t.name: amax_grid(locals_.get(t.name), layouts[t.name], rank, t, device)
             for t in plan.tensors}
    exchange_amax(plan, grids, group, reduce)
    return {t.name: quantize_local(locals_[t.name], layouts[t.name], rank, t,
                                   scales_from_amax(grids[t.name], plan.fmt))
            for t in plan.tensors if rank in layouts[t.name].rank_set}


def quantize_for_refit(fp8: Fp8Refit, src: Mapping[str, torch.Tensor], rank: int,
                       reduce: Reduce) -> dict[str, torch.Tensor]:
    """What source ``rank`` (a group rank of the trainer job) sends for the quantized
    tensors: each one's FP8 codes (its own pieces) and its scales
    (:func:`~reshard.quant.blocks.scale_layout`: the blocks whose first element it
    holds). Every source calls it (``reduce`` exchanges the shared blocks' amax)."""
    with torch.no_grad():
        locals_ = {n: src[n].detach() for n in fp8.names if rank in fp8.layouts[n].rank_set}
        shards = quantize_on_rank(fp8.plan, fp8.layouts, locals_, rank, reduce=reduce)
    out = {}
    for name, shard in shards.items():
        out[name] = shard.qdata
        out[scale_name(name)] = shard.scale_local
    return out
