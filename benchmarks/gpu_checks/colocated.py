"""Probe: the colocated transport (``method="colocated"``, CUDA IPC) as a colocated RL
job uses it. Two processes on one device, each a trainer rank (tp2) and an engine rank
(tp1,dp2): every engine tensor checked after a first refit, after the trainer updated
its weights in place (queued on the device, not yet done: the transport must wait for
it) and after it reallocated them; then a steady-state refit of ``--model``'s first
decoder layers (up to 1 GiB) timed."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from math import prod

import reshard as R
from reshard.sim.models import PRESETS, model_from_config
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.launch import free_port
from reshard.tools.synthetic import fill_local, matches

from .environment import is_cuda
from .processes import PROBE_TIMEOUT, spawn_context, spawned_child
from .results import ERROR, FAIL, PASS, Check, one_line, run_check
from .synthetic import rank_tensors

COLOCATED_SRC, COLOCATED_DST = "tp2", "tp1,dp2"  # each process: a trainer and an engine rank
COLOCATED_BYTES = 1 << 30  # at most this much of --model's decoder layers is timed


def colocated_name(device: str) -> str:
    kind = "CUDA IPC" if is_cuda(device) else "shared host memory (debug)"
    return (f"colocated transport over {kind}: 2 processes, each trainer "
            f"{COLOCATED_SRC} + engine {COLOCATED_DST}")


def colocated_plan(model: str, layers: int | None = None, pattern: str = ""):
    """``model``'s tensors (those matching ``pattern``; ``layers`` decoder layers) from
    trainer tp2 on ranks 0, 1 to engine tp1,dp2 on the same ranks: each engine rank reads
    half of every weight from its own process and half from the other one."""
    config = dict(PRESETS[model])
    if layers is not None:
        config["num_hidden_layers"] = layers
    tensors = [t for t in model_from_config(config, name=model).tensors
               if re.search(pattern, t.name)]
    return R.plan(model_layouts(tensors, ParallelSpec.parse(COLOCATED_SRC)),
                  model_layouts(tensors, ParallelSpec.parse(COLOCATED_DST)))


def colocated_timed_layers(model: str) -> int:
    """The most decoder layers of ``model`` whose weights fit in ``COLOCATED_BYTES``."""
    total = int(PRESETS[model]["num_hidden_layers"])
    one = sum(prod(t.src.shape) * t.src.itemsize
              for t in colocated_plan(model, 1, r"\.layers\.").tensors)
    return max(1, min(total, COLOCATED_BYTES // max(one, 1)))


def probe_colocated(args: argparse.Namespace) -> Iterator[Check]:
    """Two processes on one device, both trainer and engine ranks, refit through
    ``Executor(method="colocated")``: every engine tensor checked after a first refit, one
    after the trainer updated its weights in place (on the device, asynchronously: the
    transport must wait for it) and one after it reallocated them (exported again); then
    a timed steady-state refit of ``--model``'s first decoder layers."""
    yield run_check(colocated_name(args.device), lambda: _colocated_pair(args))


def _colocated_pair(args: argparse.Namespace) -> tuple[str, str]:
    ctx, port = spawn_context(), free_port()
    outbox = ctx.Queue()
    with spawned_child(ctx, colocated_rank, 1, port, args.device, args.model, args.repeats,
                       outbox):
        mine = _colocated_rank(0, port, args.device, args.model, args.repeats)
        status, detail = outbox.get(timeout=PROBE_TIMEOUT)
    worst = next((s for s in (FAIL, ERROR) if s in (mine[0], status)), PASS)
    return worst, f"rank 0: {mine[1]}; rank 1: {detail}"


def colocated_rank(rank: int, port: int, device: str, model: str, repeats: int,
                   outbox) -> None:
    """Rank 1 of :func:`probe_colocated` (top level: spawn imports it)."""
    try:
        outbox.put(_colocated_rank(rank, port, device, model, repeats))
    except Exception as e:
        outbox.put((ERROR, one_line(e)))


def _colocated_rank(rank: int, port: int, device: str, model: str,
                    repeats: int) -> tuple[str, str]:
    from reshard.comm import Comm
    from reshard.executor import Executor

    comm = Comm.from_store("127.0.0.1", port, rank, 2, backend="gloo",
                           timeout=timedelta(seconds=PROBE_TIMEOUT))
    try:
        plan = colocated_plan("tiny-qwen3")
        ex = Executor(plan, comm, method="colocated")
        src = {t.name: fill_local(t.src, rank).to(device) for t in plan.tensors}
        dst = rank_tensors(plan, rank, "unpack", device)
        wrong = []
        for salt, how in ((0, "first"), (1, "updated in place"), (2, "reallocated")):
            if how == "updated in place":
                for t in plan.tensors:  # queued on the device, not yet done when run starts
                    src[t.name].copy_(fill_local(t.src, rank, salt).to(device, non_blocking=True))
            elif how == "reallocated":
                src = {t.name: fill_local(t.src, rank, salt).to(device) for t in plan.tensors}
            ex.run(src, dst)
            bad = [t.name for t in plan.tensors
                   if not matches(t.dst, rank, dst[t.name].cpu(), salt)]
            if bad:
                wrong.append(f"{how}: {len(bad)} of {len(plan.tensors)} wrong, first {bad[0]}")
        exports = ex._runner.exports
        if wrong:
            return FAIL, "; ".join(wrong)
        timed = _colocated_timed(comm, rank, device, model, repeats)
        return PASS, (f"{len(plan.tensors)} tensors exact after 3 refits ({exports} "
                      f"exports); {timed}")
    finally:
        comm.close()


def _colocated_timed(comm, rank: int, device: str, model: str, repeats: int) -> str:
    """Median seconds of a steady-state colocated refit of ``model``'s first decoder
    layers (random bytes; correctness was checked on the tiny model)."""
    from reshard.executor import Executor

    layers = colocated_timed_layers(model)
    plan = colocated_plan(model, layers, r"\.layers\.")
    ex = Executor(plan, comm, method="colocated")
    src, dst = (rank_tensors(plan, rank, side, device) for side in ("pack", "unpack"))
    stats = ex.run(src, dst)  # exports and maps once
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ex.run(src, dst, check=False)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    moved = stats.bytes_local + stats.bytes_received
    return (f"{model} {layers} layers: {moved / 1e6:.1f} MB per engine rank "
            f"({stats.bytes_received / 1e6:.1f} MB from the other process) in "
            f"{seconds * 1e3:.1f} ms = {moved / seconds / 1e9:.1f} GB/s (median of "
            f"{repeats}, both processes on one {device})")
