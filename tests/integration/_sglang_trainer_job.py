"""The trainer job of the SGLang refit tests (and the benchmark's)::

    python _sglang_trainer_job.py MODEL_DIR MEET_PORT OUT --steps N [--inference-size TP]
        [--die-at K] [--lr LR] [--wait-go]

Two gloo ranks (two processes) load a transformers model (float32 master weights), shard
it with FSDP2 and take ``N`` AdamW steps on a fixed token batch. After each step rank 0
saves the full state dict as a Hugging Face checkpoint (``OUT/step{k}``: what a fresh
engine of that step loads) and every rank refits the engine with version ``k`` (the
engine's side: ``SglangRefit``). ``--wait-go``: before each refit the ranks wait for the
file ``OUT/go{k}`` (the test asked its cached prompt first). ``--die-at K``: rank 1
SIGKILLs itself midway through its sends of step K. Each rank writes ``OUT/rank{r}.json``
(per step: the refit's outcome) after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from _vllm_trainer_job import batch  # the same token batches (this folder)

from reshard.errors import TransferError
from reshard.integrations import hf
from reshard.refit import RefitSender

DIE_NAME = "model.layers.1.mlp.down_proj.weight"


class Dying(dict):
    """The trainer's parameters; on the armed step the process SIGKILLs itself at the
    second read of :data:`DIE_NAME` (the first is the pre-send check: midway)."""

    def __init__(self, params: dict, die_at: int) -> None:
        super().__init__(params)
        self.die_at, self.step, self.reads = die_at, 0, 0

    def __getitem__(self, name: str):
        if name == DIE_NAME and self.step == self.die_at:
            self.reads += 1
            if self.reads > 1:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(name)


def rank_main(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.dist_port}",
                           rank=a.rank, world_size=2)
    torch.manual_seed(0)
    model = hf.load_model(a.model_dir, torch.float32)
    hf.shard_fsdp2(model)
    params, layouts = hf.refit_params(model)
    params = Dying(params, a.die_at if a.rank == 1 else -1)
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=a.meet_port,
                         rank=a.rank, trainer_size=2, inference_size=a.inference_size,
                         timeout=timedelta(seconds=120))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=False)
    out, log = Path(a.out), []
    for step in range(1, a.steps + 1):
        ids = batch(step, model.config.vocab_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = hf.full_state_dict(model)
        if a.rank == 0:
            hf.save_checkpoint(a.model_dir, full, out / f".step{step}")
            (out / f".step{step}").rename(out / f"step{step}")  # appears whole
        dist.barrier()
        while a.wait_go and not (out / f"go{step}").exists():
            time.sleep(0.1)
        params.step, params.reads = step, 0
        try:
            stats = sender.refit(step)
            log.append({"step": step, "ok": True, "sent": stats.bytes_sent,
                        "seconds": stats.seconds})
        except TransferError as e:
            log.append({"step": step, "ok": False, "error": str(e)[:300]})
        (out / f"rank{a.rank}.json").write_text(json.dumps(log))
        if not log[-1]["ok"]:
            break  # a lost peer: this job ends (the test starts another to go on)
    sender.comm.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("meet_port", type=int)
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--inference-size", type=int, default=2)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--wait-go", action="store_true")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--dist-port", type=int, default=None)
    a = ap.parse_args()
    if a.rank is not None:
        return rank_main(a)
    from reshard.comm import free_port

    port = free_port()
    ranks = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(r),
                               "--dist-port", str(port)]) for r in range(2)]
    codes = [p.wait() for p in ranks]
    print(json.dumps({"codes": codes}), flush=True)


if __name__ == "__main__":
    main()
