"""``benchmarks/gpu_check.py`` (the package ``benchmarks/gpu_checks/``) on the host, so that
it cannot rot between GPU runs: its arguments, the one line it prints without a GPU, its
report, and its measurements and checks run small on the CPU (``--device cpu --quick``, a
debug mode, not a GPU measurement)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reshard.schedule import flat_schedule

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.append(str(ROOT / "benchmarks"))  # where the script finds its package

import gpu_checks as gc  # noqa: E402
from gpu_checks import features, pytest_runs, staging  # noqa: E402

# ---------------------------------------------------------------------------- arguments

def test_defaults():
    args = gc.parse_args([])
    assert args.out == Path("gpu_check_out")
    assert (args.device, args.model, args.src, args.dst) == ("cuda", "qwen3-8b", "tp4", "tp2,dp2")
    assert (args.copy_mib, args.repeats, args.max_gib, args.packer) == (1024, 10, 4.0, "library")
    assert (args.budget_mib, args.pytest_jobs, args.time_limit) == (256, 4, 480.0)
    assert not (args.quick or args.no_pytest or args.no_probes) and args.probe is None


def test_quick_fills_small_defaults_and_keeps_given_ones():
    args = gc.parse_args(["--quick", "--device", "cpu", "--out", "x", "--repeats", "3"])
    assert (args.model, args.copy_mib, args.repeats, args.out) == ("tiny-qwen3", 8, 3, Path("x"))


@pytest.mark.parametrize("argv, message", [
    (["--repeats", "0"], "--repeats: expected an integer >= 1, got '0'"),
    (["--copy-mib", "1.5"], "--copy-mib: expected an integer >= 1, got '1.5'"),
    (["--max-gib", "lots"], "--max-gib: expected a number >= 0.01, got 'lots'"),
    (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
    (["--model", "gpt-5"], "--model: invalid choice: 'gpt-5'"),
    (["--src", "tq4"], "--src: bad parallel spec 'tq4'"),
    (["--probe", "nope"], "--probe: expected one of ['colocated', 'cuda-ipc', 'nccl-peer'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_name_what_was_expected(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------- no GPU

def test_without_a_gpu_one_line_exit_0_nothing_written(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "out"
    got = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert got.returncode == 0, got.stderr
    assert re.fullmatch(r"gpu_check: no CUDA device here \(torch [^)]+\); nothing to measure\n",
                        got.stdout), got.stdout
    assert got.stderr == "" and not out.exists()


# ---------------------------------------------------------------------------- report

def _results(packing_fraction: float = 0.9, failed: bool = False):
    copy_gbps = 2000.0
    nbytes = 1 << 30
    seconds = nbytes / (copy_gbps * packing_fraction * 1e9)
    return gc.Results(
        mode="gpu",
        env={"python": "3.12.3", "torch": "2.11.0+cu128", "torch_cuda": "12.8",
             "device": "cuda", "device_name": "NVIDIA H200", "nccl": "2.27.3"},
        features=[gc.Check("torch: _StridedShard", gc.PASS, "used by reshard.dtensor")],
        checks=[gc.Check("execute_local [cuda]", gc.FAIL if failed else gc.PASS, "d", 0.1),
                gc.Check("digest [cuda]", gc.ERROR, "raises", 0.2)],
        copy={"nbytes": nbytes, "seconds": nbytes / copy_gbps / 1e9, "gbps": copy_gbps,
              "verified": True, "status": gc.PASS},
        packing_setup={"model": "qwen3-8b", "dtype": "bfloat16", "src": "tp4", "dst": "tp2,dp2",
                       "schedule": "flat (p2p)", "budget_bytes": 256 << 20,
                       "max_bytes": 4 << 30, "packer": "library"},
        packing=[gc.PackingResult("row_parallel", "pack", 0, "36/36", gc.PASS, 72, nbytes,
                                  seconds, "library", 3 << 30),
                 gc.PackingResult("row_parallel", "unpack", 4, "36/36", gc.PASS, 72, nbytes,
                                  2 * seconds, "library", 3 << 30),
                 gc.PackingResult("column_parallel", "pack", 0, "0/36", gc.SKIPPED,
                                  detail="too big")],
        probes=[gc.Check("two NCCL processes on one GPU", gc.ERROR, "Duplicate GPU", 3.0)],
        pytest_runs=[gc.PytestRun("tests/unit/test_layout.py", gc.PASS, 30, 0, 0, 1, 2.5,
                                  "pytest exit code 0", [], ["t::x: needs vllm"])],
        not_run=[("tests/unit/test_cards.py", "network namespaces")],
        seconds=123.0)


def test_report_json_keys_and_derived_numbers():
    report, _ = gc.build_report(_results())
    assert {"mode", "label", "env", "features", "checks", "copy", "packing_setup", "packing",
            "probes", "pytest_runs", "not_run", "seconds", "summary"} <= set(report)
    json.loads(json.dumps(report))  # plain JSON all through
    pack, unpack, skipped = report["packing"]
    assert pack["gbps"] == pytest.approx(1800.0) and pack["fraction_of_copy"] == pytest.approx(0.9)
    assert pack["meets_goal"] and unpack["meets_goal"] is False
    assert skipped["gbps"] is None and skipped["meets_goal"] is None
    summary = report["summary"]
    assert summary["ok"] and summary["exit_code"] == 0 and summary["mismatches"] == []
    assert summary["packing_below_goal"] == ["row_parallel unpack"]
    assert summary["packing_worst_fraction"] == pytest.approx(0.45)
    assert summary["errors"] == ["digest [cuda]", "two NCCL processes on one GPU"]
    assert summary["num_skipped"] == 1
    assert report["not_run"] == [{"file": "tests/unit/test_cards.py",
                                  "reason": "network namespaces"}]


def test_report_table_lines():
    _, table = gc.build_report(_results())
    lines = table.splitlines()
    assert lines[0] == "gpu_check (GPU measurement)"
    assert lines[1].startswith("NVIDIA H200 (cuda), torch 2.11.0+cu128, CUDA 12.8, NCCL 2.27.3")
    assert "1024 MiB copy_ on the device, 2000.0 GB/s, verified" in lines[2]
    row = next(line for line in lines if line.startswith("row_parallel     pack"))
    assert row.split()[2:] == ["0", "36/36", "72", "1024.0", "1800.0", "90.0%", "pass"]
    assert "goal: >= 80% of copy bandwidth; below it: row_parallel unpack" in lines
    assert any(line.startswith("two NCCL processes on one GPU  error") for line in lines)
    assert "  skipped: t::x: needs vllm" in lines
    assert "  tests/unit/test_cards.py: network namespaces" in lines
    assert lines[-1] == ("result: OK: no wrong result; 2 errors, 1 skipped; 123 s "
                         "(GPU measurement)")


def test_a_mismatch_and_only_a_mismatch_makes_exit_1():
    assert gc.exit_code(_results()) == 0  # errors and skips do not count
    bad = _results(failed=True)
    report, table = gc.build_report(bad)
    assert gc.exit_code(bad) == 1 and report["summary"]["mismatches"] == ["execute_local [cuda]"]
    assert table.splitlines()[-1].startswith("result: WRONG RESULTS: execute_local [cuda];")
    bad = _results()
    bad.packing[0].status = gc.FAIL
    assert gc.exit_code(bad) == 1


# ---------------------------------------------------------------------------- on the host

def test_quick_cpu_run_writes_the_report(tmp_path, capsys, monkeypatch):
    # importing the vLLM integration takes seconds where vLLM is installed; the rest stays
    monkeypatch.setattr(features, "MODULES", tuple(m for m in features.MODULES if m[1] is None))
    out = tmp_path / "out"
    assert gc.main(["--device", "cpu", "--quick", "--no-pytest", "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    table = (out / "gpu_check.txt").read_text()
    assert capsys.readouterr().out == table
    assert report["mode"] == "cpu-debug" and table.startswith(
        "gpu_check (CPU DEBUG RUN: not a GPU measurement)")
    assert report["copy"]["status"] == "pass" and report["copy"]["gbps"] > 0
    assert [(p["workload"], p["side"], p["status"]) for p in report["packing"]] == [
        (w.name, side, "pass") for w in gc.WORKLOADS for side in ("pack", "unpack")]
    assert all(p["num_regions"] > 0 and p["gbps"] > 0 for p in report["packing"])
    status = {c["name"].removesuffix(" [cpu]"): c["status"] for c in report["checks"]}
    assert status.pop("gloo group of one refuses device tensors") == "skipped"
    quant = next(c for c in report["checks"] if c["name"].startswith("FP8 block quant"))
    assert quant["status"] == "pass" and "bit for bit the reference" in quant["detail"]
    # the digest raises on buffers under 8 bytes starting off an 8-byte boundary (reported
    # as an error of the library); every other case must agree
    assert status.pop("digest sum/crc32, host vs device") in ("pass", "error")
    assert set(status.values()) == {"pass"}, status
    assert {p["status"] for p in report["probes"]} == {"skipped"}
    assert report["summary"]["ok"] and report["pytest_runs"] == []
    assert report["args"]["out"] == str(out) and report["args"]["quick"] is True


def test_sparse_refit_check_passes_and_fails_on_a_wrong_apply(monkeypatch):
    from gpu_checks.correctness import load_inproc
    from gpu_checks.sparse import check_sparse_threads
    from reshard._transport import sparse as codec

    status, detail = check_sparse_threads("cpu", load_inproc)
    assert status == gc.PASS and "offsets16" in detail, detail
    real = codec.decode_into_many

    def one_sign_wrong(items):  # every value applied, then one flipped back
        out = real(items)
        if items:
            region = items[0][0]
            first = (0,) * region.dim()
            region[first] = -region[first]
        return out

    monkeypatch.setattr(codec, "decode_into_many", one_sign_wrong)
    status, detail = check_sparse_threads("cpu", load_inproc)
    assert status == gc.FAIL and "differ from a dense refit's" in detail, detail


@pytest.mark.parametrize("path", ["native", "device"])
def test_sparse_detection_measure_is_exact_on_either_path(path, monkeypatch):
    from gpu_checks.sparse import measure_sparse_detection
    from reshard._transport import sparse as codec

    if path == "device":  # the scans a device runs (torch), here on the host
        monkeypatch.setattr(codec, "encode_fused", lambda *a, **k: None)
    args = gc.parse_args(["--device", "cpu", "--quick"])
    check = measure_sparse_detection(args)
    assert check.status == gc.PASS and check.detail.count("x the dense cast") == 3, check
    monkeypatch.setattr(codec, "decode_into", lambda *a, **k: None)  # the payload lost
    check = measure_sparse_detection(args)
    assert check.status == gc.FAIL and "not exact at 0.1%, 1.0%, 5.0%" in check.detail


def _tiny_plan():
    plan, _ = gc.tiny_problem("cpu")
    return plan, flat_schedule(plan, 4096)


@pytest.mark.parametrize("side, rank", [("pack", 0), ("unpack", 4)])
def test_library_and_plain_stagers_copy_the_same_regions(side, rank):
    plan, schedule = _tiny_plan()
    got = {kind: gc.measure_side(plan, schedule, side, rank, device="cpu", repeats=1,
                                 packer=kind) for kind in ("library", "plain")}
    assert got["library"]["packer"] == "library" and got["plain"]["packer"] == "plain"
    for result in got.values():
        assert result["status"] == "pass" and result["num_regions"] > 1
    assert got["library"]["nbytes"] == got["plain"]["nbytes"] > 0


def test_unreachable_library_staging_falls_back_to_plain(monkeypatch):
    plan, schedule = _tiny_plan()

    def broken(*args, **kwargs):
        raise AttributeError("'RankRunner' object has no attribute '_arenas'")

    monkeypatch.setattr(staging, "LibraryStager", broken)
    stager = gc.make_stager("library", schedule, 0, gc.plan_dtypes(plan), "cpu")
    assert isinstance(stager, gc.PlainStager)
    assert stager.name == ("plain (library staging not reachable: AttributeError: "
                           "'RankRunner' object has no attribute '_arenas')")


def test_lay_out_aligns_every_region_and_orders_peers():
    plan, schedule = _tiny_plan()
    hops = [h for r in schedule.rounds for h in r if h.src_rank == 0]
    messages = gc.lay_out(hops, lambda h: h.dst_rank)
    assert [m[2][0].dst_rank for m in messages] == sorted({h.dst_rank for h in hops})
    for start, stop, group, offsets in messages:
        assert start % gc.ALIGN == 0 and all(o % gc.ALIGN == 0 for o in offsets)
        assert stop == start + offsets[-1] + group[-1].nbytes
    assert sum(len(m[2]) for m in messages) == len(hops)


def test_ipc_probe_runs_in_a_subprocess_on_the_host(tmp_path):
    (check,) = gc.probe_in_subprocess("cuda-ipc", tmp_path, 120, device="cpu")
    assert check.status == "pass", check
    assert check.name.startswith("shared host memory (debug) between two processes")


def test_colocated_probe_runs_in_a_subprocess_on_the_host(tmp_path):
    """Two processes, each a trainer and an engine rank, through the colocated transport:
    exact after a first refit, an in-place update and a reallocation; then timed."""
    (check,) = gc.probe_in_subprocess("colocated", tmp_path, 120, device="cpu",
                                      extra=("--quick",))
    assert check.status == "pass", check
    assert check.name.startswith("colocated transport over shared host memory (debug)")
    assert check.detail.count("25 tensors exact after 3 refits") == 2, check.detail
    assert "GB/s" in check.detail


def test_probe_results_say_how_a_silent_probe_ended(tmp_path):
    log = tmp_path / "probe.log"
    log.write_text("starting\nRuntimeError: no NCCL\n")
    (timed_out,) = gc.probe_results("p", None, log, 90)
    assert (timed_out.status, timed_out.detail) == ("error", "timed out after 90 s, killed")
    (crashed,) = gc.probe_results("p", 1, log, 90)
    assert crashed.detail == "exit code 1: starting | RuntimeError: no NCCL"
    log.write_text(gc.PROBE_TAG + json.dumps({"name": "x", "status": "pass"}) + "\nhung\n")
    assert gc.probe_results("p", 0, log, 90) == [gc.Check("x", "pass")]
    first, killed = gc.probe_results("p", None, log, 90)  # what it said before it hung stays
    assert first == gc.Check("x", "pass") and killed.status == "error"


# ---------------------------------------------------------------------------- pytest runs

def test_every_test_file_is_run_or_left_out_with_a_reason():
    chosen, not_run = gc.select_tests(ROOT)
    assert chosen == list(gc.TESTS_RUN)  # a renamed file shows here, not on the GPU
    present = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py"))
    assert sorted(chosen + [f for f, _ in not_run]) == present
    assert ("tests/unit/test_gpu_check.py", "this check's own CPU test") in not_run
    assert all(why for _, why in not_run)
    unclassified = [f for f, why in not_run if why == gc.UNCLASSIFIED]
    assert not unclassified, (
        f"add to TESTS_RUN or LEFT_OUT in gpu_checks/pytest_runs.py: {unclassified}")


def test_run_test_file_counts_and_reasons(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_wrong():\n    assert 1 == 2\n"
        "@pytest.mark.skip(reason='needs a GPU')\ndef test_later():\n    pass\n")
    run = gc.run_test_file("test_sample.py", tmp_path, 60, cwd=tmp_path)
    assert (run.status, run.passed, run.failed, run.errors, run.skipped) == ("fail", 1, 1, 0, 1)
    assert run.failures[0].startswith("test_sample::test_wrong: assert 1 == 2")
    assert run.skips == ["test_sample::test_later: needs a GPU"]


def test_run_test_file_kills_a_file_past_its_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(pytest_runs, "MIN_TEST_SECONDS", 2.5)
    (tmp_path / "test_slow.py").write_text("import time\ndef test_sleeps():\n    time.sleep(60)\n")
    run = gc.run_test_file("test_slow.py", tmp_path, 3, cwd=tmp_path)
    assert run.status == "error" and run.detail.startswith("timed out after 3 s, killed")
    assert run.seconds < 30
    assert gc.run_test_file("test_slow.py", tmp_path, 2, cwd=tmp_path).detail == (
        "out of time (--pytest-budget)")
