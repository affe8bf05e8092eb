"""The trainer job of the vLLM peer-bootstrap test::

    python _fleet_trainer_job.py MODEL_DIR OUT_DIR --fleet PORT:N:M --join PORT:TP

Two gloo ranks (FSDP2, float32 master weights, AdamW, the batches of
``_vllm_trainer_job``) host a fleet at ``PORT`` (an ``ElasticSender`` each, relayed
fan-out, ``sparse="on"``) and wait for its ``N`` engines to ask to join; take step 1
and refit the fleet (every engine at once, fed through each other; dense: no base yet);
then meet the engine of ``--join`` (a new one, filled from its peers in the meantime,
without this job; one ``RefitSender``), wait for ``M`` requests to join in all (engines
filled from their peers that join the fleet), take step 2 and refit the fleet (sparse,
its chain through the engines), then that engine. Rank 0 saves the full state dict of
each step (``OUT_DIR/step{k}.pt``) before its refits. Prints one JSON line: per rank,
per step and refit, the outcome (``engine`` 0: the fleet, 1: the joined engine).
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
from _vllm_trainer_job import train_step

from reshard.integrations import hf
from reshard.refit import ElasticSender, RefitSender
from reshard.tools.launch import run_processes

TIMEOUT = timedelta(seconds=300)  # the new engine comes after a fresh engine's run


def trainer(rank: int, world: int, model_dir: str, out_dir: str,
            fleet: tuple[int, int, int], join: tuple[int, int]) -> list[dict]:
    torch.manual_seed(0)
    model = hf.load_model(model_dir, torch.float32)
    hf.shard_fsdp2(model)
    params, layouts = hf.refit_params(model)
    port, engines, grown = fleet
    elastic = ElasticSender(params, layouts, host="127.0.0.1", port=port, rank=rank,
                            trainer_size=world, timeout=TIMEOUT, fanout="relay",
                            sparse="on")
    if rank == 0:
        elastic.wait_for_requests(engines)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=False)
    log, joined = [], None
    for step in (1, 2):
        if step == 2:
            joined = RefitSender(params, layouts=layouts, host="127.0.0.1", port=join[0],
                                 rank=rank, trainer_size=world, inference_size=join[1],
                                 timeout=TIMEOUT)
            if rank == 0:
                elastic.wait_for_requests(grown)
        train_step(model, opt, step, rank, out_dir)
        stats = elastic.refit(step)
        log.append({"step": step, "engine": 0, "sent": stats.bytes_sent,
                    "members": elastic.history[-1]["members"],
                    "fanout": elastic.side.executors[0].schedule.fanout,
                    "sparse": stats.sparse is not None and stats.sparse.used})
        if joined is not None:
            log.append({"step": step, "engine": 1, "sent": joined.refit(step).bytes_sent})
    elastic.close()
    joined.comm.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--fleet", required=True)
    ap.add_argument("--join", required=True)
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    fleet = tuple(int(x) for x in a.fleet.split(":"))
    join = tuple(int(x) for x in a.join.split(":"))
    logs = run_processes(trainer, 2, a.model_dir, a.out_dir, fleet, join, timeout=600)
    print(json.dumps(logs), flush=True)


if __name__ == "__main__":
    main()
