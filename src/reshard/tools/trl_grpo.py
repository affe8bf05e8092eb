"""TRL's GRPO training a tiny model against a live ``vllm serve`` through reshard, every
trainer rank sending its own FSDP2 shards: the example of docs/trl.md, and the trainer
job of ``tests/integration/test_vllm_serve_trl.py``. One rank of it (two under torchrun)::

    torchrun --standalone --nproc-per-node 2 -m reshard.tools.trl_grpo \\
        --model MODEL_DIR --server http://127.0.0.1:8000 --trainer grpo --steps 3 --out OUT

``--trainer grpo``: ``GRPOTrainer`` in server mode (``ReshardGRPOTrainer``);
``--trainer async``: ``AsyncGRPOTrainer`` (``ReshardAsyncGRPOTrainer``). ``MODEL_DIR`` is
what the server serves (a tiny model and its tokenizer: ``reshard.integrations.hf
.build_tiny_model``); the trainer loads it in float32 and shards it with FSDP2. The task:
prompts of the tiny vocabulary's words behind a shared prefix; the reward, the share of
completion words that start before "m" (trivial, yet it differs within a group, so every
step moves the weights). After training the ranks save the policy (``OUT/final``, what a
fresh engine of the last step loads) and rank 0 writes ``OUT/result.json``: each refit's
figures (version, time, the trainer-measured ``pause_seconds``, and the engine's own
``engine_swap_seconds``), the weight versions, TRL's log, and how many tensors were
gathered (``full_tensor``) while training: none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reshard.integrations import hf
from reshard.integrations.trl import ReshardWeightTransfer

#: The prompts' shared prefix and their own words (all of the tiny vocabulary).
PREFIX = ("the trainer sends its weights to an engine that answers with words and after "
          "every step a new version of each layer moves from one layout into another")
WORDS = ["river stone cloud", "red blue green", "one two three", "ship boat sail",
         "song book page", "fox deer owl", "bread milk tea", "early late small"]
#: The chat template the tiny tokenizer gets (AsyncGRPO renders conversations with one).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
#: How AsyncGRPO reads an answer back into a message (transformers' response templates):
#: all of it is the content.
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}


def reward_first_half(completions: list[Any], **_: Any) -> list[float]:
    """The share of a completion's words that start before "m" (module level: AsyncGRPO
    sends it to its rollout process)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else " ".join(m.get("content", "") for m in c)
        words = text.split()
        out.append(sum(w[0] < "m" for w in words) / max(1, len(words)))
    return out


class MeasuredTransfer(ReshardWeightTransfer):
    """The transfer, plus on rank 0 the engine's own figures of each refit (its ranks'
    ``reshard_last`` through vLLM's ``/collective_rpc``: how long each swap stopped it)."""

    def refit(self, model: Any, step: int) -> dict[str, Any]:
        figures = super().refit(model, step)
        if figures.get("pause_seconds") is not None:
            import requests

            ranks = requests.post(f"{self.server_url}/collective_rpc", timeout=60,
                                  json={"method": "reshard_last", "args": []}).json()["results"]
            figures["engine_swap_seconds"] = max(r.get("swap_seconds", 0.0) for r in ranks)
            figures["engine_versions"] = [r.get("version") for r in ranks]
        return figures


def _dataset(conversational: bool) -> Any:
    from datasets import Dataset

    prompts = [f"{PREFIX} {w}" for w in WORDS]
    if conversational:
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    return Dataset.from_dict({"prompt": prompts})


def _common(a: argparse.Namespace) -> dict[str, Any]:
    """The settings both trainers take (what changes from TRL's defaults: docs/trl.md)."""
    return dict(output_dir=str(Path(a.out) / "trl"), max_steps=a.steps, learning_rate=1e-2,
                per_device_train_batch_size=2, num_generations=4, max_completion_length=8,
                logging_steps=1, report_to="none", save_strategy="no", seed=0, use_cpu=True,
                fsdp="full_shard", fsdp_config={"fsdp_version": 2},
                vllm_server_base_url=a.server)


def build(a: argparse.Namespace, transfer: ReshardWeightTransfer, tokenizer: Any) -> Any:
    """The trainer ``a.trainer`` names, syncing through ``transfer``."""
    if a.trainer == "grpo":
        from trl import GRPOConfig

        from reshard.integrations.trl import ReshardGRPOTrainer

        config = GRPOConfig(**_common(a), use_vllm=True, vllm_mode="server",
                            model_init_kwargs={"dtype": torch.float32})
        return ReshardGRPOTrainer(model=a.model, reward_funcs=reward_first_half, args=config,
                                  train_dataset=_dataset(False), processing_class=tokenizer,
                                  transfer=transfer)
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from reshard.integrations.trl import ReshardAsyncGRPOTrainer

    config = AsyncGRPOConfig(**_common(a), max_staleness=1)
    return ReshardAsyncGRPOTrainer(model=a.model, reward_funcs=reward_first_half, args=config,
                                   train_dataset=_dataset(True), processing_class=tokenizer,
                                   weight_transfer=transfer)


def _count_gathers() -> list[int]:
    """Count ``DTensor.full_tensor`` calls (a full gather each) from now on."""
    from torch.distributed.tensor import DTensor

    count, own = [0], DTensor.full_tensor

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return own(self, *args, **kwargs)

    DTensor.full_tensor = counted
    return count


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "reshard.tools.trl_grpo", *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)


def run_job(model: str | Path, server_url: str, trainer: str, out: str | Path, *,
            steps: int = 3, extra: tuple[str, ...] = (), timeout: float = 900,
            start: Callable[[list[str], dict[str, str], Path], Any] = _start
            ) -> dict[str, Any]:
    """This example's two ranks as local processes (what ``torchrun --nproc-per-node 2``
    would start), to the end: rank 0's result, with rank 1's refits (``rank1_refits``).
    Each rank's output goes to ``OUT/rank{r}.log``; a rank that fails raises with both.
    ``start(args, env, log)``: how a rank's process starts (``python -m
    reshard.tools.trl_grpo ARGS``, by default a fresh interpreter): anything with
    ``wait(timeout)`` and ``kill()``."""
    from reshard.comm import free_port

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(start(["--model", str(model), "--server", server_url, "--trainer",
                            trainer, "--steps", str(steps), "--out", str(out), *extra],
                           env, out / f"rank{rank}.log"))
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if codes != [0, 0]:
        logs = [(out / f"rank{r}.log").read_text(errors="replace")[-4000:] for r in range(2)]
        raise RuntimeError(f"the {trainer} job's ranks exited {codes}:\n" + "\n".join(logs))
    result = json.loads((out / "result.json").read_text())
    result["rank1_refits"] = json.loads((out / "refits1.json").read_text())
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the model directory the server serves")
    ap.add_argument("--server", required=True, help="the vLLM server's URL")
    ap.add_argument("--trainer", choices=("grpo", "async"), default="grpo")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-the-world", action="store_true", help="pause around each refit")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from reshard.tools.trl_cpu import on_cpu

    on_cpu()  # what TRL needs on a CPU (not reshard's concern): reshard/tools/trl_cpu.py
    tokenizer = AutoTokenizer.from_pretrained(a.model)
    tokenizer.chat_template, tokenizer.response_template = CHAT_TEMPLATE, RESPONSE_TEMPLATE
    transfer = MeasuredTransfer(a.server, overlap=not a.stop_the_world,
                                token=os.environ.get("RESHARD_TOKEN"))
    trainer = build(a, transfer, tokenizer)
    gathers = _count_gathers()
    t0 = time.perf_counter()
    trainer.train()
    if a.trainer == "grpo":  # GRPOTrainer syncs before it generates: sync the last step too
        trainer.vllm_generation.sync_weights()
    seconds, gathered = time.perf_counter() - t0, gathers[0]
    model = trainer.accelerator.unwrap_model(trainer.model)
    full = hf.full_state_dict(model)  # a collective: every rank
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    out = Path(a.out)
    (out / f"refits{rank}.json").write_text(json.dumps(transfer.refits))
    if rank == 0:
        hf.save_checkpoint(a.model, full, out / "final")
        result = {"trainer": a.trainer, "steps": trainer.state.global_step,
                  "seconds": seconds, "version": transfer.version,
                  "refits": transfer.refits, "gathered": gathered,
                  "log": trainer.state.log_history}
        (out / "result.json").write_text(json.dumps(result, default=str))
        for r in transfer.refits:
            print(f"refit {r['version']}: {r['seconds']:.3f} s, pause (trainer) "
                  f"{r['pause_seconds']:.3f} s, swap (engine) {r['engine_swap_seconds']:.3f} s")
    transfer.destroy()


if __name__ == "__main__":
    main()
