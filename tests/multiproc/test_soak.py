"""CI soak: 20 consecutive refits with random updates across a 2 + 2 process group
(``benchmarks/soak.py``), every destination checked after every refit; no process grows
its resident memory beyond a small tolerance, nor its open files or threads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
SOAK = Path(__file__).parents[2] / "benchmarks" / "soak.py"
RSS_TOLERANCE_MIB = 16  # allocator noise; a leak of a shadow or an arena (MiBs) per refit
                        # would show far beyond it


@pytest.mark.parametrize("checksum", ["none", "sum"])
def test_soak_20_refits_no_growth(tmp_path, checksum):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SOAK), "--refits", "20", "--hidden", "128",
                          "--checksum", checksum, "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    print(run.stdout)
    report = json.loads(out.read_text())
    for res in report["ranks"]:
        first, last = res["first"], res["last"]
        assert res["mismatches"] == [], res
        assert last["rss_mib"] - first["rss_mib"] <= RSS_TOLERANCE_MIB, res
        assert last["fds"] <= first["fds"], res
        assert last["threads"] <= first["threads"], res
