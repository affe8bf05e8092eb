"""A lost worker is an error, not a hang and not a torn model.

A trainer job (2 ranks, with its own gloo world) refits an inference job (2 ranks, TP2)
once per step through ``RefitSender`` / ``RefitReceiver`` with a 10 s refit deadline.
In the middle of the refit of step 3 (after its first round) one process is SIGKILLed:

* an inference rank: both trainer ranks and the surviving inference rank get a
  ``TransferError`` within the deadline, the survivor still holds version 2 bit for bit,
  the trainer keeps training (its own all-reduce works every step); everyone reconnects
  at a new port, a restarted inference rank joins fresh, and steps 4 and 5 refit exact;
* an inference rank frozen (SIGSTOP) instead of killed: the same, at the deadline (its
  connections stay open, so only the deadline can end the waits);
* a trainer rank: the surviving trainer rank and both inference ranks get a
  ``TransferError`` within the deadline and the inference ranks keep version 2; the
  trainer job is restarted (from step 4) at a new port, the inference ranks reconnect
  there, and steps 4 and 5 refit exact.

Every process runs with a hard lifetime and every wait here has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reshard.tools.launch import free_port

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).with_name("_lost_worker_jobs.py")
DEADLINE_S, MARGIN_S = 10.0, 5.0
KILL_STEP, LAST_STEP = 3, 5


class Jobs:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        self.ports = ",".join(str(free_port()) for _ in range(3))

    def start(self, role: str, rank: int, *extra: str) -> subprocess.Popen:
        err = open(self.tmp / f"{role}{rank}-{len(self.procs)}.err", "w")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, str(SCRIPT), role, str(rank), str(self.tmp),
                              "--ports", self.ports, "--last-step", str(LAST_STEP), *extra],
                             stdout=err, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def wait_victim(self, timeout: float = 120, sig: int = signal.SIGKILL) -> tuple[int, float]:
        flag = self.tmp / "victim.json"
        end = time.monotonic() + timeout
        while not flag.exists():
            assert time.monotonic() < end, self.stderr()
            assert all(p.poll() in (None, 0) for p in self.procs), self.stderr()
            time.sleep(0.02)
        pid = json.loads(flag.read_text())["pid"]
        os.kill(pid, sig)
        self.victim = pid
        return pid, time.time()

    def wait_all(self, procs, timeout: float = 150) -> None:
        end = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError("a rank hung:\n" + self.stderr()) from None
            assert p.returncode == 0, self.stderr()

    def logs(self, role: str) -> dict[int, list[list[dict]]]:
        out: dict[int, list[list[dict]]] = {}
        for f in sorted(self.tmp.glob(f"{role}*-*.json"), key=lambda f: f.stat().st_mtime):
            rank = int(f.name[len(role):].split("-")[0])
            out.setdefault(rank, []).append(json.loads(f.read_text()))
        return out

    def stderr(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-2000:]}"
                         for f in sorted(self.tmp.glob("*.err")))

    def close(self) -> None:
        if getattr(self, "victim", None):
            with contextlib.suppress(OSError):
                os.kill(self.victim, signal.SIGKILL)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _refits(log: list[dict]) -> list[dict]:
    """The log's refits; every one, passed or failed, left Python's collector on (a refit
    pauses it while it runs)."""
    refits = [e for e in log if e["kind"] == "refit"]
    assert all(e["gc"] for e in refits), refits
    return refits


def _seconds_to_error(entry: dict, killed_at: float) -> float:
    return entry["time"] - killed_at


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_inference_rank_lost_mid_refit(tmp_path, sig):
    jobs = Jobs(tmp_path)
    world = str(free_port())
    victim = f"inference:1:{KILL_STEP}"
    try:
        trainers = [jobs.start("trainer", r, "--world-port", world, "--victim", victim)
                    for r in range(2)]
        survivor = jobs.start("inference", 0, "--victim", victim)
        victim_proc = jobs.start("inference", 1, "--victim", victim)
        _, killed_at = jobs.wait_victim(sig=sig)
        replacement = jobs.start("inference", 1, "--port-index", "1")
        jobs.wait_all([*trainers, survivor, replacement])
        assert victim_proc.poll() is None if sig == signal.SIGSTOP else victim_proc.poll() < 0
    finally:
        jobs.close()
    times = {}
    for rank, (log,) in jobs.logs("trainer").items():
        assert all(e["allreduce_ok"] for e in log if e["kind"] == "train")
        assert [e["step"] for e in log if e["kind"] == "train"] == [1, 2, 3, 4, 5]
        refits = _refits(log)
        assert [e["ok"] for e in refits] == [True, True, False, True, True], refits
        failed = refits[2]
        assert failed["broken"]
        times[f"trainer{rank}"] = _seconds_to_error(failed, killed_at)
        assert [e["kind"] for e in log].count("reconnect") == 1
    inference = jobs.logs("inference")
    (survivor_log,) = inference[0]
    refits = _refits(survivor_log)
    assert [e["ok"] for e in refits] == [True, True, False, True, True], refits
    assert all(e["exact"] for e in refits if e["ok"])
    failed = refits[2]
    assert failed["kept_previous"] and failed["version"] == 2 and failed["broken"]
    times["inference0"] = _seconds_to_error(failed, killed_at)
    assert [e["version"] for e in refits if e["ok"]] == [1, 2, 4, 5]
    killed_log, fresh_log = inference[1]  # the victim's log (up to its death), the restart
    assert [e["version"] for e in _refits(killed_log)] == [1, 2]
    fresh = _refits(fresh_log)
    assert [(e["ok"], e["exact"], e["version"]) for e in fresh] == [(True, True, 4),
                                                                    (True, True, 5)]
    print(f"seconds from {signal.Signals(sig).name} to TransferError:",
          {k: round(v, 2) for k, v in times.items()})
    assert all(0 <= t <= DEADLINE_S + MARGIN_S for t in times.values()), times
    if sig == signal.SIGSTOP:  # a frozen peer: nothing closes; the deadline ends the waits
        assert max(times.values()) >= DEADLINE_S - 5, times


def test_trainer_rank_killed_mid_refit(tmp_path):
    jobs = Jobs(tmp_path)
    victim = f"trainer:1:{KILL_STEP}"
    try:
        world = str(free_port())
        old_trainer0 = jobs.start("trainer", 0, "--world-port", world, "--victim", victim)
        jobs.start("trainer", 1, "--world-port", world, "--victim", victim)
        inference = [jobs.start("inference", r) for r in range(2)]
        _, killed_at = jobs.wait_victim()
        jobs.wait_all([old_trainer0], timeout=60)  # it records its error and exits
        world = str(free_port())  # the restarted trainer job resumes from step 4
        new = [jobs.start("trainer", r, "--world-port", world, "--port-index", "1",
                          "--first-step", str(KILL_STEP + 1)) for r in range(2)]
        jobs.wait_all([*new, *inference])
    finally:
        jobs.close()
    times = {}
    trainer_logs = jobs.logs("trainer")
    old0, new0 = trainer_logs[0]
    refits = _refits(old0)
    assert [e["ok"] for e in refits] == [True, True, False]
    times["trainer0"] = _seconds_to_error(refits[2], killed_at)
    for log in (new0, trainer_logs[1][-1]):
        assert [(e["step"], e["ok"]) for e in _refits(log)] == [(4, True), (5, True)]
    for rank, (log,) in jobs.logs("inference").items():
        refits = _refits(log)
        assert [e["ok"] for e in refits] == [True, True, False, True, True], refits
        failed = refits[2]
        assert failed["kept_previous"] and failed["version"] == 2 and failed["broken"]
        assert all(e["exact"] for e in refits if e["ok"])
        assert [e["version"] for e in refits if e["ok"]] == [1, 2, 4, 5]
        times[f"inference{rank}"] = _seconds_to_error(failed, killed_at)
    print("seconds from SIGKILL to TransferError:", {k: round(v, 2) for k, v in times.items()})
    assert all(0 <= t <= DEADLINE_S + MARGIN_S for t in times.values()), times
