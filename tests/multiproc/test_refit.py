"""The refit API between two jobs: an FSDP2 trainer taking optimizer steps and a TP2
inference side with fused parameters; versions, bytes, and a failed refit that leaves
the previous version in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_refit_jobs.py")


def _run(tmp_path, *extra: str) -> tuple[list, list]:
    port = free_port()
    jobs = [subprocess.Popen([sys.executable, str(SCRIPT), side, str(port), str(tmp_path),
                              *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for side in ("trainer", "inference")]
    logs = []
    try:
        for job in jobs:
            out, err = job.communicate(timeout=300)
            assert job.returncode == 0, err[-4000:]
            logs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for job in jobs:
            job.kill()
    return logs[0], logs[1]


def test_fsdp2_trainer_refits_fused_tp2_inference_bit_exact(tmp_path):
    trainer, inference = _run(tmp_path)
    for rank_log in inference:
        assert [e["version"] for e in rank_log] == [1, 2, 3]  # version == trainer step
        assert all(e["ok"] and e["exact"] and e["fused_ok"] for e in rank_log), rank_log
    # each TP rank receives only its own half of every sharded weight (fp32) + the norm
    shard = (16 * 16 + 8 * 16 * 2 + 24 * 16 * 2 + 16 * 24 + 16 * 16) // 2 + 16
    embed = [32 * 16, 18 * 16]
    for rank, rank_log in enumerate(inference):
        assert rank_log[0]["received"] == (shard + embed[rank]) * 4
    assert all(e["ok"] for rank_log in trainer for e in rank_log)


def test_trainer_only_policy_and_budget_are_agreed_by_both_sides(tmp_path):
    """The policy and a small budget are the trainer's alone; the receivers follow."""
    trainer, inference = _run(tmp_path, "--mixed")
    for rank_log in inference:
        assert [e["version"] for e in rank_log] == [1, 2, 3]
        assert all(e["ok"] and e["exact"] and e["fused_ok"] for e in rank_log), rank_log
        # gather_broadcast delivers the whole 50 x 16 embedding and 16 x 24 down_proj to
        # every receiver; the 1 KiB budget splits the rest into many rounds
        assert rank_log[0]["received"] > (50 * 16 + 16 * 24) * 4
        assert rank_log[0]["rounds"] > 4
    assert all(e["ok"] for rank_log in trainer for e in rank_log)


@pytest.mark.parametrize("sparse", ["off", "auto"])
def test_sender_failing_midway_keeps_previous_version(tmp_path, sparse):
    """A trainer rank that cannot read a parameter midway through refit 2 (dense, or
    sparse by default): every rank fails it cleanly, the previous version stays in place,
    the group stays whole and refit 3 lands (once, a sparse refit took the failed read
    for a dead peer and broke the group)."""
    trainer, inference = _run(tmp_path, "--fail-at", "2", "--sparse", sparse)
    for rank_log in inference:
        assert rank_log[0]["ok"] and rank_log[0]["exact"]
        failed = rank_log[1]
        assert not failed["ok"] and failed["kept_previous"] and failed["version"] == 1
        assert "injected failure" in failed["error"] or "aborted" in failed["error"]
        assert rank_log[2]["ok"] and rank_log[2]["exact"] and rank_log[2]["version"] == 3
    for rank_log in trainer:
        assert [e["ok"] for e in rank_log] == [True, False, True]
