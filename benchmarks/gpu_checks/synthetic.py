"""The small plans and tensors the probes share: a tiny Qwen3-shaped plan with synthetic
sources, a single-tensor plan inside one rank, and a rank's random or zero tensors."""

from __future__ import annotations

from math import prod

import torch

import reshard as R
from reshard.sim.models import PRESETS, model_from_config
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.synthetic import fill_local


def tiny_problem(device: str, src: str = "tp4", dst: str = "tp2,dp2"):
    """A tiny Qwen3-shaped plan ``src`` -> ``dst`` and every source rank's synthetic
    tensors on ``device`` (rank -> {name: tensor})."""
    model = model_from_config(PRESETS["tiny-qwen3"], name="tiny-qwen3")
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    plan = R.plan(model_layouts(model.tensors, s),
                  model_layouts(model.tensors, d, first_rank=s.world_size))
    sources = {r: {t.name: fill_local(t.src, r).to(device) for t in plan.tensors
                   if r in t.src.rank_set} for r in range(s.world_size)}
    return plan, sources


def one_rank_plan(device: str):
    """A single-tensor plan inside rank 0 (local copies only), its source and a zero
    destination on ``device``."""
    src = R.Layout((256, 128), R.Mesh([0]), [R.Shard(0)], dtype="float32")
    dst = R.Layout((256, 128), R.Mesh([0]), [R.Shard(1)], dtype="float32")
    x = torch.arange(256 * 128, dtype=torch.float32, device=device).view(256, 128)
    return R.plan(src, dst), x, torch.zeros_like(x)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bytes of ``shape`` and ``dtype`` (comparisons are of bytes: NaNs do not
    matter)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(prod(shape) * itemsize, dtype=torch.uint8, device=device)
    return raw.random_(0, 256).view(dtype).view(shape)


def rank_tensors(plan, rank: int, side: str, device: str) -> dict[str, torch.Tensor]:
    """``rank``'s source tensors (pack) or zero destination tensors (unpack)."""
    out = {}
    for t in plan.tensors:
        layout = t.src if side == "pack" else t.dst
        if rank in layout.rank_set:
            shape, dtype = layout.local_shape(rank), getattr(torch, layout.dtype)
            out[t.name] = (random_tensor(shape, dtype, device) if side == "pack"
                           else torch.zeros(shape, dtype=dtype, device=device))
    return out


def plan_dtypes(plan) -> dict[str, torch.dtype]:
    return {t.name: getattr(torch, t.dst.dtype) for t in plan.tensors}
