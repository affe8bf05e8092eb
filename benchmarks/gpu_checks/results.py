"""What one run found: a status per thing tried (``pass``, ``fail``, ``error``,
``skipped``), the records every probe returns, and :func:`run_check`, which turns an
exception into an ``error`` so that the other checks still run."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, ERROR, SKIPPED = "pass", "fail", "error", "skipped"


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
