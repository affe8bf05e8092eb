"""Run a function on N local processes joined in a gloo world: for tests, benchmarks and
the demo. Every process gets ``(rank, world_size, *args)``; results come back in rank
order; an exception on any rank is re-raised here with that rank's traceback; a rank
that does not finish within ``timeout`` is killed, never waited on forever.

The world meets at a store that rank 0 opens on a port the system picks, which it then
tells the other ranks: a port picked beforehand (``free_port``) can be taken by another
program before the store binds it (seen on a GPU machine running four test files at
once: EADDRINUSE)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from reshard.comm import free_port

__all__ = ["free_port", "run_processes", "RankFailed"]


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; the message carries its traceback."""


_MEET_TIMEOUT = timedelta(seconds=120)


def _entry(fn, rank, world_size, port, args, queue, env, init, setup, addr) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            setup(rank)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if init:
            dist.init_process_group("gloo", store=_meet(rank, world_size, port, addr),
                                    rank=rank, world_size=world_size, timeout=_MEET_TIMEOUT)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
        if init:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))


def _meet(rank: int, world_size: int, port: Any, addr: str) -> Any:
    """Rank 0's store on a port the system picks (published in ``port``, a shared int);
    the other ranks' clients of it, once it is published."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore(addr, 0, world_size, is_master=True, timeout=_MEET_TIMEOUT,
                              wait_for_workers=False)
        port.value = store.port
        return store
    end = time.monotonic() + _MEET_TIMEOUT.total_seconds()
    while port.value == 0:
        if time.monotonic() > end:
            raise TimeoutError(f"rank 0 opened no store within {_MEET_TIMEOUT}")
        time.sleep(0.005)
    return dist.TCPStore(addr, port.value, world_size, is_master=False, timeout=_MEET_TIMEOUT)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300,
                  env: dict[str, str] | None = None, init: bool = True,
                  start_method: str = "fork", setup: Callable[[int], None] | None = None,
                  master_addr: str = "127.0.0.1") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return results.

    ``setup(rank)`` runs first in each process (for example to enter a network
    namespace); the gloo world meets at ``master_addr``."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = ctx.Value("i", 0)  # rank 0's store's port, once it listens
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue, env or {},
                                              init, setup, master_addr), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception:  # queue.Empty
                failures.append(f"timed out after {timeout}s waiting for ranks "
                                f"{sorted(set(range(world_size)) - set(results))}")
                break
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world_size)]
