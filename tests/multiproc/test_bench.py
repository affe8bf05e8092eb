"""The benchmark itself: every method verified, the floor measured, checksummed variants."""

from __future__ import annotations

import json

import pytest

from reshard.tools.bench import BenchConfig, run_bench
from reshard.tools.cli import main

pytestmark = pytest.mark.multiproc


def test_bench_small_all_methods():
    cfg = BenchConfig(src="fsdp2", dst="tp2", model_bytes=8 << 20, repeats=1,
                      methods=("reshard", "reshard+sum", "p2p", "gather_broadcast"))
    out = run_bench(cfg, timeout=180)
    assert set(out["methods"]) == set(cfg.methods)
    assert all(m["verified"] for m in out["methods"].values())
    assert out["floor_seconds"] > 0
    assert out["methods"]["reshard"]["bytes"] == out["methods"]["reshard+sum"]["bytes"]
    assert out["methods"]["gather_broadcast"]["bytes"] > out["methods"]["reshard"]["bytes"]


def test_bench_json_last_line(capsys):
    assert main(["bench", "--src", "tp2", "--dst", "tp2", "--model-bytes", "4MiB",
                 "--repeats", "1", "--methods", "reshard,gather_broadcast", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    assert {"methods", "speedup_vs_gather_broadcast", "floor_seconds"} <= set(data)
    assert {"seconds", "bytes", "gbps"} <= set(data["methods"]["reshard"])
