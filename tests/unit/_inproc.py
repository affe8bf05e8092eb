"""An in-process stand-in for :class:`reshard.comm.Comm`: every rank is a thread of this
process, messages go through per-pair mailboxes. Cheap enough to run the real executor
(checks, schedules, packing, unpacking) thousands of times inside a property test.

A receive takes the message whose position matches its own posting position (as the
real backends do, whatever order the waits come in). ``World(by_tag=True)`` matches by
tag first, as gloo does; ``by_tag=False`` ignores tags, as NCCL does, so a rank whose
posting order differs from its peer's gets the wrong message."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from reshard.errors import ReshardError


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Box:
    """The messages from one rank to another (under one tag, when matching by tag)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: list[torch.Tensor] = []
        self.posted = 0

    def put(self, data: torch.Tensor) -> None:
        with self.cond:
            self.items.append(data)
            self.cond.notify_all()


class _Recv:
    def __init__(self, box: _Box, buf: torch.Tensor) -> None:
        self.box, self.buf = box, buf
        with box.cond:  # matched at posting: the n-th receive takes the n-th message
            self.index, box.posted = box.posted, box.posted + 1

    def wait(self, timeout: Any = None) -> bool:
        with self.box.cond:
            if not self.box.cond.wait_for(lambda: len(self.box.items) > self.index, 10):
                raise RuntimeError("no message arrived within 10 s")
            data = self.box.items[self.index]
        if data.numel() != self.buf.numel():
            raise RuntimeError(f"message of {data.numel()} B for a {self.buf.numel()} B buffer")
        self.buf.copy_(data)
        return True


class World:
    """What the ranks of one in-process group share."""

    def __init__(self, size: int, *, by_tag: bool = True) -> None:
        self.size, self.by_tag = size, by_tag
        self.boxes: dict[tuple[int, int, int], _Box] = {}
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size

    def box(self, src: int, dst: int, tag: int) -> _Box:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag if self.by_tag else 0), _Box())


class ThreadComm:
    """The few operations the executor uses, for one rank of a :class:`World`."""

    registered = False
    store = None
    backend = "inproc"

    @property
    def matches_by_tag(self) -> bool:
        return self.world.by_tag

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


def run_ranks(size: int, fn: Callable[[ThreadComm], Any], *,
              by_tag: bool = True) -> list[tuple[bool, Any]]:
    """Run ``fn(comm)`` on ``size`` thread ranks; per rank (ok, result or exception)."""
    world = World(size, by_tag=by_tag)
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
