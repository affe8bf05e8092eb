"""Carry out a plan inside one process, with no communication: the reference path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard.errors import TensorMismatchError
from reshard.layout import box_slices
from reshard.planner import SINGLE_NAME, Plan

__all__ = ["execute_local", "execute_schedule_local"]



def execute_local(plan: Plan, src_locals: Mapping[int, Any]) -> dict[int, Any]:
    """Apply ``plan`` to source local tensors and return the destination local tensors.

    For a single-tensor plan, ``src_locals`` maps rank -> tensor and so does the result;
    for a multi-tensor plan, rank -> {name: tensor}. Destination elements that no piece
    covers (padding of explicit layouts) are zero.
    """
    import torch

    if not isinstance(src_locals, Mapping):
        raise TensorMismatchError(f"expected a mapping rank -> source local tensor(s), got "
                                  f"{type(src_locals).__name__}")
    single = len(plan.tensors) == 1 and plan.tensors[0].name == SINGLE_NAME
    srcs = {r: ({SINGLE_NAME: v} if single else v) for r, v in src_locals.items()}
    out: dict[int, dict[str, Any]] = {}
    for t in plan.tensors:
        dtype = getattr(torch, t.dst.dtype)
        for r in t.dst.ranks:
            out.setdefault(r, {})[t.name] = torch.zeros(t.dst.local_shape(r), dtype=dtype)
        for tr in t.transfers():
            src = _source(srcs, t, tr.src_rank)
            dst = out[tr.dst_rank][t.name]
            dst[box_slices(tr.dst_offset, tr.size)] = src[box_slices(tr.src_offset, tr.size)]
    return {r: v[SINGLE_NAME] for r, v in out.items()} if single else out


def _source(srcs: Mapping[int, Mapping[str, Any]], t, rank: int):
    import torch

    try:
        tensor = srcs[rank][t.name]
    except (KeyError, TypeError, IndexError):
        raise TensorMismatchError(
            f"tensor {t.name!r}: no source local tensor given for rank {rank}") from None
    if not isinstance(tensor, torch.Tensor):
        raise TensorMismatchError(f"tensor {t.name!r}: rank {rank} source is a "
                                  f"{type(tensor).__name__}, expected a torch.Tensor")
    expected = t.src.local_shape(rank)
    if tuple(tensor.shape) != expected:
        raise TensorMismatchError(
            f"tensor {t.name!r}: rank {rank} source local shape {list(tensor.shape)}, expected "
            f"{list(expected)}")
    return tensor


def execute_schedule_local(schedule, plan: Plan, src_locals: Mapping[int, Mapping[str, Any]]
                           ) -> dict[int, dict[str, Any]]:
    """Run a schedule's rounds in order inside one process (multi-tensor form): the
    reference for schedules with forwarding hops, which read destination tensors."""
    import torch

    from reshard.schedule import DEST

    out: dict[int, dict[str, Any]] = {}
    for t in plan.tensors:
        for r in t.dst.ranks:
            out.setdefault(r, {})[t.name] = torch.zeros(t.dst.local_shape(r),
                                                        dtype=getattr(torch, t.dst.dtype))
    for hops in schedule.rounds:
        reads = []
        for h in hops:  # a round reads what earlier rounds wrote, never its own writes
            tensor = (out[h.src_rank][h.reads] if h.read_from == DEST
                      else src_locals[h.src_rank][h.name])
            reads.append(tensor[box_slices(h.src_offset, h.size)].clone())
        for h, data in zip(hops, reads):
            out[h.dst_rank][h.name][box_slices(h.dst_offset, h.size)] = data
    return out
