"""Elastic membership: inference replicas join and leave between refits without
restarting the trainer (``reshard.refit.elastic``).

A 2-rank trainer refits versions 1..7. Replica A (TP2, bf16) is there from the start;
B (TP1, fp32) joins before version 2, C (TP1, fp32) before version 3 (3 replicas), B
leaves after version 4, C after version 5 (back to 1 replica). A replica D with a layout
of the wrong shape asks to join with C and is refused alone. Every replica rank checks
every refit bit for bit; the trainer's history shows the members of each refit, the
membership epochs, and that only new (offset, layouts) pairs were planned: A, B and C
once each; C reuses B's plan when it moves into B's place; shrinking plans nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_elastic_jobs.py")
# join/leave requests posted before each refit: A; +B; +C, +D (refused); -; -B; -C; -
REQUESTS = [1, 2, 4, 4, 5, 6, 6]


def _log(tmp: Path, name: str) -> list:
    path = tmp / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else []


def _wait_for(tmp: Path, name: str, version: int, procs, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not any(e.get("version") == version for e in _log(tmp, name)):
        assert time.monotonic() < end, f"{name} never reached version {version}"
        assert all(p.poll() in (None, 0) for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)


def test_replicas_join_and_leave_between_refits(tmp_path, monkeypatch):
    """Every job holds one token (docs/security.md): each epoch's group checks every
    message with its own keyed digest."""
    monkeypatch.setenv("RESHARD_TOKEN", "elastic-test-token-0123456789")
    port = free_port()

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT), *args[:1], str(port),
                                 str(tmp_path), *args[1:]],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start("trainer", "--requests", ",".join(map(str, REQUESTS))),
             start("replica", "--id", "A", "--tp", "2", "--last", "7")]
    try:
        _wait_for(tmp_path, "A-0", 1, procs)
        procs.append(start("replica", "--id", "B", "--tp", "1", "--leave-after", "4"))
        _wait_for(tmp_path, "B-0", 2, procs)
        procs.append(start("replica", "--id", "C", "--tp", "1", "--leave-after", "5"))
        procs.append(start("replica", "--id", "D", "--tp", "1", "--bad"))
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out[-3000:]
    finally:
        for p in procs:
            p.kill()
    history = _log(tmp_path, "trainer-0")
    assert [h["members"] for h in history] == [["A"], ["A", "B"], ["A", "B", "C"],
                                               ["A", "B", "C"], ["A", "C"], ["A"], ["A"]]
    assert [h["epoch"] for h in history] == [1, 2, 3, 3, 4, 5, 5]
    assert [h["new_plans"] for h in history] == [1, 1, 1, 0, 0, 0, 0]
    assert {h["checksum"] for h in history} == {"hmac"}
    other = _log(tmp_path, "trainer-1")  # every trainer rank saw and planned the same
    assert [(h["members"], h["epoch"], h["new_plans"]) for h in other] == [
        (h["members"], h["epoch"], h["new_plans"]) for h in history]
    expect = {"A": [1, 2, 3, 4, 5, 6, 7], "B": [2, 3, 4], "C": [3, 4, 5]}
    for name, versions in expect.items():
        for rank in range(2 if name == "A" else 1):
            log = _log(tmp_path, f"{name}-{rank}")
            refits = [e for e in log if "exact" in e]
            assert [e["version"] for e in refits] == versions, log
            assert all(e["exact"] for e in refits), log
            if name != "A":
                assert log[-1] == {"left": True, "version": versions[-1]}, log
    # C sat at offset 3 (after A's 2 ranks and B) and moved to B's place, offset 2
    assert [e["offset"] for e in _log(tmp_path, "C-0") if "offset" in e] == [5, 5, 4]
    (refused,) = _log(tmp_path, "D-0")
    assert refused["error"] == "PlanError" and "shape mismatch" in refused["message"]
    print("elastic refits (members, epoch, new plans, seconds):",
          [(h["members"], h["epoch"], h["new_plans"], round(h["seconds"], 3))
           for h in history])


def test_replica_losing_a_rank_is_dropped(tmp_path):
    """Replica B (TP2) loses rank 1 (SIGKILL) in the middle of refit 2: every survivor
    gets a TransferError and keeps version 1; at refit 3 the coordinator keeps the
    replicas whose ranks all reported back (A), drops B (B's rank 0 finds itself out
    and stops), and refits 3 and 4 reach A bit for bit."""
    port = free_port()

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT), *args[:1], str(port),
                                 str(tmp_path), *args[1:]],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs = [start("trainer", "--requests", "2,2,2,2", "--rejoin", "3"),
             start("replica", "--id", "A", "--tp", "1", "--last", "4"),
             start("replica", "--id", "B", "--tp", "2", "--rank", "0"),
             start("replica", "--id", "B", "--tp", "2", "--rank", "1", "--die-at", "2")]
    try:
        for i, p in enumerate(procs):
            out, _ = p.communicate(timeout=120)
            assert p.returncode == (-9 if i == 3 else 0), out[-3000:]
    finally:
        for p in procs:
            p.kill()
    history = _log(tmp_path, "trainer-0")
    assert [(sorted(h["members"]), h["ok"]) for h in history] == [  # join order may vary
        (["A", "B"], True), (["A", "B"], False), (["A"], True), (["A"], True)]
    assert history[1]["seconds"] < 30 and history[2]["epoch"] == history[1]["epoch"] + 1
    a = _log(tmp_path, "A-0")
    assert [e.get("version") for e in a] == [1, 1, 3, 4]
    assert a[1]["error"] == "TransferError" and a[1]["kept_previous"]
    assert all(e["exact"] for e in a if "exact" in e)
    b0 = _log(tmp_path, "B-0")
    assert b0[0]["exact"] and b0[1]["kept_previous"] and b0[-1] == {"left": True, "version": 1}
    print("refit seconds with a rank lost mid-refit, then without B:",
          [round(h["seconds"], 2) for h in history])
