"""A trainer job and an inference job as one set of local processes, for tests and
benchmarks of the refit API: ranks ``0..T-1`` run a :class:`RefitSender`, ranks
``T..T+I-1`` a :class:`RefitReceiver`; they meet at a TCP store like two real jobs.

Parameter values are synthetic per version (``reshard.tools.synthetic``), so every receiver
checks every refit bit for bit without anyone holding a full tensor."""

from __future__ import annotations

from datetime import timedelta

import torch

import reshard as R
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.synthetic import fill_local, matches

T, I = 2, 2  # noqa: E741


def trainer_layouts(scale: int = 1) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(T)))
    h = 64 * scale
    return {"embed": R.Layout((4 * h, h), mesh, [R.Shard(0)]),
            "qkv": R.Layout((3 * h, h), mesh, [R.Shard(1)]),
            "mlp": R.Layout((h, 4 * h), mesh, [R.Shard(0)]),
            "norm": R.Layout((h,), mesh, [R.Replicate()])}


def inference_layouts(scale: int = 1, dtype: str = "float32") -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(I)))
    h = 64 * scale
    return {"embed": R.Layout((4 * h, h), mesh, [R.Shard(0)], dtype),
            "qkv": R.Layout((3 * h, h), mesh, [R.Shard(0)], dtype),
            "mlp": R.Layout((h, 4 * h), mesh, [R.Shard(1)], dtype),
            "norm": R.Layout((h,), mesh, [R.Replicate()], dtype)}


def make_side(rank: int, port: int, scale: int = 1, **kwargs):
    """(sender or receiver, local tensors by name, layouts, side rank)."""
    opts = dict(host="127.0.0.1", port=port, trainer_size=T, inference_size=I,
                timeout=timedelta(seconds=60))
    opts.update(kwargs)
    if rank < T:
        layouts = trainer_layouts(scale)
        params = {n: fill_local(lay, rank, salt=0) for n, lay in layouts.items()}
        return RefitSender(params, layouts=layouts, rank=rank, **opts), params, layouts, rank
    r = rank - T
    layouts = inference_layouts(scale)
    targets = {n: torch.zeros(lay.local_shape(r)) for n, lay in layouts.items()}
    return RefitReceiver(targets, layouts, rank=r, **opts), targets, layouts, r


def set_version(tensors, layouts, side_rank: int, version: int) -> None:
    for n, lay in layouts.items():
        tensors[n].copy_(fill_local(lay, side_rank, salt=version))


def holds(tensors, layouts, side_rank: int, version: int) -> bool:
    return all(matches(lay, side_rank, tensors[n], salt=version) for n, lay in layouts.items())
