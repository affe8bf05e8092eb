"""reshard's SGLang refit against SGLang's own ``update_weights_from_distributed``, on the
same model, server and host (issue 40), in one run:

  (a) **reshard**: 2 FSDP2 trainer ranks (float32 master weights) -> the SGLang server's
      TP ranks (bf16) through ``reshard.integrations.sglang`` (``SglangRefit``): each
      SGLang rank receives its own shard from both trainer ranks, into a shadow made
      live once every rank has it; the radix cache flushed, the weight version set;
  (b) **SGLang's own**: what RL frameworks do with it (slime, verl's SGLang rollout):
      every trainer rank gathers each parameter whole (``full_tensor()``), rank 0 casts
      it to bf16 and broadcasts it over SGLang's weight-update group (``gloo``, trainer
      rank 0 + every SGLang rank, ``/init_weights_update_group``) while
      ``/update_weights_from_distributed`` receives it on every rank and loads it with
      the model's ``load_weights`` (inside ``/begin_weight_update`` ..
      ``/end_weight_update``), then flushes the cache.

Per refit: the seconds from the trainer's start to the engine's commit answered (the
slowest trainer rank's), and the bytes each SGLang rank receives (reshard: its
``bytes_received``; SGLang: every tensor whole, what the broadcast carries). Both update
the same server, one after the other, ``--reps`` times each; medians. One torch thread a
trainer process; the server's ranks bound one core each (TP2).

    .venv/bin/python benchmarks/sglang_refit.py [--tp 2] [--reps 5] [--layers 4]
        [--hidden 512] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchtools import median, write_json
from reshard.comm import free_port
from reshard.integrations import hf
from reshard.integrations.sglang import SglangRefit
from reshard.tools.launch import run_processes
from reshard.tools.sglang_cpu import SglangServer, use_sglang_here

GROUP = "bench"


def _post(url: str, path: str, body: dict) -> dict:
    import requests

    reply = requests.post(f"{url}/{path}", json=body, timeout=600).json()
    assert reply.get("success"), (path, reply)
    return reply


def _model(model_dir: str) -> torch.nn.Module:
    torch.set_num_threads(1)
    model = hf.load_model(model_dir, torch.float32)
    hf.shard_fsdp2(model)
    return model


def reshard_trainer(rank: int, world: int, model_dir: str, port: int, tp: int,
                    reps: int) -> list[float]:
    """(a), one trainer rank: ``sender.refit(step)`` for each rep; its seconds."""
    from reshard.refit import RefitSender

    params, layouts = hf.refit_params(_model(model_dir))
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=rank,
                         trainer_size=world, inference_size=tp,
                         timeout=timedelta(seconds=300), sparse="off")  # dense refits
    seconds = []
    for step in range(1, reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        sender.refit(step)
        seconds.append(time.perf_counter() - t0)
    sender.comm.close()
    return seconds


def run_reshard(url: str, model_dir: Path, tp: int, reps: int) -> dict:
    refit, port = SglangRefit(url), free_port()
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("s", run_processes(
        reshard_trainer, 2, str(model_dir), port, tp, reps, timeout=1800)))
    job.start()
    infos = refit.init("127.0.0.1", port, 2)
    engine = []
    for step in range(1, reps + 1):
        t0 = time.perf_counter()
        outcomes = refit.refit(step)
        engine.append({"seconds": time.perf_counter() - t0,
                       "bytes": [o["bytes_received"] for o in outcomes]})
    job.join()
    refit.close()
    trainer = [max(per_rank[i] for per_rank in box["s"]) for i in range(reps)]
    return {"seconds": trainer, "engine_seconds": [e["seconds"] for e in engine],
            "bytes_per_rank": engine[-1]["bytes"],
            "expected_bytes": [i["expected_bytes"] for i in infos]}


def sglang_trainer(rank: int, world: int, model_dir: str, url: str, port: int, tp: int,
                   reps: int) -> list[float]:
    """(b), one trainer rank: gather every parameter; rank 0 broadcasts it over SGLang's
    update group while the server receives it; the seconds to the server's answer."""
    model = _model(model_dir)
    names = list(hf.refit_params(model)[0])
    group = None
    if rank == 0:  # trainer rank 0 is the group's rank 0, the SGLang ranks 1..tp
        use_sglang_here()
        from sglang.srt.utils.common import init_custom_process_group

        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": tp + 1, "group_name": GROUP, "backend": "gloo"}
        joining = threading.Thread(target=_post, args=(url, "init_weights_update_group", body))
        joining.start()
        group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}",
                                          world_size=tp + 1, rank=0, group_name=GROUP)
        joining.join()
    seconds = []
    for step in range(1, reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        full = {n: t.full_tensor().to(torch.bfloat16) for n, t in
                hf.refit_params(model)[0].items()}
        if rank == 0:
            _broadcast(url, group, names, full, step)
        seconds.append(time.perf_counter() - t0)
        dist.barrier()
    return seconds


def _broadcast(url: str, group, names: list[str], full: dict, step: int) -> None:
    _post(url, "begin_weight_update", {})
    body = {"names": names, "dtypes": ["bfloat16"] * len(names),
            "shapes": [list(full[n].shape) for n in names], "group_name": GROUP,
            "flush_cache": True, "weight_version": f"sglang-{step}"}
    receiving = threading.Thread(target=_post, args=(url, "update_weights_from_distributed",
                                                     body))
    receiving.start()
    for n in names:
        dist.broadcast(full[n], src=0, group=group)
    receiving.join()
    _post(url, "end_weight_update", {})


def run_sglang(url: str, model_dir: Path, tp: int, reps: int) -> dict:
    port = free_port()
    per_rank = run_processes(sglang_trainer, 2, str(model_dir), url, port, tp, reps,
                             timeout=1800)
    shapes = hf.param_shapes(hf.load_model(model_dir, torch.float32))
    whole = sum(torch.Size(s).numel() * 2 for s in shapes.values())  # bf16, each whole
    return {"seconds": [max(r[i] for r in per_rank) for i in range(reps)],
            "bytes_per_rank": [whole] * tp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="sglang_refit_"))
    out.mkdir(parents=True, exist_ok=True)
    model = hf.build_tiny_model(out / "model", "llama", hidden_size=a.hidden,
                                num_hidden_layers=a.layers, num_attention_heads=a.hidden // 32,
                                num_key_value_heads=a.hidden // 64,
                                intermediate_size=4 * a.hidden, vocab_size=8192)
    with SglangServer(model, port=free_port(), log=out / "server.log", tp=a.tp) as server:
        results = {"reshard": run_reshard(server.url, model, a.tp, a.reps),
                   "sglang": run_sglang(server.url, model, a.tp, a.reps)}
    results["args"] = vars(a) | {"out": str(out)}
    write_json(out / "sglang_refit.json", results)
    print(f"model: Llama, {a.layers} layers, hidden {a.hidden}, vocab 8192; SGLang TP{a.tp}, "
          f"bf16; 2 FSDP2 trainer ranks; {a.reps} refits each")
    print(f"{'path':<38} {'refit s (median)':>16} {'bytes per SGLang rank':>24}")
    for key, label in (("reshard", "reshard (SglangRefit)"),
                       ("sglang", "SGLang update_weights_from_distributed")):
        r = results[key]
        print(f"{label:<38} {median(r['seconds']):>16.3f} "
              f"{' / '.join(str(b) for b in r['bytes_per_rank']):>24}")
    print(json.dumps({k: results[k]["seconds"] for k in ("reshard", "sglang")}))


if __name__ == "__main__":
    main()
