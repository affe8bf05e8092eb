"""Deterministic tensor contents for benchmarks and tests, computed per piece.

Every element's value is a hash of its global index, so a rank can fill its source
shard, and check its destination shard, without anyone holding the full tensor.
"""

from __future__ import annotations

import torch

from reshard.layout import Layout, box_slices


def _values(offset, size, shape, salt: int) -> torch.Tensor:
    idx = torch.zeros(size, dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = size[d]
        idx += (torch.arange(offset[d], offset[d] + size[d]) * stride).view(view)
        stride *= shape[d]
    return ((idx * 2654435761 + salt * 97) % 65521 - 32760).to(torch.float32) / 64


def fill_local(layout: Layout, rank: int, salt: int = 0, dtype=None) -> torch.Tensor:
    """The local tensor ``rank`` holds when the global tensor is the synthetic one."""
    view = layout.view(rank)
    dtype = dtype or getattr(torch, layout.dtype)
    out = torch.zeros(view.local_shape, dtype=dtype)
    for p in view.pieces:
        box = box_slices(p.local_offset, p.size)
        out[box] = _values(p.offset, p.size, layout.shape, salt).to(dtype)
    return out


def matches(layout: Layout, rank: int, tensor: torch.Tensor, salt: int = 0) -> bool:
    """Whether ``tensor`` holds exactly this rank's share of the synthetic tensor."""
    view = layout.view(rank)
    for p in view.pieces:
        box = box_slices(p.local_offset, p.size)
        if not torch.equal(tensor[box], _values(p.offset, p.size, layout.shape, salt)
                           .to(tensor.dtype)):
            return False
    return True
