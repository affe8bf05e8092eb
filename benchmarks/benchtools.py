"""What the benchmarks share: timing and medians, CPU seconds and resident memory per
process role (a process tree read from ``/proc``), the host's load and memory, JSON
results, and plots. Imported by name (a benchmark's folder is on ``sys.path`` when it
runs as a script).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "MemoryWatch", "available_bytes", "cpu_medians", "cpu_spent", "load_avg", "median",
    "profiled", "pyplot", "slowest_median", "timed", "tree_cpu", "tree_rss", "vllm_role",
    "write_json",
]


# -------------------------------------------------------------------- timing, medians

def median(xs: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(xs) if xs else float("nan")


def slowest_median(per_rank: Iterable[Sequence[float]]) -> float:
    """The median over repeats of the slowest rank: ``per_rank`` holds each rank's
    seconds, repeat by repeat (a collective step lasts as long as its slowest rank)."""
    return statistics.median(max(ts) for ts in zip(*per_rank))


def timed(fn: Callable[[], object]) -> tuple[dict[str, float], object]:
    """{"wall": s, "cpu": s} of ``fn()`` and its value (CPU time is steadier on a busy
    machine: planning is single-threaded Python)."""
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    value = fn()
    return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu}, value


def profiled(fn: Any, top: int = 30) -> str:
    """``fn()`` under cProfile: the ``top`` functions by cumulative time, as text."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    return text.getvalue()


# -------------------------------------------------------------------------- the host

def available_bytes() -> int:
    """``MemAvailable`` of the host, in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_avg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------- CPU and memory per process role

def _descendants(pid: int) -> dict[int, list[str]]:
    """``pid`` and all its descendants: pid -> the fields of ``/proc/PID/stat`` after the
    command (state first), with the command's name appended."""
    children: dict[int, list[int]] = {}
    stat: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            head, tail = (d / "stat").read_text().rsplit(")", 1)
            fields = tail.split() + [head.split("(", 1)[1]]
            children.setdefault(int(fields[1]), []).append(int(d.name))
            stat[int(d.name)] = fields
        except (OSError, IndexError, ValueError):
            continue
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in stat:
            out[p] = stat[p]
        todo += children.get(p, [])
    return out


def tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants, in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(f[21]) * page for f in _descendants(pid).values())


def vllm_role(pid: int, name: str) -> str:
    """Who a process of a refit run is, from its name (vLLM names its own; the rest are
    the trainer ranks, which the driver starts)."""
    if pid == os.getpid():
        return "driver"
    if name.startswith("VLLM::EngineCor"):
        return "engine core"
    if name.startswith("VLLM::Worker"):
        return "engine workers"
    return "trainer ranks"


def tree_cpu(pid: int, role: Callable[[int, str], str] = vllm_role
             ) -> dict[int, tuple[str, float, int]]:
    """CPU seconds (user + system) and minor page faults so far of ``pid`` and each
    descendant, with its ``role``."""
    tick = os.sysconf("SC_CLK_TCK")
    return {p: (role(p, f[-1]), (int(f[11]) + int(f[12])) / tick, int(f[7]))
            for p, f in _descendants(pid).items()}


def cpu_spent(before: dict[int, tuple[str, float, int]],
              after: dict[int, tuple[str, float, int]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`tree_cpu` samples, per role, and the page
    faults taken (``faults <role>``: each first touch of a page the process had not
    held, which a small host pays dearly for)."""
    out: dict[str, float] = {}
    for p, (role, t, faults) in after.items():
        _, t0, f0 = before.get(p, (role, 0.0, 0))
        out[role] = out.get(role, 0.0) + t - t0
        out[f"faults {role}"] = out.get(f"faults {role}", 0) + faults - f0
    return out


def cpu_medians(spent: list[dict[str, float]]) -> dict[str, float]:
    """Per role (and its page faults), the median over refits of :func:`cpu_spent`."""
    roles = sorted({r for c in spent for r in c})
    return {r: median([c.get(r, 0.0) for c in spent]) for r in roles}


class MemoryWatch:
    """The peak resident memory of this process tree, sampled every 0.5 s."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, tree_rss(os.getpid()))

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


# ------------------------------------------------------------------ results, plots

def write_json(path: Path, value: Any) -> None:
    """``value`` as indented JSON at ``path`` (the results a run keeps)."""
    path.write_text(json.dumps(value, indent=1))


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on these hosts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
