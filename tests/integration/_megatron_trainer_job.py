"""The trainer job of the Megatron refit tests (and a template for a real one)::

    python _megatron_trainer_job.py OUT_DIR --kind qwen3 --tp 2 --pp 1 --ep 1 --steps N
                                    [--port PORT --inference-size 2]

``tp * pp * dp`` gloo ranks (``--world``, default ``tp * pp * ep``) build a tiny
Megatron-Core ``GPTModel`` (local layer spec, float32; see ``reshard.tools.megatron_cpu``
for the CPU patches) and take ``N`` AdamW steps through Megatron's forward-backward
schedule.
Before the first step each rank saves its Megatron parameters as they are
(``OUT_DIR/step0.rank{r}.pt``: stage-local names, the global layer number of each local
layer, its TP / PP / EP / DP coordinates); after each step too (``step{k}.rank{r}.pt``),
then, given ``--port``, every rank refits the vLLM engine with weight version ``k`` from
:func:`reshard.integrations.megatron.refit_params`. Rank 0 saves the layouts
(``layouts.pt``). Prints one JSON line: per rank, per step, the refit result, and what
shows the sender reads Megatron's own memory.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

from reshard.refit import RefitSender
from reshard.refit.side import local_tensors
from reshard.tools import megatron_cpu as M
from reshard.tools.launch import run_processes


def save_local(model, rank: int, out: Path, step: int, params: dict) -> None:
    """This rank's Megatron parameters and coordinates, and which Megatron parameter each
    HF tensor given to the sender is (by identity)."""
    which = {id(p): n for n, p in model.named_parameters()}
    M.save_rank_record(model, rank, out, step,
                       sent_from={hf: which.get(id(p)) for hf, p in params.items()})


def same_memory(params: dict, model) -> dict:
    """What the sender will read, per HF name, against Megatron's parameters: the same
    storage (a view, never a copy), and the local sizes it spans."""
    storages = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
    src = local_tensors(params)
    views = sum(1 for n in params if src[n].untyped_storage().data_ptr() in storages)
    return {"names": len(params), "views_of_megatron_params": views,
            "local_param_bytes": sum(p.numel() * p.element_size()
                                     for p in model.parameters())}


def trainer(rank: int, world: int, a: argparse.Namespace) -> dict:
    from reshard.integrations import megatron

    M.init_parallel(rank, world, 0, tp=a.tp, pp=a.pp, ep=a.ep)
    model = M.build_gpt(a.kind, a.layers, tp=a.tp, pp=a.pp, ep=a.ep)
    out = Path(a.out_dir)
    params, layouts = megatron.refit_params(model, family=a.kind, vocab_size=M.TINY["vocab"])
    if rank == 0:
        torch.save(layouts, out / "layouts.pt")
    save_local(model, rank, out, 0, params)
    log = {"memory": same_memory(params, model), "steps": []}
    sender = None
    if a.port:
        sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=a.port, rank=rank,
                             trainer_size=world, inference_size=a.inference_size,
                             timeout=timedelta(seconds=180), sparse=a.sparse)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=False)
    for step in range(1, a.steps + 1):
        loss = M.train_step(model, opt, step)
        save_local(model, rank, out, step, params)  # appears whole
        entry = {"step": step, "loss": loss}
        if sender is not None:
            stats = sender.refit(step)
            sparse = stats.sparse is not None and stats.sparse.used
            entry.update(sent=stats.bytes_sent, received=stats.bytes_received,
                         staging=stats.peak_staging_bytes, seconds=stats.seconds,
                         sparse=sparse, dense=stats.sparse.dense_bytes if sparse
                         else stats.bytes_sent)
        log["steps"].append(entry)
    if sender is not None:
        sender.comm.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--kind", default="qwen3")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--world", type=int, default=0, help="default tp * pp * ep")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--port", type=int, default=0, help="the refit meeting; 0: no refit")
    ap.add_argument("--sparse", default="off", help="the sender's sparse mode")
    ap.add_argument("--inference-size", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=M.TINY["vocab"],
                    help="the real vocabulary (Megatron pads it to a multiple of 128)")
    a = ap.parse_args()
    M.TINY.update(vocab=a.vocab, padded_vocab=-(-a.vocab // 128) * 128)  # before the fork
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    world = a.world or a.tp * a.pp * a.ep
    logs = run_processes(trainer, world, a, timeout=400)
    print(json.dumps(logs), flush=True)


if __name__ == "__main__":
    main()
