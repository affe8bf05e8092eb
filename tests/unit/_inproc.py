"""An in-process stand-in for :class:`reshard.comm.Comm`: every rank is a thread of this
process, messages go through queues. Cheap enough to run the real executor (checks,
schedules, packing, unpacking) thousands of times inside a property test."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reshard.errors import ReshardError


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Recv:
    def __init__(self, box: queue.Queue, buf: torch.Tensor) -> None:
        self.box, self.buf = box, buf

    def wait(self, timeout: Any = None) -> bool:
        data = self.box.get(timeout=10)
        if data.numel() != self.buf.numel():
            raise RuntimeError(f"message of {data.numel()} B for a {self.buf.numel()} B buffer")
        self.buf.copy_(data)
        return True


class World:
    """What the ranks of one in-process group share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), queue.Queue())


class ThreadComm:
    """The few operations the executor uses, for one rank of a :class:`World`."""

    registered = False
    store = None
    backend = "inproc"

    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.size

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], tag: int = 0) -> list[Any]:
        works: list[Any] = [_Recv(self.world.box(p, self.rank, tag), t) for t, p in recvs]
        for t, p in sends:
            self.world.box(self.rank, p, tag).put(t.detach().clone())
            works.append(_Done())
        return works

    def all_gather_object(self, obj: Any, timeout: Any = None) -> list[Any]:
        self.world.barrier.wait(timeout=10)
        self.world.slots[self.rank] = obj
        self.world.barrier.wait(timeout=10)
        out = list(self.world.slots)
        self.world.barrier.wait(timeout=10)
        return out

    def barrier(self) -> None:
        self.all_gather_object(None)


def run_ranks(size: int, fn: Callable[[ThreadComm], Any]) -> list[tuple[bool, Any]]:
    """Run ``fn(comm)`` on ``size`` thread ranks; per rank (ok, result or exception)."""
    world = World(size)
    out: list[tuple[bool, Any]] = [(False, None)] * size

    def body(rank: int) -> None:
        try:
            out[rank] = (True, fn(ThreadComm(world, rank)))
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out[rank] = (False, e)
            if not isinstance(e, ReshardError):  # a refusal comes after the last collective
                world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        if t.is_alive():
            raise TimeoutError("an in-process rank did not finish within 30 s")
    return out
