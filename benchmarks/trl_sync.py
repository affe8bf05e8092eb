"""TRL's weight sync through reshard against TRL's own colocate-mode path, on the same tiny
model (issue 42), in one run:

  (a) **reshard, server mode**: a live ``vllm serve`` (TP2, bf16) trained by TRL's
      ``GRPOTrainer`` through ``reshard.integrations.trl`` from 2 FSDP2 ranks (the example
      ``reshard.tools.trl_grpo``), overlapped refits, then stop-the-world ones; per refit
      the trainer's whole sync, the pause it measured and the engine's own swap;
  (b) **TRL colocate**: what ``VLLMGeneration.sync_weights`` does in colocate mode -- every
      parameter through the in-process engine's ``model.load_weights([(name, tensor)])``,
      then ``reset_prefix_cache()`` -- into an in-process vLLM engine (TP1, bf16) from a
      one-rank float32 model (no gather: the cheapest case of that path); the engine runs
      nothing else meanwhile, so the whole load is its pause;
  (c) the gather a 2-rank FSDP2 trainer adds to (b) on every rank: ``full_tensor()`` of
      every parameter (2 gloo processes).

"engine stopped": the trainer-measured pause (overlapped: from the end of its send to the
committed swap; stop-the-world: the whole round); "the swap": the engine ranks' own figure.
One torch thread a process. Prints a table; ``--out DIR`` keeps the JSON.

    .venv/bin/python benchmarks/trl_sync.py [--steps 5] [--reps 10] [--out DIR]
        [--table DIR/trl_sync.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from benchtools import median, write_json
from reshard.comm import free_port
from reshard.integrations import hf
from reshard.tools.serve import Server
from reshard.tools.trl_grpo import run_job


def served(model: Path, steps: int, out: Path, stop_the_world: bool) -> list[dict]:
    """(a): the example's two ranks against a fresh server; each refit's figures."""
    with Server(model, port=free_port(), log=out / "server.log", tokenizer=True) as server:
        extra = ("--stop-the-world",) if stop_the_world else ()
        return run_job(model, server.url, "grpo", out, steps=steps, extra=extra,
                       timeout=1800)["refits"]


def colocate(model: Path, reps: int) -> dict:
    """(b): TRL's colocate sync into an in-process engine, ``reps`` times (seconds). TRL's
    own loop (``model.load_weights`` a tensor at a time) is tried first; where vLLM CPU has
    repacked the linear weights (dropping their ``weight_loader``: AVX-512 hosts) it fails,
    and the same tensors go through vLLM's in-place ``reload_weights`` instead (what its own
    weight-transfer engines call), whose time is the figure."""
    from vllm import LLM

    from reshard.tools.rl_task import KV_CACHE_BYTES, MAX_MODEL_LEN

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    llm = LLM(model=str(model), tensor_parallel_size=1, dtype="bfloat16", seed=0,
              max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    trainer = hf.load_model(model, torch.float32)
    out: dict = {"trl_loop_error": None, "seconds": []}
    for _ in range(reps):
        with torch.no_grad():
            for p in trainer.parameters():
                p.add_(1e-3)  # a training step's change
        t0 = time.perf_counter()
        if out["trl_loop_error"] is None:
            try:
                for name, param in trainer.named_parameters():  # TRL: a tensor a call
                    runner.model.load_weights([(name, param.data)])
            except AttributeError as e:
                out["trl_loop_error"] = f"{type(e).__name__}: {e}"
                t0 = time.perf_counter()
        if out["trl_loop_error"] is not None:
            runner.reload_weights(weights_iterator=(
                (n, p.data) for n, p in trainer.named_parameters()))
        llm.reset_prefix_cache()
        out["seconds"].append(time.perf_counter() - t0)
    return out


def _gather_rank(rank: int, port: int, model: str, reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    trainer = hf.shard_fsdp2(hf.load_model(model, torch.float32))
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for _, p in trainer.named_parameters():
            p.full_tensor()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def gathers(model: Path, reps: int, out: Path) -> list[float]:
    """(c): rank 0's time to gather every parameter of the 2-rank FSDP2 model."""
    import multiprocessing as mp

    port, ctx = free_port(), mp.get_context("spawn")
    procs = [ctx.Process(target=_gather_rank, args=(r, port, str(model), reps,
                                                    str(out / "gather.json")))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    return json.loads((out / "gather.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="print a run's table again")
    a = ap.parse_args()
    if a.table is not None:
        return print_table(json.loads(a.table.read_text()), a.reps)
    torch.set_num_threads(1)
    out = a.out or Path(tempfile.mkdtemp(prefix="trl_sync_"))
    model = hf.build_tiny_model(out / "model", "qwen3")
    mb = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 1e6
    res = {"model_mb": mb}
    for mode in ("overlapped", "stop-the-world"):
        (out / mode).mkdir(parents=True, exist_ok=True)
        res[mode] = served(model, a.steps, out / mode, mode == "stop-the-world")
    res["gather"] = gathers(model, a.reps, out)
    res["colocate"] = colocate(model, a.reps)
    write_json(out / "trl_sync.json", res)
    print(f"JSON in {out}")
    print_table(res, a.reps)


def print_table(res: dict, reps: int) -> None:
    """The table of docs/trl.md (``--table JSON`` prints it again from a run's JSON)."""
    print(f"tiny Qwen3 ({res['model_mb']:.1f} MB bf16), medians")
    print("| path | sync (s) | engine stopped (s) | of which the swap (s) |")
    print("|---|---|---|---|")
    for mode in ("overlapped", "stop-the-world"):
        r = res[mode]
        print(f"| reshard, server TP2, 2 FSDP2 ranks, {mode} ({len(r)} refits) | "
              f"{median([f['seconds'] for f in r]):.3f} | "
              f"{median([f['pause_seconds'] for f in r]):.3f} | "
              f"{median([f['engine_swap_seconds'] for f in r]):.3f} |")
    c, g = median(res["colocate"]["seconds"]), median(res["gather"])
    how = ("load_weights" if res["colocate"]["trl_loop_error"] is None else
           "reload_weights (TRL's own load_weights loop fails here)")
    print(f"| TRL colocate, in-process {how}, 1 rank ({reps} syncs) | {c:.3f} | {c:.3f} | - |")
    print(f"| the same + the FSDP2 gather of every tensor (2 ranks: {g:.3f}) | {c + g:.3f} | "
          f"{c:.3f} | - |")

if __name__ == "__main__":
    main()
