"""Timing on the device (CUDA events on a GPU, so that launch gaps count), its own copy
bandwidth (the reference every packing figure is a fraction of), and its memory."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .environment import is_cuda
from .results import FAIL, PASS


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the host)."""
    if is_cuda(device):
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], Any], device: str) -> float:
    if not is_cuda(device):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def time_median(fn: Callable[[], Any], device: str, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up (CUDA events on a GPU, so
    that launch gaps count)."""
    fn()
    sync(device)
    return statistics.median(_time_once(fn, device) for _ in range(repeats))


def measure_copy(device: str, nbytes: int, repeats: int) -> dict[str, Any]:
    """The device's own copy bandwidth: one large ``copy_`` from one buffer to another."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    seconds = time_median(lambda: dst.copy_(src), device, repeats)
    verified = torch.equal(src, dst)
    return {"nbytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "verified": verified, "status": PASS if verified else FAIL}


def free_memory(device: str) -> None:
    """Give back what the last measurement left (the device's cached blocks included)."""
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def reset_peak(device: str) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def peak_memory(device: str) -> int | None:
    """The most device bytes allocated since :func:`reset_peak` (None on the host)."""
    return torch.cuda.max_memory_allocated(torch.device(device)) if is_cuda(device) else None
