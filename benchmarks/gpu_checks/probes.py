"""The several-ranks probes: which one a probe subprocess (``--probe NAME``) runs, how it
reports, and the parent's sequence of them, each in its own subprocess with a timeout."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from .colocated import colocated_name, probe_colocated
from .environment import is_cuda
from .ipc import ipc_name, probe_cuda_ipc
from .nccl import probe_nccl_one_rank, probe_nccl_peer, probe_two_ranks
from .processes import PROBE_TAG, PROBE_TIMEOUT, probe_in_subprocess
from .results import SKIPPED, Check

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
