"""Probe: CUDA IPC between two processes on one device. This one packs a tiny model's
regions (rank 0 of tp1 -> rank 1 of tp1) into its arena, which the other maps (CUDA
IPC; shared memory on the host), copies into its own arena and unpacks, round by round;
the other checks every tensor."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

from reshard.schedule import flat_schedule
from reshard.tools.synthetic import matches

from .environment import is_cuda
from .processes import spawn_context, spawned_child
from .results import FAIL, PASS, Check, one_line, run_check
from .staging import copy_all, make_stager
from .synthetic import plan_dtypes, rank_tensors, tiny_problem
from .timing import sync

IPC_BUDGET = 1 << 30


def ipc_name(device: str) -> str:
    kind = "CUDA IPC" if is_cuda(device) else "shared host memory (debug)"
    return f"{kind} between two processes: one packs, the other unpacks"


def probe_cuda_ipc(args: argparse.Namespace) -> Iterator[Check]:
    """Two processes on one device: this one packs a tiny model's regions (rank 0 of tp1
    -> rank 1 of tp1) into its arena, which the other maps (CUDA IPC; shared memory on
    the host), copies into its own arena and unpacks, round by round; the other checks
    every tensor."""
    yield run_check(ipc_name(args.device), lambda: _ipc_transfer(args.device))


def _ipc_transfer(device: str) -> tuple[str, str]:
    ctx = spawn_context()
    to_child, from_child = ctx.Queue(), ctx.Queue()
    with spawned_child(ctx, ipc_receiver, to_child, from_child, device):
        return _ipc_send(to_child, from_child, device)


def _ipc_send(to_child, from_child, device: str) -> tuple[str, str]:
    plan, sources = tiny_problem(device, "tp1", "tp1")
    stager = make_stager("library", flat_schedule(plan, IPC_BUDGET), 0, plan_dtypes(plan),
                         device)
    arena = stager.arenas["pack"]
    if not is_cuda(device):  # shared now, not by the queue's feeder thread while we write
        arena.share_memory_()
    to_child.put(arena)  # shared, not copied
    t0 = time.perf_counter()
    for msgs in stager.messages("pack"):
        copy_all(stager, "pack", [msgs], sources[0], {})
        sync(device)
        to_child.put([(a, b) for a, b, _, _ in msgs])
        reply = from_child.get(timeout=60)
        if reply != "copied":
            raise RuntimeError(f"the receiving process: {reply}")
    to_child.put(None)
    ok, detail = from_child.get(timeout=60)
    if ok is None:
        raise RuntimeError(f"the receiving process: {detail}")
    return (PASS if ok else FAIL), f"{detail} in {time.perf_counter() - t0:.2f} s"


def ipc_receiver(inbox, outbox, device: str) -> None:
    """The receiving process of :func:`probe_cuda_ipc` (top level: spawn imports it)."""
    try:
        outbox.put(_ipc_receive(inbox, outbox, device))
    except Exception as e:
        outbox.put((None, one_line(e)))


def _ipc_receive(inbox, outbox, device: str) -> tuple[bool, str]:
    peer_arena = inbox.get(timeout=60)
    plan, _ = tiny_problem("cpu", "tp1", "tp1")
    stager = make_stager("library", flat_schedule(plan, IPC_BUDGET), 1, plan_dtypes(plan),
                         device)
    dst = rank_tensors(plan, 1, "unpack", device)
    rounds, arena = iter(stager.messages("unpack")), stager.arenas["unpack"]
    count = 0
    while (spans := inbox.get(timeout=60)) is not None:
        msgs = next(rounds)
        for (a, b), (start, stop, _, _) in zip(spans, msgs):
            arena[start:stop].copy_(peer_arena[a:b])
        copy_all(stager, "unpack", [msgs], {}, dst)
        sync(device)
        count += 1
        outbox.put("copied")
    ok = all(matches(t.dst, 1, dst[t.name].cpu()) for t in plan.tensors)
    return ok, f"{len(dst)} tensors {'exact' if ok else 'WRONG'} after {count} rounds"
