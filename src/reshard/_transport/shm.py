"""The colocated transport: ranks on one machine read each other's tensors in place.

Each source rank exports its local tensors once -- their storage moved into shared
memory (``share_memory_``, in place: every view of it follows) and named by the file
descriptor that holds it and a token never given twice (fd numbers and addresses of
freed storages come back) -- and again only when a tensor's storage changed (a trainer
that reshards, offloads or reallocates between refits). Each destination rank maps the
exported storages (``/proc/<pid>/fd/<fd>``, once per storage) and copies the plan's
regions straight from them into its targets: no communicator carries weights, no
staging arena, no full tensor anywhere. The group carries only the exports and two
small collectives per run: one before the copies (every source's values are in place;
every export known; any rank's problem refused on all) and one after them (no source
may change what a reader still reads).

Host tensors are exported as above; CUDA tensors with CUDA IPC handles (torch's own
``reduce_tensor``/``rebuild_cuda_tensor``, whose reference counts keep a storage alive
while a reader maps it), named by the device's UUID so that processes with different
``CUDA_VISIBLE_DEVICES`` find the same GPU; a reader in the exporter's own process
uses the tensor itself (CUDA cannot map its own handles). A source rank waits for its
devices before the first collective (its last writes are done before anyone reads) and
a reader for its copies before the second. Every rank of the plan must share the
machine; ranks on other machines are refused.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from reshard._transport.runner import RunStats
from reshard.comm import Comm
from reshard.errors import TransferError
from reshard.layout import box_slices
from reshard.planner import Plan

__all__ = ["SharedMemoryRunner", "machine_id"]


def machine_id() -> str:
    """Which machine (and mount of /proc) this process is on: ranks that agree here can
    map each other's shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


class SharedMemoryRunner:
    """One rank's colocated runs of one plan (exports and mappings kept across runs)."""

    def __init__(self, plan: Plan, comm: Comm) -> None:
        self.plan, self.comm, self.rank = plan, comm, comm.rank
        self.progress: Callable[[int, int], None] | None = None
        self.deadline: float | None = None  # time.monotonic() by which every wait ends
        self.broken = False
        self.checksum = None
        self.exports = 0  # how many tensors this rank has exported (first run, changes)
        self._exported: dict[str, tuple] = {}  # name -> identity of what was exported
        self._mapped: dict[tuple[int, str], torch.Tensor] = {}  # (src rank, name) -> view
        self._storages: dict[tuple, torch.UntypedStorage] = {}  # (pid, fd, ptr) -> map
        self._copies = [(t.name, tr) for t in plan.tensors for tr in t.transfers(self.rank)
                        if tr.dst_rank == self.rank]
        self._total = sum(tr.nbytes for _, tr in self._copies)
        self._reads = {(tr.src_rank, name) for name, tr in self._copies
                       if tr.src_rank != self.rank}
        # what other ranks read of this rank's tensors: exported (never anything else)
        self._exports = sorted({t.name for t in plan.tensors for tr in t.transfers(self.rank)
                                if tr.src_rank == self.rank != tr.dst_rank})

    def run(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> RunStats:
        """Export what changed, learn the others' exports, copy this rank's regions."""
        self.broken = False
        mine, problem = self._export(src)
        views = self._gather((machine_id(), mine, problem))
        self._refuse(views)
        for r, (_, exports, _) in enumerate(views):
            for name, spec in exports.items():
                if (r, name) in self._reads:
                    self._mapped[(r, name)] = self._map(spec)
        if any(exports for _, exports, _ in views):
            self._drop_unused()
        stats = self._copy(src, dst)
        _synchronize(dst[name] for name, _ in self._copies)  # the copies are done
        self._gather(None)  # readers done: the sources may change their tensors again
        return stats

    # -- exports -----------------------------------------------------------------------
    def _export(self, src: Mapping[str, torch.Tensor]) -> tuple[dict[str, tuple], str | None]:
        out: dict[str, tuple] = {}
        tokens: dict[int, int] = {}  # storage address -> its token, in this export
        try:
            for name in self._exports:
                tensor = src[name]
                if not self._unchanged(name, tensor):  # first run, or it moved
                    out[name] = _export_spec(tensor, tokens)
                    self._exported[name] = _identity(tensor)
            _synchronize(src[n] for n in self._exports)  # its last writes are done
        except Exception as e:  # a source that cannot be read: refused on every rank
            return {}, f"rank {self.rank}: exporting a source tensor failed ({e!r})"
        self.exports += len(out)
        return out, None

    def _unchanged(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the very storage and view exported before. The storage
        is held by a weak reference: a freed one never matches a new one that happens
        to reuse its address or file descriptor."""
        held = self._exported.get(name)
        return (held is not None and held[0]() is tensor.untyped_storage()
                and held[1:] == _identity(tensor)[1:])

    def _refuse(self, views: list[tuple[str, dict, str | None]]) -> None:
        problems = [p for _, _, p in views if p]
        if problems:
            raise TransferError(f"{problems[0]}; this run must be discarded")
        machines = {m for m, _, _ in views}
        if len(machines) > 1:
            raise TransferError(f"the colocated transport needs every rank on one machine; "
                                f"the ranks are on {len(machines)}: use method='reshard'")

    # -- mappings and copies -------------------------------------------------------------
    def _map(self, spec: tuple) -> torch.Tensor:
        if spec[0] == "cuda":
            return self._map_cuda(spec)
        _, pid, token, fd, nbytes, offset, shape, stride, dtype = spec
        # by token, never by fd or address: a freed storage's fd number and address are
        # soon reused by the next one shared
        key = ("cpu", pid, token)
        storage = self._storages.get(key)
        if storage is None:
            try:
                storage = torch.UntypedStorage.from_file(f"/proc/{pid}/fd/{fd}", shared=True,
                                                         nbytes=nbytes)
            except (OSError, RuntimeError) as e:
                raise TransferError(f"rank {self.rank}: cannot map the storage exported by "
                                    f"process {pid} (freed, or that process is gone): "
                                    f"{e}") from e
            self._storages[key] = storage
        view = torch.empty(0, dtype=getattr(torch, dtype))
        return view.set_(storage, offset, shape, stride)

    def _map_cuda(self, spec: tuple) -> torch.Tensor:
        _, pid, token, uuid, args = spec
        if pid == os.getpid():  # a rank of this very process (threads): no IPC needed
            tensor = _IN_PROCESS.get(token)
            if tensor is None:
                raise TransferError(f"rank {self.rank}: a CUDA tensor exported in this "
                                    "process was freed before it was read")
            return tensor
        import inspect

        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        call = inspect.signature(rebuild_cuda_tensor).bind(*args)
        call.arguments["storage_device"] = _cuda_index(uuid)  # this process's index of it
        key = ("cuda", pid, call.arguments["storage_handle"],
               call.arguments["storage_offset_bytes"])
        try:
            view = rebuild_cuda_tensor(*call.args, **call.kwargs)
        except RuntimeError as e:
            raise TransferError(f"rank {self.rank}: cannot map the CUDA memory exported by "
                                f"process {pid} (freed, that process is gone, or CUDA IPC "
                                f"is not allowed between these processes): {e}") from e
        self._storages[key] = view.untyped_storage()
        return view

    def _drop_unused(self) -> None:
        """Unmap storages no current export uses (a source moved away from them)."""
        used = {(v.untyped_storage().data_ptr()) for v in self._mapped.values()}
        self._storages = {k: s for k, s in self._storages.items() if s.data_ptr() in used}

    def _copy(self, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]
              ) -> RunStats:
        stats = RunStats()
        done = 0
        with torch.no_grad():
            for name, tr in self._copies:
                source = src[name] if tr.src_rank == self.rank else self._mapped[
                    (tr.src_rank, name)]
                region = source[box_slices(tr.src_offset, tr.size)]
                dst[name][box_slices(tr.dst_offset, tr.size)].copy_(region)
                if tr.src_rank == self.rank:
                    stats.bytes_local += tr.nbytes
                else:
                    stats.bytes_received += tr.nbytes
                    stats.num_messages += 1
                done += tr.nbytes
        stats.rounds = 1
        if self.progress is not None:
            self.progress(done, self._total)
        return stats

    def _gather(self, obj: Any) -> list[Any]:
        left = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.001)
        try:
            return self.comm.all_gather_object(
                obj, None if left is None else timedelta(seconds=left))
        except RuntimeError as e:  # a peer died or timed out
            self.broken = True
            raise TransferError(f"rank {self.rank}: colocated transfer failed: "
                                f"{str(e).splitlines()[0]}") from e


def _identity(tensor: torch.Tensor) -> tuple:
    return (weakref.ref(tensor.untyped_storage()), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


#: Tensors this process exported over CUDA, by token, for readers in the same process.
_IN_PROCESS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


def _export_spec(tensor: torch.Tensor, tokens: dict[int, int]) -> tuple:
    """What another process needs to read ``tensor`` in place: ``("cpu", pid, token, fd,
    nbytes, storage offset, shape, stride, dtype)`` (its storage moved into shared memory
    first if it is not there yet) or ``("cuda", pid, token, device UUID, rebuild
    arguments)``. The token names one storage in one export, never reused by this
    process (``tokens``: those given in this export, by storage address)."""
    if tensor.device.type == "cuda":
        return _export_cuda(tensor)
    if tensor.device.type != "cpu":
        raise TransferError(f"the colocated transport reads CPU and CUDA tensors, got one "
                            f"on {tensor.device}")
    if not tensor.is_shared():
        tensor.share_memory_()  # in place: the storage moves, every view follows
    storage = tensor.untyped_storage()
    try:
        fd, nbytes = storage._share_fd_cpu_()
    except RuntimeError as e:  # shared another way (the file_system sharing strategy)
        raise TransferError("the colocated transport needs torch.multiprocessing's "
                            f"file_descriptor sharing strategy: {e}") from e
    if storage.data_ptr() not in tokens:  # one token per storage in an export
        tokens[storage.data_ptr()] = next(_TOKENS)
    token = tokens[storage.data_ptr()]
    return ("cpu", os.getpid(), token, fd, nbytes, tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()),
            str(tensor.dtype).removeprefix("torch."))


def _export_cuda(tensor: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    plain = tensor.detach()  # a plain tensor on the same storage (not a Parameter)
    token = next(_TOKENS)
    _IN_PROCESS[token] = tensor  # held by the caller (its source mapping), weakly here
    _, args = reduce_tensor(plain)
    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return ("cuda", os.getpid(), token, uuid, args)


def _cuda_index(uuid: str) -> int:
    """This process's index of the GPU with that UUID."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise TransferError(f"the colocated transport found no GPU {uuid} in this process "
                        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                        "each reader must see the GPUs of the sources it reads")


def _synchronize(tensors) -> None:
    """Wait for the CUDA devices these tensors are on (nothing for host tensors)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
