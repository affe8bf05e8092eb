"""The trainer job of the vLLM refit tests (and a template for a real one)::

    python _vllm_trainer_job.py MODEL_DIR PORT OUT_DIR --shard fsdp|tp --steps N [--fail-at K]
        [--inference-size TP] [--sparse auto|on|off] [--lr LR]

Two gloo ranks load a transformers model (float32 master weights), shard it with FSDP2
or tensor parallelism, and take ``N`` AdamW steps on a fixed token batch. After each
step rank 0 saves the full state dict (``OUT_DIR/step{k}.pt``, HF names) and every rank
refits the vLLM engine with weight version ``k``. With ``--fail-at K`` one parameter
cannot be read midway through refit ``K`` (the pre-send check still reads it), so that
refit fails on both jobs. Prints one JSON line: per rank, per step, the refit result.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

import reshard as R
from reshard.integrations import hf
from reshard.refit import RefitSender
from reshard.refit.sparse import sparse_summary
from reshard.tools.launch import run_processes

FAIL_NAME = "model.layers.1.self_attn.o_proj.weight"


class FailingParams(dict):
    """Parameters whose ``FAIL_NAME`` cannot be read while refit ``fail_at`` sends (the
    first read, by the pre-send check, still works: the failure is midway)."""

    def __init__(self, params, fail_at: int) -> None:
        super().__init__(params)
        self.fail_at, self.step, self.reads = fail_at, 0, 0

    def __getitem__(self, name):
        if name == FAIL_NAME and self.step == self.fail_at:
            self.reads += 1
            if self.reads > 1:
                raise RuntimeError(f"injected failure while reading {name}")
        return super().__getitem__(name)


def batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, vocab, (4, 16), generator=g)


def train_step(model, opt, step: int, rank: int, out_dir: str) -> torch.Tensor:
    """One AdamW step on the step's batch; rank 0 saves the full state dict after it
    (``out_dir/step{step}.pt``, appearing whole). Returns the loss."""
    ids = batch(step, model.config.vocab_size)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    full = hf.full_state_dict(model)
    if rank == 0:
        tmp = Path(out_dir) / f".step{step}.pt"
        torch.save(full, tmp)
        tmp.rename(Path(out_dir) / f"step{step}.pt")
    return loss


def trainer(rank: int, world: int, model_dir: str, port: int, out_dir: str, shard: str,
            steps: int, fail_at: int, lr: float, method: str = "reshard",
            inference_size: int = 2, sparse: str = "off") -> list[dict]:
    torch.manual_seed(0)
    model = hf.load_model(model_dir, torch.float32)
    (hf.shard_fsdp2 if shard == "fsdp" else hf.shard_tp)(model)
    params, layouts = hf.refit_params(model)
    params = FailingParams(params, fail_at)
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                         trainer_size=world, inference_size=inference_size,
                         policy={name: method for name in layouts},
                         timeout=timedelta(seconds=120), sparse=sparse)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
    log = []
    for step in range(1, steps + 1):
        loss = train_step(model, opt, step, rank, out_dir)
        params.step, params.reads = step, 0
        try:
            stats = sender.refit(step)
            log.append({"step": step, "ok": True, "loss": float(loss), "sent": stats.bytes_sent,
                        "seconds": stats.seconds, "sparse": sparse_summary(stats.sparse)})
        except R.TransferError as e:
            log.append({"step": step, "ok": False, "error": str(e)[:300]})
    sender.comm.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("port", type=int)
    ap.add_argument("out_dir")
    ap.add_argument("--shard", choices=("fsdp", "tp"), default="fsdp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fail-at", type=int, default=-1)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--method", default="reshard", help="every tensor's refit method")
    ap.add_argument("--inference-size", type=int, default=2, help="vLLM's TP size")
    ap.add_argument("--sparse", default="off", help="the sender's sparse mode")
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    logs = run_processes(trainer, 2, a.model_dir, a.port, a.out_dir, a.shard, a.steps,
                         a.fail_at, a.lr, a.method, a.inference_size, a.sparse, timeout=300)
    print(json.dumps(logs), flush=True)


if __name__ == "__main__":
    main()
