"""Subprocesses, each with a log and a timeout: the commands the check starts (a probe
run by the check's own script with ``--probe NAME``, a test file under pytest), a
child spawned by a probe, and how a probe process reports its checks (one tagged JSON
line each, as soon as it ends, so that a later hang loses none of them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from .paths import ROOT, SCRIPT
from .results import ERROR, Check

PROBE_TAG = "GPU_CHECK_PROBE "  # a probe subprocess's result line starts with it
PROBE_TIMEOUT = 60.0


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


def log_tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a log, on one line (at most 400 characters)."""
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(text[-lines:])[-400:]


def spawn_context():
    import torch.multiprocessing as tmp

    return tmp.get_context("spawn")


@contextmanager
def spawned_child(ctx, target: Callable[..., None], *args: Any) -> Iterator[None]:
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


def probe_argv(name: str, *extra: str) -> list[str]:
    """The command that runs probe ``name`` in a process of its own."""
    return [sys.executable, str(SCRIPT), "--probe", name, *extra]


def probe_results(name: str, code: int | None, log: Path, timeout: float) -> list[Check]:
    """The checks a probe subprocess printed, and an error named ``name`` if it was
    killed, or ended without printing any."""
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    checks = [Check(**json.loads(line[len(PROBE_TAG):])) for line in text
              if line.startswith(PROBE_TAG)]
    if code is None:
        checks.append(Check(name, ERROR, f"timed out after {timeout:.0f} s, killed"))
    elif not checks:
        checks.append(Check(name, ERROR, f"exit code {code}: {log_tail(log)}"))
    return checks


def probe_in_subprocess(name: str, logs: Path, timeout: float, device: str = "cuda",
                        extra: Sequence[str] = ()) -> list[Check]:
    """Run probe ``name`` in its own process (``extra``: more of its arguments); its
    checks, or one error saying how it ended (a timeout kills it)."""
    log = logs / f"probe_{name}.log"
    t0 = time.perf_counter()
    (code,) = run_logged([probe_argv(name, "--device", device, *extra)], [log], timeout)
    checks = probe_results(f"{name} probe", code, log, timeout)
    for c in checks:
        c.seconds = c.seconds or time.perf_counter() - t0
    return checks
