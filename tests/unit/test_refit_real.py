"""The pure parts of ``benchmarks/refit_real.py`` and its modules (the benchmark itself
is not a test): its command line, how gather-and-broadcast cuts its packed buckets (as
vLLM's ``pack_tensors`` does, so both ends agree), the fingerprint comparison, and the
tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the benchmark's modules import each other by name, as they do when it runs as a script
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import refit_real  # noqa: E402 (its command line loads)
from refit_real_models import packed_buckets  # noqa: E402
from refit_real_report import breakdown, table  # noqa: E402
from refit_real_run import mismatches  # noqa: E402


def test_buckets_close_after_the_tensor_that_passes_the_size():
    meta = [("a", [4], "bfloat16"), ("b", [2, 2], "float32"), ("c", [3], "bfloat16"),
            ("d", [1], "bfloat16")]
    # sizes 8, 16, 6, 2: 8 + 16 > 10 closes [a, b]; 6 + 2 stays under
    assert packed_buckets(meta, 10) == [[0, 1], [2, 3]]
    assert packed_buckets(meta, 100) == [[0, 1, 2, 3]]
    assert packed_buckets(meta, 1) == [[0], [1], [2], [3]]
    assert packed_buckets([], 10) == []


def test_mismatches_name_rank_and_entry():
    ref = [{"w": 1, "x": 2}, {"w": 3}]
    assert mismatches(ref, ref) == []
    assert mismatches([{"w": 1, "x": 9}, {"w": 3, "y": 4}], ref) == [
        "rank 0: x", "rank 1: y"]


def _method(median: float, received: int) -> dict:
    return {"median": median, "seconds": [median], "bytes_received": [received, received],
            "trainer0_peak_extra": 10**6, "engine_peak_extra": [2 * 10**6, 2 * 10**6],
            "check": {"ok": True}, "load": "1.00 1.00 1.00"}


def test_table_reads_each_method_against_reshard_and_the_floor():
    reshard = {**_method(2.0, 600_000_000), "expected_bytes": [600_000_000] * 2,
               "floor": {"seconds": [1.0, 1.0, 1.0]}, "init_seconds": 1.5,
               "breakdown": [{"trainer_transfer": 1.2, "receive": 1.2, "commit": 0.6,
                              "engine_total": 1.9}]}
    results = [{"model": "m", "params": 6 * 10**8,
                "methods": {"reshard": reshard, "disk": _method(9.0, 1_200_000_000)}}]
    rows = table(results).splitlines()
    assert "| m | 0.60B | reshard | 2.000 s | 1.00x | 600 MB / 600 MB |" in rows[2]
    assert "| disk | 9.000 s | 4.50x | 1,200 MB / 1,200 MB |" in rows[3]
    assert "| floor | 1.000 s | 0.50x |" in rows[4]
    assert "| m | 2.000 s | 1.50 s | 1.200 s | 1.000 s | 0.600 s | 0.100 s |" in \
        breakdown(results)


def test_the_command_line_keeps_its_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        refit_real.main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    for option in ("--models", "--methods", "--repeats", "--out", "--plot", "--png",
                   "--max-gib", "--margin-gib", "--budget-mib", "--heap-slack-mib",
                   "--profile"):
        assert option in usage
