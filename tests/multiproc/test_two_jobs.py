"""Two separately launched jobs meet at a TCP store, plan together and refit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_two_jobs.py")


def _run_jobs(*trainer_args: str, inference_args: tuple[str, ...] = ()) -> list[dict]:
    port = free_port()
    jobs = [subprocess.Popen([sys.executable, str(SCRIPT), side, str(port), *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for side, extra in (("trainer", trainer_args), ("inference", inference_args))]
    out = []
    try:
        for job in jobs:
            stdout, stderr = job.communicate(timeout=180)
            assert job.returncode == 0, stderr[-3000:]
            out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    finally:
        for job in jobs:
            job.kill()
    return out


def test_two_jobs_meet_and_refit_bit_exact():
    results = _run_jobs()
    assert len(results) == 6
    assert all(r.get("ok") for r in results), results
    inference = [r for r in results if r["side"] == "inference"]
    # each tp2 rank receives its half of every tensor in bf16 (w1, w2 halves + full norm)
    assert [r["received"] for r in inference] == [(32 * 24 + 24 * 32 + 24) * 2] * 2


def test_disagreeing_layouts_refused_on_every_rank():
    results = _run_jobs("--bad-rank", "1")
    assert len(results) == 6
    assert {r.get("error") for r in results} == {"FingerprintMismatchError"}, results
    assert all("built different plans" in r["message"] for r in results)


def test_jobs_disagreeing_on_sizes_refused_on_every_rank_before_the_group_forms():
    """The inference job miscounts the trainer (3 ranks, not 4): without the check the
    group would wait for a rank that never comes, until the timeout."""
    results = _run_jobs(inference_args=("--sizes", "3,2"))
    assert len(results) == 6
    assert {r.get("error") for r in results} == {"PlanError"}, results
    for r in results:
        assert r["message"].startswith("the two jobs disagree on the group: the trainer "
                                       "job's rank 0 was given trainer_size=4, "
                                       "inference_size=2, backend='gloo'; the inference "
                                       "job's rank 0 was given trainer_size=3,"), r
        assert r["message"].endswith("nothing was moved")
