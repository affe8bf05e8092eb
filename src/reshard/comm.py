"""The communicator: one process group (registered or stateless) seen through the few
operations the executors need, all in the group's own rank numbers.

Two ways in: :meth:`Comm.from_group` wraps a group of the default world (torchrun,
``init_process_group``); :meth:`Comm.from_store` builds a stateless group over a TCP
store, the way RL frameworks join a trainer job and an inference job that each have
their own world. Everything above this module is identical for both.
"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from reshard.errors import ConfigError

__all__ = ["Comm", "backend_device_types", "collective", "free_port"]

#: How long a finished gloo collective may take to let go of its tensors (see
#: :func:`collective`); it takes microseconds unless its thread is starved of a core.
RELEASE_WAIT_S = 10.0


#: where :func:`free_port` looks first: below the system's ephemeral ports
_PORTS_FROM = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The range the system takes a client socket's own port from (Linux: from
    ``/proc``; elsewhere IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at ``host`` now (a store or a group binds it soon after), outside
    the system's ephemeral range where it can: a port of that range can be handed, before
    its user binds it, to any socket that asks for port 0 (gloo's pair listeners, zmq,
    the process groups a Megatron trainer makes before it meets), and the store then
    cannot listen ("Address already in use": a Megatron trainer job of the tests, seen
    once, while the engine's ranks waited 180 s for its store)."""
    import random

    low, _ = _ephemeral_ports()
    candidates = list(range(_PORTS_FROM, low)) if low > _PORTS_FROM + 100 else []
    # a generator no test seeds: two processes must not walk the same sequence
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket() as s, suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket() as s:  # no such range here: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


class Comm:
    """A process group and its rank; ranks passed to methods are group ranks."""

    def __init__(self, pg: Any, *, registered: bool, store: Any = None, backend: str = "gloo",
                 timeout: timedelta = timedelta(minutes=5), name: str = "reshard") -> None:
        self.pg, self.registered, self.store, self.backend = pg, registered, store, backend
        self.rank, self.size = pg.rank(), pg.size()
        self.timeout, self.name = timeout, name
        self._subgroups: dict[tuple[int, ...], Comm | None] = {}

    @classmethod
    def from_group(cls, group: Any = None) -> Comm:
        """The default world (``group=None``) or one of its subgroups."""
        pg = group if group is not None else dist.group.WORLD
        return cls(pg, registered=True, backend=dist.get_backend(pg))

    @classmethod
    def from_store(cls, host: str, port: int, rank: int, world_size: int, *,
                   backend: str = "gloo", is_server: bool | None = None,
                   timeout: timedelta = timedelta(minutes=5), device: Any = None,
                   token: Any = None, listen: str | None = None) -> Comm:
        """Join a stateless group of ``world_size`` ranks meeting at ``host:port``
        (``token`` and ``listen`` as for :meth:`open_store`)."""
        store = cls.open_store(host, port, rank, world_size, timeout=timeout,
                               is_server=is_server, token=token, listen=listen)
        return cls(_new_pg(store, rank, world_size, backend, timeout, device),
                   registered=False, store=store, backend=backend, timeout=timeout)

    @staticmethod
    def open_store(host: str, port: int, rank: int, world_size: int | None, *,
                   timeout: timedelta = timedelta(minutes=5),
                   is_server: bool | None = None, token: Any = None,
                   listen: str | None = None) -> Any:
        """The TCP store a stateless group meets at (rank 0 hosts it by default), for a
        caller that talks through it before forming the group
        (:meth:`from_existing_store`). The host listens at ``listen`` (an address or an
        interface), else at ``host``; with a token (``token=`` or ``$RESHARD_TOKEN``)
        only ranks holding it get in (:mod:`reshard.store`)."""
        from reshard.store import open_store

        return open_store(host, port, world_size, timeout=timeout, token=token,
                          listen=listen, is_server=rank == 0 if is_server is None
                          else is_server)

    @classmethod
    def from_existing_store(cls, store: Any, rank: int, world_size: int, *,
                            backend: str = "gloo", timeout: timedelta = timedelta(minutes=5),
                            device: Any = None, name: str = "reshard") -> Comm:
        """A stateless group over a store that already exists (for example a
        ``PrefixStore`` over a long-lived ``TCPStore``: one fresh group per membership
        epoch, see :mod:`reshard.refit.elastic`)."""
        return cls(_new_pg(store, rank, world_size, backend, timeout, device),
                   registered=False, store=store, backend=backend, timeout=timeout, name=name)

    @property
    def matches_by_tag(self) -> bool:
        """Whether messages between two ranks match by tag (gloo), or only in the order
        they are posted (NCCL, which ignores tags): then both ends must post one pair's
        messages in the same order, and each rank posts a round's sends and receives in
        one group call so that two ranks exchanging both ways never wait on each other."""
        return self.backend == "gloo"

    # -- point to point ------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]],
                 recvs: Sequence[tuple[torch.Tensor, int]], tag: int = 0) -> list[Any]:
        """Post every send and receive together; return the work handles (receives
        first). Messages between two ranks match by ``tag``, then in posting order."""
        if self.registered and self.backend != "gloo":  # NCCL: one group, posted together
            ops = [dist.P2POp(dist.irecv, t, group=self.pg, group_peer=p, tag=tag)
                   for t, p in recvs]
            ops += [dist.P2POp(dist.isend, t, group=self.pg, group_peer=p, tag=tag)
                    for t, p in sends]
            return dist.batch_isend_irecv(ops) if ops else []
        if self.backend == "nccl" and (sends or recvs):  # a stateless NCCL group
            # one NCCL group call, as batch_isend_irecv makes: posted one by one, a pair
            # exchanging both ways would wait on each other on their shared stream. The
            # group is a ProcessGroupNCCL backend, whose coalescing takes no device
            # (a ProcessGroup's does)
            self.pg._start_coalescing()
            try:
                for t, p in recvs:
                    self.pg.recv([t], p, tag)
                for t, p in sends:
                    self.pg.send([t], p, tag)
            finally:
                work = self.pg._end_coalescing()
            return [work]
        # gloo: straight to the process group; batch_isend_irecv would only loop over
        # the same calls, through a Python layer per message
        works = [self.pg.recv([t], p, tag) for t, p in recvs]
        return works + [self.pg.send([t], p, tag) for t, p in sends]

    # -- collectives ---------------------------------------------------------------------
    def all_gather_object(self, obj: Any, timeout: timedelta | None = None) -> list[Any]:
        """Every rank's ``obj``, in rank order. ``timeout`` bounds the whole call (the
        group's own timeout bounds each of its two collectives otherwise)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        device = _device_for(self.backend)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        if timeout is not None:
            from torch._C._distributed_c10d import AllgatherOptions

            end = time.monotonic() + timeout.total_seconds()
            opts = AllgatherOptions()
            opts.timeout = timeout
            self.collective(lambda: self.pg.allgather([sizes], [size], opts), [size, *sizes])
            opts = AllgatherOptions()
            opts.timeout = timedelta(seconds=max(end - time.monotonic(), 0.001))
            return self._gather_payload(data, sizes, device, opts)
        self.collective(lambda: self.pg.allgather([sizes], [size]), [size, *sizes])
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data.to(device)
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.collective(lambda: self.pg.allgather([outs], [padded]), [padded, *outs])
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes())
                for o, s in zip(outs, sizes)]

    def _gather_payload(self, data, sizes, device, opts) -> list[Any]:
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data.to(device)
        outs = [torch.empty_like(padded) for _ in range(self.size)]
        self.collective(lambda: self.pg.allgather([outs], [padded], opts), [padded, *outs])
        return [pickle.loads(o[:int(s.item())].cpu().numpy().tobytes())
                for o, s in zip(outs, sizes)]

    def all_reduce_max(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
        """Elementwise max over the group, in place; ``timeout`` bounds the call."""
        from torch._C._distributed_c10d import AllreduceOptions

        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        if timeout is not None:
            opts.timeout = timeout
        self.collective(lambda: self.pg.allreduce([tensor], opts), [tensor])

    def collective(self, issue: Callable[[], Any], tensors: Sequence[torch.Tensor]) -> None:
        """Run the collective ``issue()`` posts on ``tensors`` to the end: see
        :func:`collective`."""
        collective(issue, tensors, backend=self.backend)

    def barrier(self) -> None:
        self.all_gather_object(None)

    def subgroup(self, ranks: Sequence[int]) -> Comm | None:
        """A communicator over ``ranks`` (group ranks); every rank of this group must call
        it with the same ranks in the same order. None on ranks outside it."""
        key = tuple(sorted(ranks))
        if key not in self._subgroups:
            self._subgroups[key] = self._make_subgroup(key)
        return self._subgroups[key]

    def _make_subgroup(self, ranks: tuple[int, ...]) -> Comm | None:
        if self.registered:
            glob = [dist.get_global_rank(self.pg, r) for r in ranks]
            pg = dist.new_group(glob, backend=self.backend)  # every rank calls, same order
            if self.rank not in ranks or pg is None or pg == dist.GroupMember.NON_GROUP_MEMBER:
                return None
            return Comm(pg, registered=True, backend=self.backend)
        if self.rank not in ranks:
            return None
        prefix = f"{self.name}/sub/{'-'.join(map(str, ranks))}"
        store = dist.PrefixStore(prefix, self.store)
        pg = _new_pg(store, ranks.index(self.rank), len(ranks), self.backend, self.timeout, None)
        return Comm(pg, registered=False, store=store, backend=self.backend,
                    timeout=self.timeout, name=prefix)

    def abort(self) -> bool:
        """Fail fast: close this rank's connections to every peer of a stateless gloo
        group, so that each peer's pending operations with this rank fail at once
        instead of at their deadline. The group is unusable afterwards. Gloo closes a
        pair whose receive times out; a 1 ms receive per peer does exactly that. Does
        nothing (returns False) on a registered group (the caller's own world) or NCCL."""
        if self.registered or self.backend != "gloo":
            return False
        probe = torch.empty(1, dtype=torch.uint8)
        for peer in range(self.size):
            if peer != self.rank:
                with suppress(RuntimeError):
                    self.pg.recv([probe], peer, _ABORT_TAG).wait(timedelta(milliseconds=1))
        return True

    def close(self) -> None:
        if not self.registered:
            for sub in self._subgroups.values():
                if sub is not None:
                    sub.close()
            self.pg.shutdown() if hasattr(self.pg, "shutdown") else None


def collective(issue: Callable[[], Any], tensors: Sequence[torch.Tensor], *,
               backend: str = "gloo") -> None:
    """Post a collective (``issue()``: its work handle) on ``tensors``, wait for it, and
    on gloo also until the group's worker thread has let go of those tensors.

    Gloo runs a collective on a worker thread, which drops its references to the tensors
    a moment after it marks the work done, so after ``wait()`` returns. Since torch
    2.10 a tensor that C++ still references holds its Python object, so that drop
    decrefs a Python object and takes the GIL. When the collective was a process's last
    (``redistribute`` and then exit), the main thread may reach interpreter shutdown
    first; Python then ends the worker thread inside a C++ destructor and the process
    aborts ("terminate called without an active exception", SIGABRT) after a correct
    run. Waiting here, with the GIL released, until the tensors' C++ reference counts
    are back to what they were closes that window (microseconds when the thread runs;
    at most :data:`RELEASE_WAIT_S`). NCCL's watchdog keeps its tensors longer, by
    design: it is not waited for.
    """
    counted = backend == "gloo" and all(hasattr(t, "_use_count") for t in tensors)
    held = [t._use_count() for t in tensors] if counted else []
    work = issue()
    work.wait()
    del work  # the handle itself holds the tensors
    if not counted:
        return
    end, pause = time.monotonic() + RELEASE_WAIT_S, 1e-5
    while any(t._use_count() > n for t, n in zip(tensors, held)):
        if time.monotonic() > end:
            return
        time.sleep(pause)  # releases the GIL the worker thread is waiting for
        pause = min(2 * pause, 1e-3)


_ABORT_TAG = (1 << 30) + 11  # never sent: receives on it only time out


_BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}  # the memory each backend's messages use


def backend_device_types(backend: str | None) -> frozenset[str] | None:
    """Device types whose tensors a backend's point-to-point messages carry: ``gloo``
    host memory, ``nccl`` CUDA memory, a multi-device backend such as
    ``cpu:gloo,cuda:nccl`` each listed type. None when unknown (nothing is checked)."""
    if not backend:
        return None
    kinds = set()
    for part in backend.lower().split(","):
        device, _, name = part.strip().rpartition(":")
        kind = device or _BACKEND_DEVICES.get(name)
        if kind is None:
            return None
        kinds.add(kind)
    return frozenset(kinds)


def _device_for(backend: str) -> torch.device:
    """Where a group's collective buffers (``all_gather_object``) live."""
    if _BACKEND_DEVICES.get(backend) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _new_pg(store: Any, rank: int, size: int, backend: str, timeout: timedelta,
            device: Any) -> Any:
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, opts)
    raise ConfigError(f"unsupported backend {backend!r}; expected 'gloo' or 'nccl'")
