"""The command line, checked before anything runs: a bad value names the option, what
was expected and what came."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import reshard as R
from reshard.defaults import DEFAULT_BUDGET_BYTES
from reshard.sim.models import PRESETS
from reshard.sim.specs import ParallelSpec

from .probes import PROBES

DESCRIPTION = "GPU readiness: does reshard work on one CUDA GPU, and does it pack fast enough?"


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
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
