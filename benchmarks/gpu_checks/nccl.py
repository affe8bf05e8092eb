"""Probe: NCCL on one GPU. An NCCL world of one (the executor's local copies, and a
message to itself), and two NCCL processes on the same device, rank 0 sending to rank 1
(NCCL is expected to refuse this; whatever happens is said)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import reshard as R
from reshard.tools.launch import free_port

from .processes import probe_argv, probe_results, run_logged
from .results import ERROR, FAIL, PASS, Check, one_line, run_check
from .synthetic import one_rank_plan


def probe_nccl_one_rank(args: argparse.Namespace, registered: bool) -> Iterator[Check]:
    """An NCCL world of one: the executor's local copies, and a message to itself."""
    label = "registered" if registered else "stateless"
    names = [f"NCCL world of 1, {label} group: Executor (local copies)",
             f"NCCL world of 1, {label} group: message to itself"]
    try:
        torch.cuda.set_device(0)
        comm = _nccl_comm_of_one(registered)
    except Exception as e:
        yield from (Check(n, ERROR, f"no group: {one_line(e)}") for n in names)
        return
    try:
        yield run_check(names[0], lambda: _executor_local(comm))
        yield run_check(names[1], lambda: _message_to_self(comm))
    finally:
        if registered:
            dist.destroy_process_group()
        else:
            comm.close()


def _nccl_comm_of_one(registered: bool):
    from reshard.comm import Comm

    port, timeout = free_port(), timedelta(seconds=60)
    if registered:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=timeout)
        return Comm.from_group()
    return Comm.from_store("127.0.0.1", port, 0, 1, backend="nccl", timeout=timeout,
                           device=torch.device("cuda", 0))


def _executor_local(comm) -> tuple[str, str]:
    from reshard.executor import Executor

    plan, x, y = one_rank_plan("cuda")
    Executor(plan, comm, method="p2p").run(x, y)
    torch.cuda.synchronize()
    return (PASS, "exact") if torch.equal(x, y) else (FAIL, "the copy differs")


def _message_to_self(comm) -> tuple[str, str]:
    sent = torch.arange(4096, dtype=torch.float32, device="cuda")
    got = torch.zeros_like(sent)
    for work in comm.exchange([(sent, comm.rank)], [(got, comm.rank)]):
        work.wait()
    torch.cuda.synchronize()
    return (PASS, "arrived intact") if torch.equal(sent, got) else (FAIL, "arrived corrupt")


def probe_nccl_peer(args: argparse.Namespace) -> Iterator[Check]:
    """One of two NCCL processes on the same GPU: rank 0 sends a tensor to rank 1."""
    yield run_check(f"rank {args.rank}", lambda: _nccl_peer(args.rank, args.port))


def _nccl_peer(rank: int, port: int) -> tuple[str, str]:
    from reshard.comm import Comm
    from reshard.executor import Executor

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    try:
        src = R.Layout((256, 128), R.Mesh([0]), [R.Replicate()], dtype="float32")
        dst = R.Layout((256, 128), R.Mesh([1]), [R.Replicate()], dtype="float32")
        x = torch.arange(256 * 128, dtype=torch.float32, device="cuda").view(256, 128)
        y = torch.zeros_like(x)
        Executor(R.plan(src, dst), Comm.from_group(), method="p2p").run(
            x if rank == 0 else None, y if rank == 1 else None)
        torch.cuda.synchronize()
        if rank == 0:
            return PASS, "sent"
        return (PASS, "received exact") if torch.equal(x, y) else (FAIL, "received corrupt")
    finally:
        dist.destroy_process_group()


def probe_two_ranks(logs: Path, timeout: float) -> Check:
    """Two NCCL processes on the same GPU, rank 0 sending to rank 1 through the
    executor: NCCL is expected to refuse (a duplicate GPU); whatever happens is said."""
    name = "two NCCL processes on one GPU: Executor p2p, rank 0 -> rank 1"
    port, t0 = free_port(), time.perf_counter()
    paths = [logs / f"probe_nccl-peer_{r}.log" for r in range(2)]
    codes = run_logged([probe_argv("nccl-peer", "--rank", str(r), "--port", str(port))
                        for r in range(2)], paths, timeout)
    ranks = [check for r, (code, path) in enumerate(zip(codes, paths))
             for check in probe_results(f"rank {r}", code, path, timeout)]
    statuses = {c.status for c in ranks}
    status = FAIL if FAIL in statuses else PASS if statuses == {PASS} else ERROR
    detail = "; ".join(f"{c.name}: {c.status}, {c.detail}" for c in ranks)
    return Check(name, status, detail, time.perf_counter() - t0)
