"""The trainer job of the vLLM peer-bootstrap test::

    python _fleet_trainer_job.py MODEL_DIR OUT_DIR --engines PORT:TP,... --join PORT:TP

Two gloo ranks (FSDP2, float32 master weights, AdamW, the batches of
``_vllm_trainer_job``) meet each engine of ``--engines`` in turn (one ``RefitSender``
each), take step 1 and refit them (in that order); then meet the engine of ``--join``
(a new one, filled from its peers in the meantime, without this job), take step 2 and
refit all of them. Rank 0 saves the full state dict of each step (``OUT_DIR/step{k}.pt``)
before its refits. Prints one JSON line: per rank, per step and engine, the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
from _vllm_trainer_job import train_step

from reshard.integrations import hf
from reshard.refit import RefitSender
from reshard.tools.launch import run_processes

TIMEOUT = timedelta(seconds=300)  # the new engine comes after a fresh engine's run


def trainer(rank: int, world: int, model_dir: str, out_dir: str, engines: list,
            join: tuple[int, int]) -> list[dict]:
    torch.manual_seed(0)
    model = hf.load_model(model_dir, torch.float32)
    hf.shard_fsdp2(model)
    params, layouts = hf.refit_params(model)

    def meet(port: int, tp: int) -> RefitSender:
        return RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                           trainer_size=world, inference_size=tp, timeout=TIMEOUT)

    senders = [meet(port, tp) for port, tp in engines]
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=False)
    log = []
    for step in (1, 2):
        if step == 2:
            senders.append(meet(*join))
        train_step(model, opt, step, rank, out_dir)
        for i, sender in enumerate(senders):
            stats = sender.refit(step)
            log.append({"step": step, "engine": i, "sent": stats.bytes_sent})
    for sender in senders:
        sender.comm.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--engines", required=True)
    ap.add_argument("--join", required=True)
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    engines = [tuple(int(x) for x in e.split(":")) for e in a.engines.split(",")]
    join = tuple(int(x) for x in a.join.split(":"))
    logs = run_processes(trainer, 2, a.model_dir, a.out_dir, engines, join, timeout=600)
    print(json.dumps(logs), flush=True)


if __name__ == "__main__":
    main()
