"""GPU readiness: does reshard work on one CUDA GPU, and does it pack fast enough?

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR

On a machine with one CUDA device, with no set-up and in a few minutes:

1. torch: the features the library uses, probed on the torch installed there (it may be
   older than the pinned one), and every reshard module imported (``features``);
2. correctness on the device, in this process: ``execute_local``,
   ``execute_schedule_local`` (a flat and a forwarding schedule), the ``"sum"`` and
   ``"crc32"`` digests of host and device copies of the same bytes, the real
   ``Executor`` on in-process thread ranks holding device tensors (p2p, and reshard
   with forwards and checksums), a gloo group refusing device tensors
   (``correctness``), and a sparse refit on thread ranks (float32 trainer shards into
   bfloat16 engine ranks, about 1 % changed) equal bit for bit to a dense one's
   (``sparse``);
3. packing speed: one rank's regions of a model-shaped state (Qwen3-8B, tp4 ->
   tp2,dp2, bf16 by default; as many decoder layers as ``--max-gib`` allows) copied
   into the staging arena (pack, on the first source rank) and out of it (unpack, on
   the first destination rank) by the executor's own staging code, in GB/s and as a
   fraction of the device's copy bandwidth measured in the same run (goal: 80 %).
   Every region is copied, also those the executor would send without packing
   (``packing``, with ``staging`` and ``timing``);
4. FP8 block quantization throughput: a 7168 x 2048 bf16 weight as FSDP2 row shards
   of 3 ranks that end mid-block, quantized shard by shard on the device as a refit
   does, in GB/s of bf16 read, and checked bit for bit against the reference
   quantizer (``quant``);
5. sparse change detection (issue 39): a float32 region against its bfloat16 copy at
   0.1 %, 1 % and 5 % changed, as the sparse runner detects on a device, exact, timed
   against the dense sender's cast and as the wire speed it keeps pace with
   (``sparse``);
6. several ranks on one GPU, each tried in a subprocess with a timeout: an NCCL world
   of one (local copies, a message to itself), two NCCL processes on one device
   (``nccl``), CUDA IPC between two processes (one packs, the other unpacks; ``ipc``),
   and the colocated transport (``method="colocated"``, CUDA IPC) between two processes
   that are each a trainer and an engine rank, checked after an in-place update and a
   reallocation of the trainer's weights, then timed (``colocated``); ``probes`` runs
   them;
7. a chosen list of existing test files under pytest, each a subprocess with a
   timeout; the files left out are listed with the reason, and so are skipped tests
   (``pytest_runs``).

Writes DIR/gpu_check.json, DIR/gpu_check.txt (also printed) and DIR/logs/ (``report``).
Exits 1 only on a wrong result (a mismatch, or a failed test), never on a skip or an
error of the environment. Without a CUDA device it prints one line and exits 0.
``--device cpu`` (with ``--quick``: a tiny model) runs the same code on the host: a
debug mode for the CPU test, labelled as such, and not a GPU measurement.

``runner`` runs it all (``main``); ``args`` reads the command line; ``results`` holds
what each probe returns; ``environment``, ``synthetic``, ``processes`` and ``paths`` are
what the probes share.
"""
# ruff: noqa: E402  (the source tree goes on sys.path before reshard is imported)

from __future__ import annotations

import sys

from .paths import ROOT, SCRIPT

if str(ROOT / "src") not in sys.path:  # run from the source tree with no set-up
    sys.path.insert(0, str(ROOT / "src"))

from .args import parse_args
from .colocated import probe_colocated
from .correctness import correctness_checks
from .features import torch_features
from .ipc import probe_cuda_ipc
from .nccl import probe_nccl_one_rank, probe_two_ranks
from .packing import PACKING_GOAL, WORKLOADS, PackingSetup, Workload, measure_packing, measure_side
from .probes import PROBES, multi_rank_probes, run_probe
from .processes import PROBE_TAG, PROBE_TIMEOUT, probe_in_subprocess, probe_results
from .pytest_runs import TESTS_RUN, UNCLASSIFIED, run_test_file, run_tests, select_tests
from .report import build_report, exit_code, mismatches, render_table, write_report
from .results import ERROR, FAIL, PASS, SKIPPED, Check, PackingResult, PytestRun, Results
from .runner import collect, main
from .sparse import check_sparse_threads, measure_sparse_detection
from .staging import ALIGN, LibraryStager, PlainStager, lay_out, make_stager
from .synthetic import plan_dtypes, rank_tensors, tiny_problem

__all__ = [
    "ALIGN", "ERROR", "FAIL", "PACKING_GOAL", "PASS", "PROBES", "PROBE_TAG",
    "PROBE_TIMEOUT", "ROOT", "SCRIPT", "SKIPPED", "TESTS_RUN", "UNCLASSIFIED", "WORKLOADS",
    "Check", "LibraryStager", "PackingResult", "PackingSetup", "PlainStager", "PytestRun",
    "Results", "Workload", "build_report", "check_sparse_threads", "collect",
    "correctness_checks", "exit_code", "lay_out", "main", "make_stager", "measure_packing",
    "measure_side", "measure_sparse_detection", "mismatches", "multi_rank_probes",
    "parse_args", "plan_dtypes", "probe_colocated", "probe_cuda_ipc", "probe_in_subprocess",
    "probe_nccl_one_rank", "probe_results", "probe_two_ranks", "rank_tensors",
    "render_table", "run_probe", "run_test_file", "run_tests", "select_tests",
    "tiny_problem", "torch_features", "write_report",
]
