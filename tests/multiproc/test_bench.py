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


def test_bench_into_an_fp8_engine_counts_codes_and_scales_and_verifies_them():
    """fsdp3 rows end mid-block (blocks shared by two trainer ranks, amax exchanged);
    the engine's linears arrive as FP8 codes plus scales, each checked against the
    reference quantizer of the full tensor; fewer bytes than the float32 engine."""
    common = dict(src="fsdp3", dst="dp2", model_bytes=8 << 20, repeats=1,
                  methods=("reshard", "p2p"))
    plain = run_bench(BenchConfig(**common), timeout=180)
    fp8 = run_bench(BenchConfig(**common, dst_dtype="float8_e4m3fn"), timeout=180)
    assert all(m["verified"] for m in fp8["methods"].values())
    assert fp8["quantize"]["amax_bytes_per_source_rank"] > 0
    assert fp8["quantize"]["seconds"] > 0
    assert fp8["methods"]["reshard"]["bytes"] < 0.5 * plain["methods"]["reshard"]["bytes"]
