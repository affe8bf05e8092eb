"""Probe: correctness on the device, in this process: ``execute_local``,
``execute_schedule_local`` (a flat and a forwarding schedule), the ``"sum"`` and
``"crc32"`` digests of host and device copies of the same bytes, the real ``Executor``
on in-process thread ranks holding device tensors, and a gloo group refusing device
tensors."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from datetime import timedelta

import torch

import reshard as R
from reshard._transport.integrity import digest
from reshard.local import execute_local, execute_schedule_local
from reshard.schedule import DEST, flat_schedule
from reshard.tools.launch import free_port
from reshard.tools.synthetic import matches
from reshard.topology import Topology, domain_schedule

from .environment import is_cuda
from .paths import ROOT
from .results import ERROR, FAIL, PASS, SKIPPED, Check, one_line, run_check
from .sparse import check_sparse_threads
from .synthetic import one_rank_plan, tiny_problem


def verdict(plan, out: dict[int, dict[str, torch.Tensor]]) -> tuple[str, str]:
    """Whether every destination tensor in ``out`` is exactly its synthetic shard."""
    wrong = [f"{t.name} on rank {r}" for t in plan.tensors for r in t.dst.ranks
             if not matches(t.dst, r, out[r][t.name].cpu())]
    total = sum(len(t.dst.ranks) for t in plan.tensors)
    devices = sorted({str(v.device) for per in out.values() for v in per.values()})
    if wrong:
        return FAIL, f"{len(wrong)} of {total} destination tensors wrong, first: {wrong[0]}"
    return PASS, f"{total} destination tensors exact, on {', '.join(devices)}"


def check_execute_local(device: str, default_device: bool) -> tuple[str, str]:
    """``execute_local`` on device sources; with ``default_device`` under
    ``with torch.device(device)``, so that the destinations are made there too."""
    plan, sources = tiny_problem(device)
    if default_device:
        with torch.device(device):
            out = execute_local(plan, sources)
    else:
        out = execute_local(plan, sources)
    return verdict(plan, out)


def check_schedule_local(device: str, forwards: bool) -> tuple[str, str]:
    """``execute_schedule_local`` of a flat schedule, or of a domain schedule whose
    second domain forwards what it received (4 ranks per domain)."""
    plan, sources = tiny_problem(device)
    budget = 4096  # small: many rounds
    schedule = (domain_schedule(plan, Topology.uniform(4), budget) if forwards
                else flat_schedule(plan, budget))
    num_forwards = sum(h.read_from == DEST for _, h in schedule.hops())
    status, detail = verdict(plan, execute_schedule_local(schedule, plan, sources))
    return status, f"{len(schedule.rounds)} rounds, {num_forwards} forwarded hops; {detail}"


def _digest_of(buf: torch.Tensor, kind: str) -> int | str:
    """The digest, or what it raised (so that host and device can still be compared)."""
    try:
        return digest(buf, kind)
    except Exception as e:
        return f"raises {one_line(e)}"


def check_digests(device: str) -> tuple[str, str]:
    """The same bytes digest alike on the host and on ``device`` (several lengths, from
    an aligned and an unaligned first byte), and a flipped bit changes the sum. A case
    that raises on both sides is an error of the digest, not a host/device mismatch."""
    gen = torch.Generator().manual_seed(0)
    wrong, raised, count = [], [], 0
    for n in (0, 5, 64 + 3, 4096 + 3, (1 << 20) + 13):
        host = torch.randint(0, 256, (n + 3,), dtype=torch.uint8, generator=gen)
        on_device = host.to(device)
        for start, kind in ((s, k) for s in (0, 3) for k in ("sum", "crc32")):
            count += 1
            here, there = _digest_of(host[start:], kind), _digest_of(on_device[start:], kind)
            case = f"{kind} of {n + 3 - start} bytes from byte {start}"
            if here != there:
                wrong.append(f"{case}: cpu {here}, {device} {there}")
            elif isinstance(here, str):
                raised.append(f"{case} {here}")
    flipped = on_device.clone()
    flipped[len(flipped) // 2] ^= 1
    if digest(flipped, "sum") == digest(on_device, "sum"):
        wrong.append("the sum missed a flipped bit")
    if wrong:
        return FAIL, f"{len(wrong)} of {count} differ, first: {wrong[0]}"
    equal = f"{count - len(raised)} of {count} digests equal on cpu and {device}"
    if raised:
        return ERROR, f"{equal}; {len(raised)} raise on both, first: {raised[0]}"
    return PASS, f"{equal}; a flipped bit changes the sum"


def load_inproc():
    """tests/unit/_inproc.py (thread ranks standing in for processes), loaded by path."""
    path = ROOT / "tests" / "unit" / "_inproc.py"
    spec = importlib.util.spec_from_file_location("gpu_check_inproc", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"expected the thread-rank helper at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_executor_threads(device: str, method: str, checksum: bool | str) -> tuple[str, str]:
    """The real ``Executor`` (check, schedule, pack, send, unpack) on 8 thread ranks
    whose tensors are on ``device``; ``reshard`` with two fast domains (forwards)."""
    from reshard.executor import Executor

    plan, sources = tiny_problem(device)
    topology = Topology.uniform(4) if method == "reshard" else None

    def rank_fn(comm) -> dict[str, torch.Tensor]:
        r = comm.rank
        dst = {t.name: torch.zeros(t.dst.local_shape(r), dtype=getattr(torch, t.dst.dtype),
                                   device=device) for t in plan.tensors if r in t.dst.rank_set}
        ex = Executor(plan, comm, method=method, topology=topology, checksum=checksum)
        ex.run(sources.get(r, {}), dst)
        return dst

    results = load_inproc().run_ranks(8, rank_fn)
    failed = [(r, got) for r, (ok, got) in enumerate(results) if not ok]
    if failed:
        return ERROR, f"rank {failed[0][0]}: {one_line(failed[0][1])}"
    return verdict(plan, {r: got for r, (_, got) in enumerate(results)})


def check_gloo_refuses(device: str) -> tuple[str, str]:
    """A gloo group of one refuses device tensors before moving a byte (gloo would read
    device memory as host memory)."""
    if not is_cuda(device):
        return SKIPPED, "needs a CUDA device"
    from reshard.comm import Comm
    from reshard.executor import Executor

    comm = Comm.from_store("127.0.0.1", free_port(), 0, 1, backend="gloo",
                           timeout=timedelta(seconds=60))
    try:
        plan, x, y = one_rank_plan(device)
        try:
            Executor(plan, comm, method="p2p").run(x, y)
        except R.TensorMismatchError as e:
            ok = "gloo backend cannot send" in str(e)
            return (PASS, str(e)[:200]) if ok else (FAIL, f"refused, but: {e}")
        return FAIL, "the executor ran device tensors over gloo instead of refusing them"
    finally:
        comm.close()


def correctness_checks(device: str) -> list[Check]:
    """Every in-process correctness check, on ``device``."""
    checks: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("execute_local", lambda: check_execute_local(device, False)),
        ("execute_local, default device set", lambda: check_execute_local(device, True)),
        ("execute_schedule_local, flat schedule", lambda: check_schedule_local(device, False)),
        ("execute_schedule_local, forwarding schedule",
         lambda: check_schedule_local(device, True)),
        ("digest sum/crc32, host vs device", lambda: check_digests(device)),
        ("Executor p2p on 8 thread ranks", lambda: check_executor_threads(device, "p2p", False)),
        ("Executor reshard + sum checksum on 8 thread ranks",
         lambda: check_executor_threads(device, "reshard", "sum")),
        ("Executor colocated on 8 thread ranks (in-process reads)",
         lambda: check_executor_threads(device, "colocated", False)),
        ("gloo group of one refuses device tensors", lambda: check_gloo_refuses(device)),
        ("sparse refit on 8 thread ranks, float32 -> bfloat16, equal to a dense one's",
         lambda: check_sparse_threads(device, load_inproc)),
    ]
    return [run_check(f"{name} [{device}]", fn) for name, fn in checks]
