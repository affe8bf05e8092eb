"""``python -m reshard.tools.demo_rl --serve``: the RL demo's loop against a live vLLM server
(``vllm serve``, TP2, float32; :mod:`reshard.tools.serve`), refitted over vLLM's own HTTP
weight-sync protocol with overlapped refits.

The trainer: 2 gloo processes holding the tiny Qwen3 under FSDP2 (float32 master
weights), each meeting the server through ``WeightTransferTrainerFactory.trainer_init``
with vLLM's ``HTTPVLLMWeightSyncClient`` and the reshard trainer engine, with a fresh
token (docs/security.md) that rank 0 gives the server in its init. Each step: the
server samples rollouts over HTTP (``/inference/v1/generate``, token ids); the trainer
ranks take a REINFORCE step and ``send_weights(step)``: the server's ranks receive in the
background while a client keeps generating, then swap between two forward passes. The
checks after every refit, as the local demo's: the server's greedy generation equals
that of transformers holding the trainer's weights; the server's logical weights are bit
for bit what vLLM's own loader makes of them (``reshard_verify`` through
``/collective_rpc``); each rank received exactly its shard; the server's
``weight_version`` is the step.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path
from typing import Any

from reshard.tools.rl_task import (
    CHECK_TOKENS,
    PROMPTS,
    ROLLOUT_TOKENS,
    SYSTEM_PROMPT,
    TP,
    TRAINERS,
    expected_bytes,
    sample_text,
    sparse_note,
    train_step,
)
from reshard.tools.rl_task import reward as _reward

__all__ = ["run"]


def _trainer(rank: int, world: int, model_dir: str, url: str, port: int, out_dir: str,
             steps: int, lr: float, rollouts: list[Any], results: Any, token: str) -> None:
    """One trainer rank: FSDP2 model, REINFORCE on its half of each rollout, refit the
    server through vLLM's HTTP weight-sync client."""
    import torch
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard.integrations import hf
    from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

    torch.manual_seed(0)
    torch.set_num_threads(1)  # two ranks beside the server's two, on a small host
    model = hf.shard_fsdp2(hf.load_model(model_dir, torch.float32))
    engine = WeightTransferTrainerFactory.trainer_init(
        ReshardTrainerInitInfo("127.0.0.1", port, trainer_size=world, inference_size=TP,
                               rank=rank, timeout_s=300, token=token),
        client=HTTPVLLMWeightSyncClient(url), source=model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    for step in range(1, steps + 1):
        batch = rollouts[rank].get(timeout=300)  # [(prompt, completion)], this rank's half
        loss, mean_reward = train_step(model, opt, batch, rank, out_dir, step)
        figures = engine.send_weights(step)
        results.put({"rank": rank, "step": step, "loss": loss, "reward": mean_reward,
                     **figures})
    engine.shutdown()


def _sample(server: Any, step: int) -> list[tuple[list[int], list[int]]]:
    """Two sampled completions of every prompt, over HTTP (seeded by ``step``)."""
    batch = []
    for p in PROMPTS:
        out = server.post("inference/v1/generate", {"token_ids": p, "sampling_params": {
            "temperature": 1.0, "max_tokens": ROLLOUT_TOKENS, "ignore_eos": True, "n": 2,
            "seed": step}})
        batch += [(list(p), c["token_ids"]) for c in out["choices"]]
    return batch


class _Meanwhile:
    """A client generating during the refit: how many tokens it got while the trainer
    sent the next version."""

    def __init__(self, server: Any) -> None:
        self.server, self.halt, self.arrivals = server, threading.Event(), []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.halt.is_set():
            for t, new in self.server.stream(SYSTEM_PROMPT[:100], 150):
                self.arrivals.append((t, len(new)))
                if self.halt.is_set():
                    break

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(300)

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(k for t, k in self.arrivals if t0 <= t <= t1)


def run(work: Path, args: argparse.Namespace) -> int:
    import multiprocessing as mp

    import torch

    from reshard.gate import new_token
    from reshard.integrations import hf
    from reshard.tools.launch import free_port, run_processes
    from reshard.tools.serve import Server

    model_dir = hf.build_tiny_model(work / "tiny-qwen3", "qwen3", vocab_size=500)
    out_dir = work / "steps"
    out_dir.mkdir()
    server = Server(model_dir, port=free_port(), log=work / "server.log", dtype="float32")
    print(f"tiny Qwen3 (vocab 500) in {model_dir}; starting `vllm serve` (TP={TP}, float32): "
          f"{' '.join(server.argv[1:4])} ... (log: {server.log})", flush=True)
    t0 = time.perf_counter()
    failures, steps = 0, args.steps
    token = new_token()  # the meeting's: rank 0 gives it to the server with its init
    with server:
        print(f"vLLM server up at {server.url} in {time.perf_counter() - t0:.1f} s")
        ctx = mp.get_context("spawn")
        rollouts, results = [ctx.Queue() for _ in range(TRAINERS)], ctx.Queue()
        trainer_error: list[BaseException] = []

        def run_trainer() -> None:
            try:
                run_processes(_trainer, TRAINERS, str(model_dir), server.url, free_port(),
                              str(out_dir), steps, args.lr, rollouts, results, token,
                              timeout=900, start_method="spawn")
            except BaseException as e:  # reported after the loop
                trainer_error.append(e)

        thread = threading.Thread(target=run_trainer, daemon=True)
        thread.start()
        ref = hf.load_model(model_dir, torch.float32).eval()
        vocab = ref.config.vocab_size
        for step in range(1, steps + 1):
            batch = _sample(server, step)
            for r in range(TRAINERS):
                rollouts[r].put(batch[r::TRAINERS])
            meanwhile = _Meanwhile(server)
            try:
                trained = [results.get(timeout=600) for _ in range(TRAINERS)]
            except Exception:
                print(f"step {step}: no refit from the trainer: "
                      f"{trainer_error[0] if trainer_error else 'timed out'}")
                meanwhile.stop()
                failures += 1
                break
            meanwhile.stop()
            failures += not _check(server, ref, out_dir, step, batch, trained, meanwhile, vocab)
        thread.join(timeout=120)
    if trainer_error:
        print(f"trainer failed: {trainer_error[0]}")
        failures += 1
    print(f"{steps - failures} of {steps} RL steps against the live server verified"
          f"{'' if failures else ': all OK'}")
    return 1 if failures else 0


def _check(server: Any, ref: Any, out_dir: Path, step: int, batch: list, trained: list[dict],
           meanwhile: _Meanwhile, vocab: int) -> bool:
    """The step's checks (printed as one line); whether all passed."""
    import torch

    from reshard.integrations import hf

    rank0 = next(t for t in trained if t["rank"] == 0)
    tokens = [server.generate(p, CHECK_TOKENS)["tokens"] for p in PROMPTS]
    ref.load_state_dict(torch.load(out_dir / f"step{step}.pt"))
    same = tokens == hf.greedy_tokens(ref, PROMPTS, CHECK_TOKENS)
    verify = server.rpc("reshard_verify", str(out_dir / f"step{step}.pt"))
    exact = all(not v["mismatched"] and not v["live_mismatched"] for v in verify)
    last = server.rpc("reshard_last")
    bytes_ok = all(r["bytes_received"] == expected_bytes(r) for r in last)
    one_swap = len({r["swap_forward"] for r in last}) == 1
    version = server.weight_version()
    ok = same and exact and bytes_ok and one_swap and version == str(step)
    during = meanwhile.tokens_between(rank0["started"], rank0["ended"])
    print(f"step {step}: reward {sum(_reward(c, vocab) for _, c in batch) / len(batch):.3f} "
          f"loss {sum(t['loss'] for t in trained):+.4f} | {sparse_note(trained)}"
          f"overlapped refit v{version}: "
          f"transfer {max(t['transfer_seconds'] for t in trained):.3f} s while serving "
          f"({sum(r['forwards_during_receive'] for r in last) // TP} forward passes, "
          f"{during} tokens streamed around it), engine paused {rank0['pause_seconds']:.3f} s"
          f" to swap | vLLM ranks received {[r['bytes_received'] for r in last]} B | "
          f"generation vs transformers {'OK' if same else 'FAIL'}, weights vs vLLM loader "
          f"{'OK' if exact else 'FAIL'}{'' if bytes_ok else ', bytes FAIL'}"
          f"{'' if one_swap else ', swap steps FAIL'} => {'OK' if ok else 'FAIL'}", flush=True)
    # one of the step's rollouts as text (a different task each step)
    sample = batch[2 * (step - 1) % len(batch)]
    print(f"        sample: {sample_text(hf.tiny_tokenizer(vocab), sample)}", flush=True)
    return ok
