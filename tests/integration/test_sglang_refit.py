"""A live SGLang server refitted by an FSDP2 trainer (2 gloo ranks) through reshard, every
refit bit for bit against a fresh SGLang server of the same step (docs/sglang.md).

One scenario per family, each on its own server (``python -m sglang.launch_server``,
bf16, started by the CPU harness ``reshard.tools.sglang_cpu``):

* Llama at TP2: refits 1 and 2; before each, a long prompt is asked twice (the second
  time SGLang serves it from its radix cache, computed with the old weights); after each
  refit the server answers greedy tokens and logprobs (prompt logprobs of short prompts,
  the long prompt's sample logprobs, now computed anew: the cache was flushed) exactly
  as a fresh server loaded from the trainer's checkpoint of that step, its weights'
  checksums (``/weights_checker``) are the fresh server's on every rank, SGLang's weight
  version is the step, and each rank received exactly its shard's bytes. Refit 3: trainer
  rank 1 SIGKILLs itself midway through its sends; the refit fails on the server, which
  serves version 2 exactly (answers, checksums, weight version).
  Then a Megatron-Core trainer (TP2, 2 ranks, ``megatron.refit_params``) meets the same
  server and refits it once: the same checks against a fresh server of its checkpoint
  (rebuilt from its saved shards by ``reshard.tools.megatron_hf``).
* Qwen3 with tied embeddings at TP1: refits 1 and 2, the same checks.

The fresh servers start after the live one stops, all at once (two cores).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

if importlib.util.find_spec("sglang") is None:  # imported by its own processes only
    pytest.skip("SGLang is not installed (make setup installs it)", allow_module_level=True)

from reshard.errors import TransferError  # noqa: E402
from reshard.integrations import hf  # noqa: E402
from reshard.integrations.sglang import SglangRefit  # noqa: E402
from reshard.tools.launch import free_port  # noqa: E402
from reshard.tools.rl_task import SYSTEM_PROMPT as LONG_PROMPT  # noqa: E402
from reshard.tools.sglang_cpu import SglangServer  # noqa: E402

JOB = Path(__file__).with_name("_sglang_trainer_job.py")
MEGATRON_JOB = Path(__file__).with_name("_megatron_trainer_job.py")
PROMPTS = [[1, 17, 42, 99, 256, 3, 7], [1, 300, 301, 302], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
MAX_TOKENS = 8


def answers(server: SglangServer) -> dict:
    """Greedy tokens and logprobs: the long prompt's first (sample logprobs; how much
    of it the radix cache held), then each short prompt's (its prompt logprobs too)."""
    tokens, lps, _, cached = server.generate(LONG_PROMPT, MAX_TOKENS)
    out = {"long": (tokens, lps), "long_cached": cached}
    for i, p in enumerate(PROMPTS):
        tokens, lps, prompt_lps, _ = server.generate(p, MAX_TOKENS, logprob_start_len=0)
        out[f"prompt{i}"] = (tokens, lps, prompt_lps)
    return out


def checksums(server: SglangServer) -> list:
    """Per rank, SGLang's checksum of each weight (``/weights_checker``)."""
    reply = server.post("weights_checker", {"action": "checksum"})
    ranks = sorted((r["parallelism_info"][0]["tp_rank"], r["checksums"]) for r in reply["ranks"])
    assert ranks and all(sums for _, sums in ranks), reply  # something to compare
    return ranks


def shard_bytes(cfg, tp: int, rank: int, itemsize: int = 2) -> int:
    """What SGLang TP rank ``rank`` holds of the HF tensors, from the config alone:
    matrices split in ``tp``, norms whole, the vocabulary padded to a multiple of 64
    and split evenly (padding rows carry no bytes)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    per = -(-cfg.vocab_size // 64) * 64 // tp
    real = max(0, min(per, cfg.vocab_size - rank * per))
    n = (1 if cfg.tie_word_embeddings else 2) * real * h + h
    attn = (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd * h // tp
    norms = 2 * hd if cfg.model_type == "qwen3" else 0  # q_norm, k_norm
    n += cfg.num_hidden_layers * (attn + norms + 3 * cfg.intermediate_size * h // tp + 2 * h)
    return n * itemsize


def wait_for(path: Path, job: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None or path.exists(), f"the trainer job exited ({job.returncode})"
        assert time.monotonic() < deadline, f"no {path.name} within {timeout} s"
        time.sleep(0.2)


def live_scenario(model: Path, tmp: Path, tp: int, steps: int, die_at: int = -1,
                  then=None) -> dict:
    """The live server refitted ``steps`` times (refit ``die_at`` loses trainer rank 1):
    per step, what the server answered and reported; then ``then(server, refit)``'s
    record, on the same server."""
    out = tmp / "out"
    out.mkdir()
    records = {}
    with SglangServer(model, port=free_port(), log=tmp / "live.log", tp=tp) as server:
        refit, port = SglangRefit(server.url), free_port()
        with open(tmp / "job.log", "w") as log:
            job = subprocess.Popen([sys.executable, str(JOB), str(model), str(port), str(out),
                                    "--steps", str(steps), "--inference-size", str(tp),
                                    "--die-at", str(die_at), "--wait-go"],
                                   stdout=log, stderr=subprocess.STDOUT, process_group=0)
        try:
            infos = refit.init("127.0.0.1", port, 2)
            for step in range(1, steps + 1):
                wait_for(out / f"step{step}", job)
                cached = [server.generate(LONG_PROMPT, MAX_TOKENS)[3] for _ in range(2)]
                (out / f"go{step}").touch()
                try:
                    result = refit.refit(step)
                except TransferError as e:
                    result = {"error": str(e), "outcomes": refit.outcomes}
                records[step] = {"result": result, "cached_before": cached,
                                 "answers": answers(server), "checksums": checksums(server),
                                 "version": refit.weight_version()}
            job.wait(timeout=120)
        finally:  # the job and its ranks
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
        after = then(server, refit) if then is not None else None
    codes = json.loads((tmp / "job.log").read_text().strip().splitlines()[-1])["codes"]
    return {"infos": infos, "records": records, "out": out, "codes": codes, "then": after}


def megatron_refit(model: Path, tmp: Path, server: SglangServer, refit: SglangRefit) -> dict:
    """A Megatron-Core trainer (TP2 over 2 gloo ranks, ``megatron.refit_params``) meets
    the same server anew and refits it once (its version 1); its step's HF checkpoint is
    rebuilt from the trainer's saved shards by ``reshard.tools.megatron_hf``."""
    from reshard.tools import megatron_hf as MH

    out, port = tmp / "megatron", free_port()
    out.mkdir()
    with open(out / "job.out", "w") as so, open(out / "job.err", "w") as se:
        job = subprocess.Popen([sys.executable, str(MEGATRON_JOB), str(out), "--kind", "llama",
                                "--tp", "2", "--steps", "1", "--port", str(port),
                                "--vocab", "512", "--inference-size", "2"],
                               stdout=so, stderr=se, process_group=0)
    try:
        refit.init("127.0.0.1", port, 2, timeout_s=180)
        result = refit.refit(1)
        job.wait(timeout=180)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, (out / "job.err").read_text()[-3000:]
    state = MH.to_hf(MH.load_ranks(out, 1), vocab=512, heads=4, groups=2, head_dim=32)
    hf.save_checkpoint(model, state, out / "step1")
    return {"result": result, "answers": answers(server), "checksums": checksums(server),
            "version": refit.weight_version(), "checkpoint": out / "step1"}


def fresh(checkpoints: dict, tmp: Path, tp: int) -> dict:
    """Fresh servers of the given checkpoints (key -> model dir), started together
    (their start-up is mostly one process's imports: they overlap on two cores): per
    key, the answers and weight checksums."""
    servers = {k: SglangServer(path, port=free_port(), log=tmp / f"fresh_{k}.log", tp=tp)
               for k, path in checkpoints.items()}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready()
        return {k: {"answers": answers(server), "checksums": checksums(server)}
                for k, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def check_refit(rec: dict, ref: dict, step: int, cfg, tp: int) -> None:
    if "cached_before" in rec:  # asked twice before the refit
        assert rec["cached_before"][1] > 0  # the long prompt's KV held in the radix cache
    assert rec["answers"]["long_cached"] == 0  # flushed at the commit: computed anew
    assert rec["answers"] == ref["answers"]  # tokens and logprobs, exactly
    assert rec["checksums"] == ref["checksums"]  # every weight of every rank
    assert rec["version"] == str(step)
    assert [o["rank"] for o in rec["result"]] == list(range(tp))
    for o in rec["result"]:
        assert o["ok"] and o["version"] == step
        sparse = o["sparse"]  # the trainer's default sparse="auto": after the first refit
        if sparse is None:
            assert o["bytes_received"] == o["expected_bytes"] == shard_bytes(cfg, tp, o["rank"])
        else:  # its regions cover exactly the rank's shard; only the changed values came
            assert sparse["dense_bytes"] == o["expected_bytes"] == shard_bytes(cfg, tp, o["rank"])
            assert o["bytes_received"] == sparse["wire_bytes"] <= 1.02 * sparse["dense_bytes"]


def test_fsdp2_trainer_refits_sglang_tp2_and_a_lost_rank_keeps_the_version(tmp_path):
    model = hf.build_tiny_model(tmp_path / "llama", "llama")
    cfg = hf.tiny_config("llama")
    live = live_scenario(model, tmp_path, tp=2, steps=3, die_at=3,
                         then=lambda server, refit: megatron_refit(model, tmp_path, server,
                                                                   refit))
    assert [i["rank"] for i in live["infos"]] == [0, 1]
    megatron = live["then"]
    refs = fresh({1: live["out"] / "step1", 2: live["out"] / "step2",
                  "megatron": megatron["checkpoint"]}, tmp_path, 2)
    for step in (1, 2):
        check_refit(live["records"][step], refs[step], step, cfg, 2)
    # the trainer's default sparse="auto": step 1 dense, step 2 sparse, both exact
    assert [bool(o["sparse"]) for s in (1, 2) for o in live["records"][s]["result"]] == [
        False, False, True, True]
    assert live["codes"] == [0, -9]  # rank 1 SIGKILLed itself in refit 3
    lost = live["records"][3]  # version 2, whole, on every rank; its cache kept
    assert "refit failed on SGLang rank(s) [0, 1]" in lost["result"]["error"]
    assert not any(o["ok"] for o in lost["result"]["outcomes"])
    assert lost["version"] == "2"  # SGLang recorded no new version
    kept = {k: v for k, v in lost["answers"].items() if k != "long_cached"}
    assert kept == {k: v for k, v in refs[2]["answers"].items() if k != "long_cached"}
    assert lost["answers"]["long_cached"] > 0  # nothing committed, nothing flushed
    assert lost["checksums"] == refs[2]["checksums"]
    # then a Megatron-Core trainer (TP2) meets the same server: the same checks
    # (the long prompt, cached when version 2 answered above, computed anew after it)
    check_refit(megatron, refs["megatron"], 1, cfg, 2)


def test_fsdp2_trainer_refits_sglang_tp1_tied_qwen3(tmp_path):
    model = hf.build_tiny_model(tmp_path / "qwen3", "qwen3", tie_word_embeddings=True)
    cfg = hf.tiny_config("qwen3", tie_word_embeddings=True)
    live = live_scenario(model, tmp_path, tp=1, steps=2)
    assert live["codes"] == [0, 0]
    refs = fresh({s: live["out"] / f"step{s}" for s in (1, 2)}, tmp_path, 1)
    for step in (1, 2):
        check_refit(live["records"][step], refs[step], step, cfg, 1)
    assert [bool(o["sparse"]) for s in (1, 2) for o in live["records"][s]["result"]] == [
        False, True]  # the trainer's default sparse="auto": the second refit sparse
