"""GPU readiness: does reshard work on one CUDA GPU, and does it pack fast enough?

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR

On a machine with one CUDA device, with no set-up and in a few minutes:

1. torch: the features the library uses, probed on the torch installed there (it may be
   older than the pinned one), and every reshard module imported;
2. correctness on the device, in this process: ``execute_local``,
   ``execute_schedule_local`` (a flat and a forwarding schedule), the ``"sum"`` and
   ``"crc32"`` digests of host and device copies of the same bytes, the real
   ``Executor`` on in-process thread ranks holding device tensors (p2p, and reshard
   with forwards and checksums), and a gloo group refusing device tensors;
3. packing speed: one rank's regions of a model-shaped state (Qwen3-8B, tp4 ->
   tp2,dp2, bf16 by default; as many decoder layers as ``--max-gib`` allows) copied
   into the staging arena (pack, on the first source rank) and out of it (unpack, on
   the first destination rank) by the executor's own staging code, in GB/s and as a
   fraction of the device's copy bandwidth measured in the same run (goal: 80 %).
   Every region is copied, also those the executor would send without packing;
4. several ranks on one GPU, each tried in a subprocess with a timeout: an NCCL world
   of one (local copies, a message to itself), two NCCL processes on one device, CUDA
   IPC between two processes (one packs, the other unpacks), and the colocated
   transport (``method="colocated"``, CUDA IPC) between two processes that are each a
   trainer and an engine rank, checked after an in-place update and a reallocation of
   the trainer's weights, then timed;
5. a chosen list of existing test files under pytest, each a subprocess with a
   timeout; the files left out are listed with the reason, and so are skipped tests.

Writes DIR/gpu_check.json, DIR/gpu_check.txt (also printed) and DIR/logs/. Exits 1 only
on a wrong result (a mismatch, or a failed test), never on a skip or an error of the
environment. Without a CUDA device it prints one line and exits 0. ``--device cpu``
(with ``--quick``: a tiny model) runs the same code on the host: a debug mode for the
CPU test, labelled as such, and not a GPU measurement.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import inspect
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from math import prod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import reshard as R  # noqa: E402
from reshard._transport.integrity import digest  # noqa: E402
from reshard.defaults import DEFAULT_BUDGET_BYTES  # noqa: E402
from reshard.layout import box_slices  # noqa: E402
from reshard.local import execute_local, execute_schedule_local  # noqa: E402
from reshard.schedule import DEST, Schedule, flat_schedule  # noqa: E402
from reshard.sim.models import PRESETS, model_from_config  # noqa: E402
from reshard.sim.specs import ParallelSpec, model_layouts  # noqa: E402
from reshard.tools.launch import free_port  # noqa: E402
from reshard.tools.synthetic import fill_local, matches  # noqa: E402
from reshard.topology import Topology, domain_schedule  # noqa: E402

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"
PACKING_GOAL = 0.8  # of the device's copy bandwidth
PROBE_TAG = "GPU_CHECK_PROBE "  # a probe subprocess's result line starts with it
ALIGN = 16  # bytes: where each region starts in a plain arena


# ---------------------------------------------------------------------------- results

@dataclass
class Check:
    """One thing tried, and how it went (``pass``, ``fail``: a wrong result, ``error``:
    it could not run, ``skipped``)."""

    name: str
    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class PackingResult:
    """One rank's copies between its tensors and its staging arena, timed."""

    workload: str
    side: str  # "pack": source tensors -> arena; "unpack": arena -> destination tensors
    rank: int
    layers: str  # decoder layers used, "8/36"
    status: str
    num_regions: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    packer: str = ""
    peak_bytes: int | None = None
    detail: str = ""


@dataclass
class PytestRun:
    """One test file under pytest."""

    file: str
    status: str
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    detail: str = ""
    failures: list[str] = field(default_factory=list)
    skips: list[str] = field(default_factory=list)


@dataclass
class Results:
    """Everything one run measured."""

    mode: str  # "gpu", or "cpu-debug" (not a GPU measurement)
    env: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    features: list[Check] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    copy: dict[str, Any] = field(default_factory=dict)
    packing_setup: dict[str, Any] = field(default_factory=dict)
    packing: list[PackingResult] = field(default_factory=list)
    probes: list[Check] = field(default_factory=list)
    pytest_runs: list[PytestRun] = field(default_factory=list)
    not_run: list[tuple[str, str]] = field(default_factory=list)  # (test file, why)
    seconds: float = 0.0


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_check(name: str, fn: Callable[[], tuple[str, str]]) -> Check:
    """Run ``fn`` (returning status and detail); an exception becomes an ``error``."""
    t0 = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as e:  # reported, never raised: the other checks still run
        status, detail = ERROR, one_line(e)
    return Check(name, status, detail, time.perf_counter() - t0)


# ---------------------------------------------------------------------------- arguments

def _at_least(minimum: float, kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'} >= {minimum}, "
                f"got {text!r}")
        return value
    return convert


def _spec(text: str) -> str:
    try:
        ParallelSpec.parse(text)
    except R.ReshardError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check_out"),
                   help="folder for gpu_check.json, gpu_check.txt and logs/ "
                        "(default: ./gpu_check_out)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a debug run of the same code on the host, not a GPU measurement")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, small copies, 2 repeats (a smoke test)")
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="preset whose weights are packed (default qwen3-8b; tiny-qwen3 "
                        "with --quick)")
    p.add_argument("--src", type=_spec, default="tp4", help="source layout (default tp4)")
    p.add_argument("--dst", type=_spec, default="tp2,dp2",
                   help="destination layout (default tp2,dp2)")
    p.add_argument("--max-gib", type=_at_least(0.01, float), default=4.0,
                   help="device memory one packing workload may use; decides how many "
                        "decoder layers are packed (default 4)")
    p.add_argument("--budget-mib", type=_at_least(1, int), default=DEFAULT_BUDGET_BYTES >> 20,
                   help="the executor's staging budget per round (default: the library's)")
    p.add_argument("--copy-mib", type=_at_least(1, int), default=None,
                   help="size of the reference copy (default 1024; 8 with --quick)")
    p.add_argument("--repeats", type=_at_least(1, int), default=None,
                   help="timed repeats, median kept (default 10; 2 with --quick)")
    p.add_argument("--packer", choices=("library", "plain"), default="library",
                   help="library: the executor's staging code; plain: slicing and copy_")
    p.add_argument("--no-probes", action="store_true", help="skip the several-ranks probes")
    p.add_argument("--no-pytest", action="store_true", help="skip the existing test files")
    p.add_argument("--pytest-timeout", type=_at_least(1, float), default=240.0,
                   help="seconds one test file may take (default 240)")
    p.add_argument("--pytest-budget", type=_at_least(1, float), default=300.0,
                   help="seconds all test files may take together (default 300)")
    p.add_argument("--time-limit", type=_at_least(60, float), default=480.0,
                   help="seconds the whole check may take: pytest gets at most what the "
                        "rest left (default 480)")
    p.add_argument("--pytest-jobs", type=_at_least(1, int), default=4,
                   help="test files run at once (default 4)")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # inside a probe process
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on ``--quick`` filled in."""
    args = _parser().parse_args(argv)
    if args.probe is not None and args.probe not in PROBES:
        _parser().error(f"--probe: expected one of {sorted(PROBES)}, got {args.probe!r}")
    args.model = args.model or ("tiny-qwen3" if args.quick else "qwen3-8b")
    args.copy_mib = args.copy_mib or (8 if args.quick else 1024)
    args.repeats = args.repeats or (2 if args.quick else 10)
    return args


# ---------------------------------------------------------------------------- environment

def device_available(device: str) -> bool:
    """Whether ``device`` ("cuda" or "cpu") can be measured here."""
    return device == "cpu" or torch.cuda.is_available()


def no_device_line() -> str:
    """The one line printed where there is no CUDA device."""
    return f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to measure"


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def environment(device: str) -> dict[str, Any]:
    """Python, torch, the device and the packages the test files use."""
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "platform": platform.platform(),
        "cpus": os.cpu_count(), "device": device}
    if is_cuda(device):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_bytes=props.total_memory, nccl=_nccl_version())
    else:
        env["device_name"] = platform.processor() or platform.machine()
    env["packages"] = {name: _version(name) for name in
                       ("numpy", "pytest", "hypothesis", "transformers", "rich", "matplotlib")}
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- torch features

def _lookup(path: str) -> Any:
    """The object at ``module:attr.attr`` (the module is imported), or None."""
    module, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for name in filter(None, attrs.split(".")):
            obj = getattr(obj, name)
    except (ImportError, AttributeError):
        return None
    return obj


def _has(path: str) -> bool:
    return _lookup(path) is not None


def _takes(path: str, *params: str) -> bool:
    """Whether the callable at ``path`` exists and accepts every keyword in ``params``."""
    obj = _lookup(path)
    return obj is not None and set(params) <= set(inspect.signature(obj).parameters)


#: (feature, what in reshard uses it, probe)
FEATURES: tuple[tuple[str, str, Callable[[], bool]], ...] = (
    ("torch.distributed", "every executor", dist.is_available),
    ("NCCL built in", "NCCL groups", lambda: dist.is_available() and dist.is_nccl_available()),
    ("P2POp(group_peer=)", "Comm.exchange on a registered NCCL group",
     lambda: _takes("torch.distributed:P2POp", "group_peer")),
    ("ProcessGroupNCCL._start_coalescing/_end_coalescing",
     "Comm.exchange on a stateless NCCL group",
     lambda: all(map(_has, ("torch.distributed:ProcessGroupNCCL._start_coalescing",
                            "torch.distributed:ProcessGroupNCCL._end_coalescing")))),
    ("ProcessGroupGloo", "stateless gloo groups (Comm.from_store)",
     lambda: _has("torch.distributed:ProcessGroupGloo")),
    ("DTensor.from_local(shape=, stride=)", "reshard.tools.bench, reshard.dtensor",
     lambda: _takes("torch.distributed.tensor:DTensor.from_local", "shape", "stride")),
    ("_StridedShard", "reshard.dtensor",
     lambda: _has("torch.distributed.tensor.placement_types:_StridedShard")),
    ("DTensorSpec, TensorMeta", "reshard.dtensor",
     lambda: all(map(_has, ("torch.distributed.tensor._dtensor_spec:DTensorSpec",
                            "torch.distributed.tensor._dtensor_spec:TensorMeta")))),
    ("torch.float8_e4m3fn", "fp8 layouts", lambda: _has("torch:float8_e4m3fn")),
    ("reduce_tensor / rebuild_cuda_tensor", "the colocated transport on CUDA (CUDA IPC)",
     lambda: all(map(_has, ("torch.multiprocessing.reductions:reduce_tensor",
                            "torch.multiprocessing.reductions:rebuild_cuda_tensor")))),
    ("UntypedStorage._share_fd_cpu_", "the colocated transport on the host",
     lambda: _has("torch:UntypedStorage._share_fd_cpu_")),
)

#: reshard modules imported, with the optional package each needs beyond torch, if any
MODULES = (("reshard.executor", None), ("reshard.dtensor", None), ("reshard.refit", None),
           ("reshard.refit.elastic", None), ("reshard.integrations.hf", None),
           ("reshard.integrations.vllm", "vllm"), ("reshard.tools.cli", None),
           ("reshard.tools.bench", None))


def torch_features() -> list[Check]:
    """The torch features the library uses, present or missing, and every module imported
    (an import error there is what the library needs from a newer torch)."""
    out = [run_check(f"torch: {name}", lambda probe=probe, used=used: (
        (PASS, f"used by {used}") if probe() else (ERROR, f"missing; used by {used}")))
        for name, used, probe in FEATURES]
    out += [run_check(f"import {m}", lambda m=m, needs=needs: _import(m, needs))
            for m, needs in MODULES]
    return out


def _import(module: str, needs: str | None) -> tuple[str, str]:
    if needs is not None and importlib.util.find_spec(needs) is None:
        return SKIPPED, f"needs {needs}, not installed here"
    importlib.import_module(module)
    return PASS, "imported"


# ---------------------------------------------------------------------------- correctness

def tiny_problem(device: str, src: str = "tp4", dst: str = "tp2,dp2"):
    """A tiny Qwen3-shaped plan ``src`` -> ``dst`` and every source rank's synthetic
    tensors on ``device`` (rank -> {name: tensor})."""
    model = model_from_config(PRESETS["tiny-qwen3"], name="tiny-qwen3")
    s, d = ParallelSpec.parse(src), ParallelSpec.parse(dst)
    plan = R.plan(model_layouts(model.tensors, s),
                  model_layouts(model.tensors, d, first_rank=s.world_size))
    sources = {r: {t.name: fill_local(t.src, r).to(device) for t in plan.tensors
                   if r in t.src.rank_set} for r in range(s.world_size)}
    return plan, sources


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


def one_rank_plan(device: str):
    """A single-tensor plan inside rank 0 (local copies only), its source and a zero
    destination on ``device``."""
    src = R.Layout((256, 128), R.Mesh([0]), [R.Shard(0)], dtype="float32")
    dst = R.Layout((256, 128), R.Mesh([0]), [R.Shard(1)], dtype="float32")
    x = torch.arange(256 * 128, dtype=torch.float32, device=device).view(256, 128)
    return R.plan(src, dst), x, torch.zeros_like(x)


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
    ]
    return [run_check(f"{name} [{device}]", fn) for name, fn in checks]


# ---------------------------------------------------------------------------- timing

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


def _free(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def _reset_peak(device: str) -> None:
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def _peak(device: str) -> int | None:
    return torch.cuda.max_memory_allocated(torch.device(device)) if is_cuda(device) else None


# ---------------------------------------------------------------------------- stagers

class _NoComm:
    """What ``RankRunner`` reads from a communicator before any message: the rank."""

    matches_by_tag = True
    backend = "none"

    def __init__(self, rank: int) -> None:
        self.rank, self.size = rank, rank + 1


class LibraryStager:
    """The executor's own staging code driven without a process group: ``RankRunner``'s
    arena layout (messages end to end, round by round) and its ``_pack`` / ``_unpack``
    copies through ``RegionViews``."""

    name = "library"

    def __init__(self, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                 device: str) -> None:
        from reshard._transport.runner import RankRunner

        self.runner = RankRunner(schedule, _NoComm(rank), dtypes=dtypes)
        self.runner.device = torch.device(device)
        self.arenas = dict(zip(("pack", "unpack"), self.runner._arenas()))
        self._rounds = {side: [[(a, b, hops, offsets) for _, a, b, hops, offsets in r[i][0]]
                               for r in self.runner.rounds]
                        for side, i in (("pack", 2), ("unpack", 3))}

    def messages(self, side: str) -> list[list[tuple]]:
        """Per round with anything to copy: (start, stop, hops, offsets) per message."""
        return [msgs for msgs in self._rounds[side] if msgs]

    def bind(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.runner.views.bind(src, dst)

    def unbind(self) -> None:
        self.runner.views.unbind()

    def copy(self, side: str, msgs: list[tuple]) -> None:
        runner = self.runner
        for a, b, hops, offsets in msgs:
            if side == "pack":
                runner._pack(self.arenas["pack"], a, b, hops, offsets)
            else:
                runner._unpack(self.arenas["unpack"], a, hops, offsets)
        if runner.read_error is not None:  # _pack keeps the protocol whole; we may not
            raise runner.read_error


def lay_out(hops: list, peer_of: Callable[[Any], int]) -> list[tuple]:
    """Messages (start, stop, hops, offsets within the message), one per peer in peer
    order, end to end, every region at an ``ALIGN``-byte boundary."""
    by_peer: dict[int, list] = {}
    for h in hops:
        by_peer.setdefault(peer_of(h), []).append(h)
    out, pos = [], 0
    for peer in sorted(by_peer):
        start = pos = -(-pos // ALIGN) * ALIGN
        offsets = []
        for h in by_peer[peer]:
            pos = -(-pos // ALIGN) * ALIGN
            offsets.append(pos - start)
            pos += h.nbytes
        out.append((start, pos, by_peer[peer], offsets))
    return out


class PlainStager:
    """The same copies with plain slicing and ``copy_``, laid out by :func:`lay_out`: for
    when the library's staging code cannot be driven without a process group."""

    name = "plain"

    def __init__(self, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                 device: str) -> None:
        self.dtypes = dtypes
        remote = [[h for h in hops if not h.is_local] for hops in schedule.rounds]
        self._rounds = {
            "pack": [lay_out([h for h in r if h.src_rank == rank], lambda h: h.dst_rank)
                     for r in remote],
            "unpack": [lay_out([h for h in r if h.dst_rank == rank], lambda h: h.src_rank)
                       for r in remote]}
        self.arenas = {side: torch.empty(max((m[1] for ms in rounds for m in ms), default=0),
                                         dtype=torch.uint8, device=device)
                       for side, rounds in self._rounds.items()}
        self.src: dict[str, torch.Tensor] = {}
        self.dst: dict[str, torch.Tensor] = {}

    def messages(self, side: str) -> list[list[tuple]]:
        return [msgs for msgs in self._rounds[side] if msgs]

    def bind(self, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> None:
        self.src, self.dst = src, dst

    def unbind(self) -> None:
        self.src, self.dst = {}, {}

    def copy(self, side: str, msgs: list[tuple]) -> None:
        arena = self.arenas[side]
        for a, _, hops, offsets in msgs:
            for h, off in zip(hops, offsets):
                slot = arena[a + off:a + off + h.nbytes].view(self.dtypes[h.name]).view(h.size)
                if side == "pack":
                    slot.copy_(self.src[h.name][box_slices(h.src_offset, h.size)])
                else:
                    self.dst[h.name][box_slices(h.dst_offset, h.size)].copy_(slot)


def make_stager(kind: str, schedule: Schedule, rank: int, dtypes: dict[str, torch.dtype],
                device: str):
    """The library's stager (``kind="library"``), or the plain one: when asked for, or
    when the library's cannot be driven (its name then says why)."""
    if kind == "library":
        try:
            return LibraryStager(schedule, rank, dtypes, device)
        except (ImportError, AttributeError, TypeError, ValueError, IndexError) as e:
            stager = PlainStager(schedule, rank, dtypes, device)
            stager.name = f"plain (library staging not reachable: {one_line(e)})"
            return stager
    return PlainStager(schedule, rank, dtypes, device)


def copy_all(stager, side: str, rounds: list[list[tuple]], src: dict, dst: dict) -> None:
    """One refit's worth of one side's copies: bind, every round, unbind."""
    stager.bind(src, dst)
    try:
        for msgs in rounds:
            stager.copy(side, msgs)
    finally:
        stager.unbind()


def region_bytes(tensors: dict[str, torch.Tensor], side: str, h) -> torch.Tensor:
    """The bytes of hop ``h``'s region in the rank's own tensor (source when packing,
    destination when unpacking), in row-major order."""
    offset = h.src_offset if side == "pack" else h.dst_offset
    region = tensors[h.name][box_slices(offset, h.size)]
    return region.contiguous().reshape(-1).view(torch.uint8)


def verify_copies(stager, side: str, rounds: list[list[tuple]], src: dict, dst: dict) -> bool:
    """Copy every round once and compare, region by region, the arena's bytes with the
    tensor's (before unpacking, the arena is filled with random bytes)."""
    tensors, arena, ok = (src if side == "pack" else dst), stager.arenas[side], True
    stager.bind(src, dst)
    try:
        for msgs in rounds:
            if side == "unpack":
                for a, b, _, _ in msgs:
                    arena[a:b].random_(0, 256)
            stager.copy(side, msgs)
            ok = ok and all(torch.equal(region_bytes(tensors, side, h),
                                        arena[a + off:a + off + h.nbytes])
                            for a, _, hops, offsets in msgs for h, off in zip(hops, offsets))
    finally:
        stager.unbind()
    return ok


# ---------------------------------------------------------------------------- packing

@dataclass(frozen=True)
class Workload:
    """A kind of region to pack: the weights it takes (a regex over their names)."""

    name: str
    pattern: str
    what: str

    def tensors(self, model) -> list:
        return [t for t in model.tensors if re.search(self.pattern, t.name)]


WORKLOADS = (
    Workload("row_parallel", r"\.(o_proj|down_proj)\.weight$",
             "row-parallel o_proj/down_proj: strided column blocks on the receiving side"),
    Workload("column_parallel",
             r"\.(gate_proj|up_proj)\.weight$|^(model\.embed_tokens|lm_head)\.weight$",
             "gate/up, embeddings, lm_head: contiguous row blocks"),
    Workload("qkv_norms", r"\.(q_proj|k_proj|v_proj)\.weight$|norm\.weight$",
             "q/k/v (vLLM's fused QKV group) and every norm: many small pieces"),
)


@dataclass(frozen=True)
class PackingSetup:
    """What every packing workload shares."""

    model: str
    src: str
    dst: str
    budget_bytes: int
    max_bytes: int
    packer: str

    @property
    def ranks(self) -> tuple[int, int]:
        """(the first source rank, which packs; the first destination rank, which unpacks)"""
        return 0, ParallelSpec.parse(self.src).world_size

    @property
    def total_layers(self) -> int:
        return int(PRESETS[self.model]["num_hidden_layers"])

    def layouts(self, workload: Workload, layers: int):
        """Source and destination layouts of ``workload``'s weights, first ``layers``
        decoder layers only."""
        model = model_from_config({**PRESETS[self.model], "num_hidden_layers": layers},
                                  name=self.model)
        tensors = workload.tensors(model)
        return (model_layouts(tensors, self.src),
                model_layouts(tensors, self.dst, first_rank=self.ranks[1]))

    def memory_needed(self, workload: Workload, layers: int) -> int:
        """Device bytes of the packing rank's and the unpacking rank's tensors, plus two
        arenas of the staging budget."""
        src, dst = self.layouts(workload, layers)
        return (rank_bytes(src, self.ranks[0]) + rank_bytes(dst, self.ranks[1])
                + 2 * self.budget_bytes)

    def fit_layers(self, workload: Workload) -> int:
        """The most decoder layers that fit in ``max_bytes`` (0: not even one)."""
        return next((n for n in range(self.total_layers, 0, -1)
                     if self.memory_needed(workload, n) <= self.max_bytes), 0)


def rank_bytes(layouts: dict, rank: int) -> int:
    """Bytes of ``rank``'s local tensors under ``layouts``."""
    return sum(prod(lay.local_shape(rank)) * lay.itemsize for lay in layouts.values()
               if rank in lay.rank_set)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random bytes of ``shape`` and ``dtype`` (comparisons are of bytes: NaNs do not
    matter)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(prod(shape) * itemsize, dtype=torch.uint8, device=device)
    return raw.random_(0, 256).view(dtype).view(shape)


def rank_tensors(plan, rank: int, side: str, device: str) -> dict[str, torch.Tensor]:
    """``rank``'s source tensors (pack) or zero destination tensors (unpack)."""
    out = {}
    for t in plan.tensors:
        layout = t.src if side == "pack" else t.dst
        if rank in layout.rank_set:
            shape, dtype = layout.local_shape(rank), getattr(torch, layout.dtype)
            out[t.name] = (random_tensor(shape, dtype, device) if side == "pack"
                           else torch.zeros(shape, dtype=dtype, device=device))
    return out


def plan_dtypes(plan) -> dict[str, torch.dtype]:
    return {t.name: getattr(torch, t.dst.dtype) for t in plan.tensors}


def measure_side(plan, schedule: Schedule, side: str, rank: int, *, device: str,
                 repeats: int, packer: str) -> dict[str, Any]:
    """Check one rank's copies between its tensors and its arena once, then time them."""
    _reset_peak(device)
    stager = make_stager(packer, schedule, rank, plan_dtypes(plan), device)
    tensors = rank_tensors(plan, rank, side, device)
    src, dst = (tensors, {}) if side == "pack" else ({}, tensors)
    rounds = stager.messages(side)
    verified = verify_copies(stager, side, rounds, src, dst)
    seconds = time_median(lambda: copy_all(stager, side, rounds, src, dst), device, repeats)
    hops = [h for msgs in rounds for _, _, hs, _ in msgs for h in hs]
    return {"status": PASS if verified else FAIL, "num_regions": len(hops),
            "nbytes": sum(h.nbytes for h in hops), "seconds": seconds,
            "packer": stager.name, "peak_bytes": _peak(device),
            "detail": "" if verified else "a region's bytes differ from the arena's"}


def measure_workload(setup: PackingSetup, workload: Workload, layers: int, device: str,
                     repeats: int) -> list[PackingResult]:
    """Pack on the first source rank and unpack on the first destination rank."""
    plan = R.plan(*setup.layouts(workload, layers))
    schedule = flat_schedule(plan, setup.budget_bytes)
    label = f"{layers}/{setup.total_layers}"
    out = []
    for side, rank in zip(("pack", "unpack"), setup.ranks):
        try:
            got = measure_side(plan, schedule, side, rank, device=device, repeats=repeats,
                               packer=setup.packer)
            out.append(PackingResult(workload.name, side, rank, label, **got))
        except Exception as e:  # out of memory, say: the other workloads still run
            out.append(PackingResult(workload.name, side, rank, label, ERROR,
                                     detail=one_line(e)))
        _free(device)
    return out


def measure_packing(args: argparse.Namespace) -> tuple[dict[str, Any], list[PackingResult]]:
    """Every workload, as many layers as fit in ``--max-gib``."""
    setup = PackingSetup(args.model, args.src, args.dst, args.budget_mib << 20,
                         int(args.max_gib * (1 << 30)), args.packer)
    out: list[PackingResult] = []
    full = model_from_config(PRESETS[setup.model])
    for workload in WORKLOADS:
        layers = setup.fit_layers(workload) if workload.tensors(full) else 0
        if layers == 0:
            why = (f"one layer needs more than --max-gib {args.max_gib}"
                   if workload.tensors(full) else "no weight of this model matches")
            out += [PackingResult(workload.name, side, rank, f"0/{setup.total_layers}",
                                  SKIPPED, detail=why)
                    for side, rank in zip(("pack", "unpack"), setup.ranks)]
        else:
            out += measure_workload(setup, workload, layers, args.device, args.repeats)
    info = {**asdict(setup), "total_layers": setup.total_layers,
            "dtype": full.tensors[0].dtype,
            "schedule": "flat (p2p)", "ranks": {"pack": setup.ranks[0],
                                                "unpack": setup.ranks[1]},
            "workloads": {w.name: w.what for w in WORKLOADS}}
    return info, out


# ---------------------------------------------------------------------------- subprocesses

def child_env() -> dict[str, str]:
    """This environment, with the source tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH", "")]))
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: children included
    proc.wait()


def run_logged(argvs: list[list[str]], logs: list[Path], timeout: float,
               cwd: Path = ROOT) -> list[int | None]:
    """Start every command (output to its log, each in its own session), wait for all
    until ``timeout`` seconds have passed, kill what is left. Exit codes; None: killed."""
    end = time.monotonic() + timeout
    procs = []
    for argv, log in zip(argvs, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen(argv, cwd=cwd, env=child_env(), stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            codes.append(None)
    return codes


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(text[-lines:])[-400:]


# ---------------------------------------------------------------------------- probes

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


def _spawn_context():
    import torch.multiprocessing as tmp

    return tmp.get_context("spawn")


@contextmanager
def _child(ctx, target: Callable[..., None], *args: Any) -> Iterator[None]:
    """A spawned process running ``target(*args)`` while the block runs; joined after
    it, killed if it does not end."""
    child = ctx.Process(target=target, args=args, daemon=True)
    child.start()
    try:
        yield
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)


def _ipc_transfer(device: str) -> tuple[str, str]:
    ctx = _spawn_context()
    to_child, from_child = ctx.Queue(), ctx.Queue()
    with _child(ctx, ipc_receiver, to_child, from_child, device):
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
    ctx, port = _spawn_context(), free_port()
    outbox = ctx.Queue()
    with _child(ctx, colocated_rank, 1, port, args.device, args.model, args.repeats, outbox):
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


#: What a probe subprocess (``--probe NAME``) runs: each yields its checks as they end.
PROBES: dict[str, Callable[[argparse.Namespace], Iterator[Check]]] = {
    "nccl-stateless": lambda args: probe_nccl_one_rank(args, registered=False),
    "nccl-registered": lambda args: probe_nccl_one_rank(args, registered=True),
    "nccl-peer": probe_nccl_peer,
    "cuda-ipc": probe_cuda_ipc,
    "colocated": probe_colocated,
}


def run_probe(args: argparse.Namespace) -> int:
    """Inside a probe subprocess: print each check on a tagged line as soon as it ends
    (a later hang, killed by the parent, loses none of them)."""
    for check in PROBES[args.probe](args):
        print(PROBE_TAG + json.dumps(asdict(check)), flush=True)
    return 0


def probe_results(name: str, code: int | None, log: Path, timeout: float) -> list[Check]:
    """The checks a probe subprocess printed, and an error named ``name`` if it was
    killed, or ended without printing any."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    checks = [Check(**json.loads(line[len(PROBE_TAG):])) for line in text
              if line.startswith(PROBE_TAG)]
    if code is None:
        checks.append(Check(name, ERROR, f"timed out after {timeout:.0f} s, killed"))
    elif not checks:
        checks.append(Check(name, ERROR, f"exit code {code}: {_tail(log)}"))
    return checks


def _probe_argv(name: str, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--probe", name, *extra]


def probe_in_subprocess(name: str, logs: Path, timeout: float, device: str = "cuda",
                        extra: Sequence[str] = ()) -> list[Check]:
    """Run probe ``name`` in its own process (``extra``: more of its arguments); its
    checks, or one error saying how it ended (a timeout kills it)."""
    log = logs / f"probe_{name}.log"
    t0 = time.perf_counter()
    (code,) = run_logged([_probe_argv(name, "--device", device, *extra)], [log], timeout)
    checks = probe_results(f"{name} probe", code, log, timeout)
    for c in checks:
        c.seconds = c.seconds or time.perf_counter() - t0
    return checks


def probe_two_ranks(logs: Path, timeout: float) -> Check:
    """Two NCCL processes on the same GPU, rank 0 sending to rank 1 through the
    executor: NCCL is expected to refuse (a duplicate GPU); whatever happens is said."""
    name = "two NCCL processes on one GPU: Executor p2p, rank 0 -> rank 1"
    port, t0 = free_port(), time.perf_counter()
    paths = [logs / f"probe_nccl-peer_{r}.log" for r in range(2)]
    codes = run_logged([_probe_argv("nccl-peer", "--rank", str(r), "--port", str(port))
                        for r in range(2)], paths, timeout)
    ranks = [check for r, (code, path) in enumerate(zip(codes, paths))
             for check in probe_results(f"rank {r}", code, path, timeout)]
    statuses = {c.status for c in ranks}
    status = FAIL if FAIL in statuses else PASS if statuses == {PASS} else ERROR
    detail = "; ".join(f"{c.name}: {c.status}, {c.detail}" for c in ranks)
    return Check(name, status, detail, time.perf_counter() - t0)


PROBE_TIMEOUT = 60.0


def multi_rank_probes(args: argparse.Namespace, logs: Path) -> list[Check]:
    """Several ranks on one GPU, each tried in its own subprocess with a timeout."""
    names = ("NCCL world of 1 (stateless, registered)", "two NCCL processes on one GPU",
             ipc_name(args.device), colocated_name(args.device))
    if args.no_probes or not is_cuda(args.device):
        why = "--no-probes given" if args.no_probes else "needs a CUDA device"
        return [Check(n, SKIPPED, why) for n in names]
    checks = probe_in_subprocess("nccl-stateless", logs, PROBE_TIMEOUT)
    checks += probe_in_subprocess("nccl-registered", logs, PROBE_TIMEOUT)
    checks.append(probe_two_ranks(logs, PROBE_TIMEOUT))
    checks += probe_in_subprocess("cuda-ipc", logs, PROBE_TIMEOUT)
    checks += probe_in_subprocess("colocated", logs, 2 * PROBE_TIMEOUT, extra=(
        "--model", args.model, "--repeats", str(args.repeats)))
    return checks


# ---------------------------------------------------------------------------- pytest

#: Test files run on the GPU machine: the layout, plan, schedule, view, fuzz, device and
#: executor tests on thread ranks, and the gloo multi-process executor and DTensor tests
#: (what differs there is torch's version; their tensors are on the host).
TESTS_RUN = (  # the longest first, so that the pool ends early
    "tests/multiproc/test_redistribute.py", "tests/multiproc/test_dtensor_parity.py",
    "tests/unit/test_fuzz.py", "tests/multiproc/test_executor.py",
    "tests/multiproc/test_checksum.py", "tests/unit/test_plan_properties.py",
    "tests/unit/test_topology.py", "tests/unit/test_refit_recovery.py",
    "tests/unit/test_schedule_agreement.py", "tests/unit/test_ordered_matching.py",
    "tests/unit/test_layout.py", "tests/unit/test_views.py", "tests/unit/test_devices.py",
    "tests/multiproc/test_colocated.py", "tests/unit/test_colocated_specs.py",
)

_PURE = "pure Python (no tensor on a device, nothing torch-version dependent); the CPU CI runs it"
_LONG = "gloo refit protocol or timing on the host; the CPU CI runs it, left out to stay short"

#: Test files left out, and why.
LEFT_OUT = {
    "tests/unit/test_cards.py": "network namespaces (root, iproute2): no GPU path",
    "tests/unit/test_costmodel.py": "cost-model simulator: " + _PURE,
    "tests/unit/test_models.py": "model presets: " + _PURE,
    "tests/unit/test_mapping.py": "vLLM name mapping: " + _PURE,
    "tests/unit/test_family_mapping.py": "vLLM mapping of MLA, Mamba and Gemma 3: " + _PURE,
    "tests/unit/test_megatron_mapping.py": "Megatron-Core name and shard rules: " + _PURE,
    "tests/unit/test_nemo_hybrid_layouts.py": "NeMo RL benchmark's layouts: " + _PURE,
    "tests/unit/test_nemo_sim.py": "NeMo RL methods in the cost model: " + _PURE,
    "tests/unit/test_demo_rl_args.py": "the RL demo's command line: " + _PURE,
    "tests/unit/test_layering.py": "import layering: " + _PURE,
    "tests/unit/test_gpu_check.py": "this check's own CPU test",
}
LEFT_OUT_FOLDERS = {
    "tests/multiproc": _LONG,
    "tests/integration": "emulated nodes (root, network namespaces) and CPU vLLM: not on "
                         "the GPU machine",
}


UNCLASSIFIED = "not classified for the GPU check (a new file?)"


def left_out_reason(path: str) -> str:
    """Why a test file is not run here."""
    if path in LEFT_OUT:
        return LEFT_OUT[path]
    return LEFT_OUT_FOLDERS.get(path.rsplit("/", 1)[0], UNCLASSIFIED)


def select_tests(root: Path = ROOT) -> tuple[list[str], list[tuple[str, str]]]:
    """(test files to run, [(test file, why not)]), paths relative to ``root``."""
    present = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    chosen = [f for f in TESTS_RUN if f in present]
    not_run = [(f, "listed for this check but not found (renamed?)")
               for f in TESTS_RUN if f not in present]
    not_run += [(f, left_out_reason(f)) for f in present if f not in TESTS_RUN]
    return chosen, not_run


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts, failed tests and skip reasons from pytest's JUnit XML report."""
    out: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                           "failures": [], "skips": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        message = "" if outcome is None else (outcome.get("message") or "").strip()
        first = message.splitlines()[0][:200] if message else ""
        if outcome is None:
            out["passed"] += 1
        elif outcome.tag == "skipped":
            out["skipped"] += 1
            out["skips"].append(f"{test}: {first}")
        else:
            out["failed" if outcome.tag == "failure" else "errors"] += 1
            out["failures"].append(f"{test}: {first}")
    return out


def _pytest_status(counts: dict[str, Any]) -> str:
    if counts["failed"]:
        return FAIL
    if counts["errors"]:
        return ERROR
    return PASS if counts["passed"] else SKIPPED


MIN_TEST_SECONDS = 5.0  # a test file is not started with less time left


def run_test_file(path: str, logs: Path, timeout: float, cwd: Path = ROOT) -> PytestRun:
    """One test file under pytest in a subprocess, killed past ``timeout`` seconds."""
    if timeout < MIN_TEST_SECONDS:
        return PytestRun(path, SKIPPED, detail="out of time (--pytest-budget)")
    stem = re.sub(r"\W", "_", path.removesuffix(".py"))
    xml, log = logs / f"pytest_{stem}.xml", logs / f"pytest_{stem}.log"
    xml.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            f"--junitxml={xml}", path]
    t0 = time.perf_counter()
    (code,) = run_logged([argv], [log], timeout, cwd=cwd)
    seconds = time.perf_counter() - t0
    if code is None:
        return PytestRun(path, ERROR, seconds=seconds,
                         detail=f"timed out after {timeout:.0f} s, killed; see {log.name}")
    if not xml.exists():
        return PytestRun(path, ERROR, seconds=seconds,
                         detail=f"pytest exit code {code}, no report: {_tail(log)}")
    counts = parse_junit(xml)
    return PytestRun(path, _pytest_status(counts), seconds=seconds,
                     detail=f"pytest exit code {code}", **counts)


def run_tests(args: argparse.Namespace, logs: Path,
              budget: float) -> tuple[list[PytestRun], list]:
    """The chosen test files, ``--pytest-jobs`` at a time, within ``budget`` seconds."""
    chosen, not_run = select_tests()
    if args.no_pytest:
        return [], [(f, "--no-pytest given") for f in chosen] + not_run
    end = time.monotonic() + budget

    def one(path: str) -> PytestRun:
        return run_test_file(path, logs, min(args.pytest_timeout, end - time.monotonic()))

    with ThreadPoolExecutor(args.pytest_jobs) as pool:
        return list(pool.map(one, chosen)), not_run


# ---------------------------------------------------------------------------- report

def mismatches(results: Results) -> list[str]:
    """Every wrong result: what makes the exit status 1."""
    bad = [c.name for c in (*results.checks, *results.probes) if c.status == FAIL]
    bad += [f"packing {p.workload} {p.side}" for p in results.packing if p.status == FAIL]
    bad += [f"pytest {r.file}" for r in results.pytest_runs if r.status == FAIL]
    if results.copy.get("status") == FAIL:
        bad.append("reference copy")
    return bad


def exit_code(results: Results) -> int:
    """1 on a wrong result, else 0 (skips and errors of the environment included)."""
    return 1 if mismatches(results) else 0


def _packing_rows(results: Results) -> list[dict[str, Any]]:
    copy_gbps = results.copy.get("gbps")
    rows = []
    for p in results.packing:
        row = asdict(p)
        gbps = p.nbytes / p.seconds / 1e9 if p.seconds > 0 else None
        fraction = gbps / copy_gbps if gbps is not None and copy_gbps else None
        row.update(gbps=gbps, fraction_of_copy=fraction,
                   meets_goal=None if fraction is None else fraction >= PACKING_GOAL)
        rows.append(row)
    return rows


def _summary(results: Results, packing: list[dict[str, Any]]) -> dict[str, Any]:
    everything = [*results.features, *results.checks, *results.probes, *results.packing,
                  *results.pytest_runs]
    fractions = [r["fraction_of_copy"] for r in packing if r["fraction_of_copy"] is not None]
    return {
        "ok": not mismatches(results), "mismatches": mismatches(results),
        "errors": [getattr(x, "name", None) or getattr(x, "file", None)
                   or f"{x.workload} {x.side}" for x in everything if x.status == ERROR],
        "num_skipped": sum(x.status == SKIPPED for x in everything),
        "packing_goal": PACKING_GOAL,
        "packing_worst_fraction": min(fractions, default=None),
        "packing_below_goal": [f"{r['workload']} {r['side']}" for r in packing
                               if r["meets_goal"] is False],
        "exit_code": exit_code(results)}


def build_report(results: Results) -> tuple[dict[str, Any], str]:
    """The JSON report and the text table of ``results``."""
    packing = _packing_rows(results)
    report = asdict(results)
    report["packing"] = packing
    report["not_run"] = [{"file": f, "reason": why} for f, why in results.not_run]
    report["label"] = ("GPU measurement" if results.mode == "gpu"
                       else "CPU DEBUG RUN: not a GPU measurement")
    report["summary"] = _summary(results, packing)
    return report, render_table(report)


def _fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _header_lines(r: dict[str, Any]) -> list[str]:
    env, copy = r["env"], r["copy"]
    lines = [f"gpu_check ({r['label']})",
             f"{env.get('device_name')} ({env['device']}), torch {env['torch']}, CUDA "
             f"{env.get('torch_cuda')}, NCCL {env.get('nccl', '-')}, Python {env['python']}"]
    if copy.get("gbps") is not None:
        lines.append(f"copy bandwidth: {copy['nbytes'] / 2**20:.0f} MiB copy_ on the device, "
                     f"{copy['gbps']:.1f} GB/s, {'verified' if copy['verified'] else 'WRONG'}")
    else:
        lines.append(f"copy bandwidth: not measured ({copy.get('detail', 'no result')})")
    return lines


def _packing_lines(r: dict[str, Any]) -> list[str]:
    s = r["packing_setup"]
    if not s:
        return []
    lines = ["", f"packing: {s['model']} ({s['dtype']}), {s['src']} -> {s['dst']}, "
                 f"{s['schedule']} schedule, staging budget {s['budget_bytes'] >> 20} MiB, "
                 f"at most {s['max_bytes'] / 2**30:.1f} GiB per workload, "
                 f"{r['packing'][0]['packer'] if r['packing'] else s['packer']} stager",
             "layers: as many decoder layers as fit in that memory (embeddings, lm_head "
             "and final norm whole); pack: first source rank, unpack: first destination rank",
             f"{'workload':<16} {'side':<7}{'rank':>5}{'layers':>8}{'regions':>9}{'MiB':>10}"
             f"{'GB/s':>10}{'of copy':>9}  status"]
    for p in r["packing"]:
        lines.append(
            f"{p['workload']:<16} {p['side']:<7}{p['rank']:>5}{p['layers']:>8}"
            f"{p['num_regions']:>9}{p['nbytes'] / 2**20:>10.1f}{_fmt(p['gbps'], '.1f'):>10}"
            f"{_fmt(p['fraction_of_copy'], '.1%'):>9}  {p['status']} {p['detail']}".rstrip())
    below = r["summary"]["packing_below_goal"]
    lines.append(f"goal: >= {PACKING_GOAL:.0%} of copy bandwidth; "
                 + (f"below it: {', '.join(below)}" if below else "all measured rows meet it"))
    return lines


def _check_lines(title: str, checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return []
    width = max(len(c["name"]) for c in checks)
    lines = ["", title, f"{'check':<{width}}  {'status':<8}{'seconds':>8}  detail"]
    lines += [f"{c['name']:<{width}}  {c['status']:<8}{c['seconds']:>8.2f}  {c['detail']}"
              for c in checks]
    return lines


def _pytest_lines(r: dict[str, Any], max_skips: int = 20) -> list[str]:
    runs, lines = r["pytest_runs"], [""]
    if runs:
        width = max(len(x["file"]) for x in runs)
        lines += [f"pytest: {len(runs)} test files",
                  f"{'file':<{width}}  {'status':<8}{'passed':>7}{'failed':>7}{'errors':>7}"
                  f"{'skipped':>8}{'seconds':>9}"]
        lines += [f"{x['file']:<{width}}  {x['status']:<8}{x['passed']:>7}{x['failed']:>7}"
                  f"{x['errors']:>7}{x['skipped']:>8}{x['seconds']:>9.1f}  {x['detail']}"
                  for x in runs]
        problems = [f for x in runs for f in x["failures"]]
        lines += [f"  failed: {f}" for f in problems]
        skips = [s for x in runs for s in x["skips"]]
        lines += [f"  skipped: {s}" for s in skips[:max_skips]]
        if len(skips) > max_skips:
            lines.append(f"  ... {len(skips) - max_skips} more skipped tests in the JSON")
    lines.append("test files not run:")
    lines += [f"  {x['file']}: {x['reason']}" for x in r["not_run"]]
    return lines


def render_table(report: dict[str, Any]) -> str:
    """The short text report (also printed)."""
    summary = report["summary"]
    lines = _header_lines(report) + _packing_lines(report)
    lines += _check_lines(f"correctness on {report['env']['device']}", report["checks"])
    lines += _check_lines("several ranks on one GPU", report["probes"])
    lines += _check_lines(f"torch {report['env']['torch']}: what the library uses",
                          report["features"])
    lines += _pytest_lines(report)
    verdict_line = ("OK: no wrong result" if summary["ok"] else
                    f"WRONG RESULTS: {', '.join(summary['mismatches'])}")
    lines += ["", f"result: {verdict_line}; {len(summary['errors'])} errors, "
                  f"{summary['num_skipped']} skipped; {report['seconds']:.0f} s "
                  f"({report['label']})"]
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict[str, Any], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "gpu_check.txt").write_text(table)


# ---------------------------------------------------------------------------- main

def _say(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stderr, flush=True)


def _guarded_copy(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return measure_copy(args.device, args.copy_mib << 20, args.repeats)
    except Exception as e:
        return {"status": ERROR, "detail": one_line(e)}
    finally:
        _free(args.device)


def collect(args: argparse.Namespace) -> Results:
    """Run everything, the measurements first (on a quiet machine), pytest last."""
    t0 = time.perf_counter()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    res = Results("gpu" if is_cuda(args.device) else "cpu-debug", environment(args.device),
                  {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    _say("torch features and imports")
    res.features = torch_features()
    _say(f"correctness checks on {args.device}")
    res.checks = correctness_checks(args.device)
    _say(f"copy bandwidth ({args.copy_mib} MiB)")
    res.copy = _guarded_copy(args)
    _say(f"packing {args.model} {args.src} -> {args.dst}")
    res.packing_setup, res.packing = measure_packing(args)
    _say("several ranks on one GPU")
    res.probes = multi_rank_probes(args, logs)
    _say("existing test files under pytest")
    left = args.time_limit - (time.perf_counter() - t0) - 15  # 15 s to write the report
    res.pytest_runs, res.not_run = run_tests(args, logs, min(args.pytest_budget, left))
    res.seconds = time.perf_counter() - t0
    return res


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe is not None:
        return run_probe(args)
    if not device_available(args.device):
        print(no_device_line())
        return 0
    results = collect(args)
    report, table = build_report(results)
    write_report(args.out, report, table)
    print(table, end="")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
