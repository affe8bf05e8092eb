"""The process's resident memory, as a commit on vLLM CPU spends it: ``VmRSS`` and its
peak, the freed heap handed back to the system (glibc ``malloc_trim``), and
:class:`HeapBound`, which keeps a commit within a slack of where it began.
"""

from __future__ import annotations

import functools
from typing import Any

from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES

__all__ = ["HeapBound", "reset_peak_rss", "return_freed_memory", "rss_bytes"]


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``, 1.6 ms
    here, more than the trim), or None where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def return_freed_memory() -> None:
    """Give the heap memory freed by a commit back to the system (glibc ``malloc_trim``):
    each reloaded layer's repacked copy replaces the old one, and glibc keeps the freed
    chunks resident otherwise. A no-op where there is no glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class HeapBound:
    """Keeps a commit's resident memory within ``slack`` bytes of where it began: call
    :meth:`check` after each module; it hands the freed heap back
    (:func:`return_freed_memory`) whenever the process has grown by more.

    A commit frees each module's old packed GEMM copy and makes a new one of the same
    size, but glibc does not always serve the new one from the chunk just freed: it may
    take a free chunk whose pages an earlier trim gave back (faulting them in again)
    and keep the old one's pages resident. Traced per module on vLLM CPU (Qwen2.5-1.5B
    shapes, 12 layers, TP2), an engine rank grew by 42-110 MB per commit that way, one
    module's copy at a time, until the closing trim. A trim costs a few milliseconds,
    so it runs only when the slack is spent, and (:meth:`make_room`) between the free of
    a module's old copy and the making of its new one where that copy is larger than
    the slack: the new copy then cannot land beside the old one's resident pages, so a
    commit's peak stays within the slack of where it began (8 MiB: 2 trims a layer at
    Qwen2.5-1.5B shapes, gate_up and down; ``benchmarks/refit_real.py`` gives the peak
    per phase). Pages handed back are faulted in again by later copies, which costs time
    (:data:`reshard.defaults.DEFAULT_COMMIT_HEAP_SLACK_BYTES`); ``slack=None`` never
    trims, trading the heap's fragmentation held resident for a faster commit."""

    def __init__(self, slack: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES) -> None:
        self.slack, self.base, self.trims = slack, rss_bytes(), 0

    def check(self) -> None:
        """After a module: trim if the process grew by more than the slack (never with
        ``slack=None``: every freed page stays for the next copies to reuse)."""
        if self.slack is not None and rss_bytes() - self.base > self.slack:
            self._trim()

    def make_room(self, nbytes: int) -> None:
        """A packed copy of about ``nbytes`` was just freed and its successor is next:
        trim first if it is larger than the slack."""
        if self.slack is not None and nbytes > self.slack:
            self._trim()

    def _trim(self) -> None:
        return_freed_memory()
        self.trims += 1


def reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the current resident memory (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
