"""One side of the two-job rendezvous test: ``python _two_jobs.py SIDE PORT [--bad-rank N]
[--sizes T,I]`` (``--sizes``: the trainer and inference sizes this job claims).

Starts its own job of local processes (no shared default group), meets the other job at
a TCP store, refits, and prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import json

import torch

import reshard as R
from reshard.executor import Executor
from reshard.refit.rendezvous import meet
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches

TRAINER, INFERENCE = 4, 2


def trainer_layouts(bad: bool) -> dict[str, R.Layout]:
    mesh = R.Mesh([[0, 1], [2, 3]])  # fsdp2 x tp2, FSDP2 on top of TP
    return {"w1": R.Layout((64, 24), mesh, [R.StridedShard(0, 2), R.Shard(0)]),
            "w2": R.Layout((24, 64), mesh, [R.Shard(0), R.Shard(1 if not bad else 0)]),
            "norm": R.Layout((24,), mesh, [R.Replicate(), R.Replicate()])}


def inference_layouts() -> dict[str, R.Layout]:
    mesh = R.Mesh([0, 1])  # tp2, bf16
    return {"w1": R.Layout((64, 24), mesh, [R.Shard(0)], "bfloat16"),
            "w2": R.Layout((24, 64), mesh, [R.Shard(1)], "bfloat16"),
            "norm": R.Layout((24,), mesh, [R.Replicate()], "bfloat16")}


def _rank(side_rank, _size, side, port, bad_rank, sizes=(TRAINER, INFERENCE)):
    layouts = (trainer_layouts(side_rank == bad_rank) if side == "trainer"
               else inference_layouts())
    try:
        m = meet("127.0.0.1", port, side=side, side_rank=side_rank, trainer_size=sizes[0],
                 inference_size=sizes[1], layouts=layouts)
    except R.ReshardError as e:
        return {"side": side, "rank": side_rank, "error": type(e).__name__, "message": str(e)}
    src, dst = {}, {}
    for t in m.plan.tensors:
        if m.rank in t.src.rank_set:
            src[t.name] = fill_local(t.src, m.rank)
        if m.rank in t.dst.rank_set:
            dst[t.name] = torch.zeros(t.dst.local_shape(m.rank), dtype=torch.bfloat16)
    stats = Executor(m.plan, m.comm).run(src, dst)
    ok = all(matches(t.dst, m.rank, dst[t.name]) for t in m.plan.tensors if t.name in dst)
    m.comm.close()
    return {"side": side, "rank": side_rank, "ok": ok, "received": stats.bytes_received}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("side")
    ap.add_argument("port", type=int)
    ap.add_argument("--bad-rank", type=int, default=-1)
    ap.add_argument("--sizes", default=f"{TRAINER},{INFERENCE}")
    a = ap.parse_args()
    size = TRAINER if a.side == "trainer" else INFERENCE
    sizes = tuple(int(x) for x in a.sizes.split(","))
    for r in run_processes(_rank, size, a.side, a.port, a.bad_rank, sizes, init=False,
                           timeout=120):
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
