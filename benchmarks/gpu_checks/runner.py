"""The shared runner: every probe in turn, the measurements first (on a quiet machine),
pytest last, within ``--time-limit``; then the report, written and printed, and the exit
status (1 only on a wrong result)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .args import parse_args
from .correctness import correctness_checks
from .environment import device_available, environment, is_cuda, no_device_line
from .features import torch_features
from .packing import measure_packing
from .probes import multi_rank_probes, run_probe
from .pytest_runs import run_tests
from .quant import NAME as QUANT_NAME
from .quant import measure_quantization
from .report import build_report, exit_code, write_report
from .results import ERROR, Check, Results, one_line
from .sparse import NAME as SPARSE_NAME
from .sparse import measure_sparse_detection
from .timing import free_memory, measure_copy


def _say(text: str) -> None:
    print(f"[gpu_check] {text}", file=sys.stderr, flush=True)


def _guarded_copy(args: argparse.Namespace) -> dict[str, Any]:
    try:
        return measure_copy(args.device, args.copy_mib << 20, args.repeats)
    except Exception as e:
        return {"status": ERROR, "detail": one_line(e)}
    finally:
        free_memory(args.device)


def _guarded(measure: Callable[[argparse.Namespace], Check], name: str,
             args: argparse.Namespace) -> Check:
    """A measurement that returns a check; an exception in it is that check's error."""
    try:
        return measure(args)
    except Exception as e:
        return Check(name, ERROR, one_line(e))
    finally:
        free_memory(args.device)


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
    _say(f"FP8 block quantization on {args.device}")
    res.checks.append(_guarded(measure_quantization, QUANT_NAME, args))
    _say(f"sparse change detection on {args.device}")
    res.checks.append(_guarded(measure_sparse_detection, SPARSE_NAME, args))
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
    """The one command: a probe's subprocess (``--probe``), one line without a device,
    or the whole check."""
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
