"""Jobs of the elastic-membership test:

    python _elastic_jobs.py trainer PORT DIR --requests 1,2,3,... [--rejoin S] [--sparse on]
    python _elastic_jobs.py replica PORT DIR --id A --tp 2 [--leave-after V] [--last V]
                                             [--bad] [--rank R [--die-at V]] [--deferred]

The trainer job (2 ranks) refits version 1, 2, ... once per entry of ``--requests``;
before each refit its rank 0 waits until that many join/leave requests were posted (so
the membership of each refit is scripted); it survives failed refits and goes on. A
replica (``--tp`` ranks, its own processes) joins, checks every refit bit for bit,
leaves after version ``--leave-after`` and stops after ``--last`` (or once it is out).
``--bad`` gives it a layout of the wrong shape (it must be refused alone). With
``--rank`` one rank runs in this process; ``--die-at V`` makes it SIGKILL itself in the
middle of refit V (from the progress callback); ``--deferred`` takes each version with
``refit(go_live=False)``, checks the live targets still hold the previous one, then
``go_live()``. ``--sparse``: the trainer's ``sparse`` mode (every value changes from one
version to the next, so its sparse refits carry dense regions, through the sparse
transport and its relays). Every rank writes
``DIR/<trainer|id>-<rank>.json`` after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch

import reshard as R
from reshard.refit.elastic import ElasticReceiver, ElasticSender
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches

TRAINER = 2
TIMEOUT = timedelta(seconds=90)
REFIT_TIMEOUT = timedelta(seconds=30)
BUDGET = 4096  # several rounds per refit
REPLICA_BUDGET = 1 << 20  # the replicas ask for more: each epoch's group agrees on 4096


def trainer_layouts() -> dict[str, R.Layout]:
    mesh = R.Mesh([0, 1])
    return {"w1": R.Layout((64, 48), mesh, [R.Shard(0)]),
            "w2": R.Layout((48, 64), mesh, [R.Shard(1)]),
            "b": R.Layout((64,), mesh, [R.Shard(0)])}


def replica_layouts(tp: int, bad: bool = False) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(tp)))
    dtype = "bfloat16" if tp > 1 else "float32"  # replicas may differ in dtype and TP
    return {"w1": R.Layout((64, 48), mesh, [R.Shard(1)], dtype),
            "w2": R.Layout((48, 64 + bad), mesh, [R.Shard(0)], dtype),
            "b": R.Layout((64,), mesh, [R.Replicate()], dtype)}


def _write(path: Path, log: list) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(log))
    os.replace(path.with_suffix(".tmp"), path)


def trainer(rank, _world, port, out, requests, rejoin, sparse="off"):
    layouts = trainer_layouts()
    params = {n: torch.zeros(lay.local_shape(rank)) for n, lay in layouts.items()}
    sender = ElasticSender(params, layouts, host="127.0.0.1", port=port, rank=rank,
                           trainer_size=TRAINER, timeout=TIMEOUT, refit_timeout=REFIT_TIMEOUT,
                           rejoin_timeout=timedelta(seconds=rejoin), budget_bytes=BUDGET,
                           sparse=sparse)
    path = Path(out) / f"trainer-{rank}.json"
    log = []
    for version, expected in enumerate(requests, start=1):
        for n, lay in layouts.items():
            params[n].copy_(fill_local(lay, rank, salt=version))
        if rank == 0:
            sender.wait_for_requests(expected, TIMEOUT)
        t0 = time.perf_counter()
        try:
            stats = sender.refit(version)
        except R.TransferError as e:
            log.append(dict(sender.history[-1], ok=False, seconds=time.perf_counter() - t0,
                            error=str(e)[:300]))
            _write(path, log)
            continue
        entry = dict(sender.history[-1], seconds=time.perf_counter() - t0, ok=True,
                     sent=stats.bytes_sent, sparse=stats.sparse is not None
                     and stats.sparse.used, plans_computed=sender.plans_computed,
                     checksum=sender.side.executors[0].checksum,
                     fanout=sender.side.executors[0].schedule.fanout)
        log.append(entry)
        _write(path, log)
    return log


def replica(rank, tp, port, out, rid, leave_after, bad, last, die_at=-1, deferred=False):
    layouts = replica_layouts(tp, bad)
    targets = {n: torch.zeros(lay.local_shape(rank), dtype=getattr(torch, lay.dtype))
               for n, lay in layouts.items()}
    path = Path(out) / f"{rid}-{rank}.json"
    log: list = []
    receiver = None

    def progress(done, total):
        if receiver is not None and receiver.version == die_at - 1:
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        receiver = ElasticReceiver(targets, layouts, host="127.0.0.1", port=port,
                                   replica_id=rid, rank=rank, tp_size=tp, timeout=TIMEOUT,
                                   refit_timeout=REFIT_TIMEOUT, budget_bytes=REPLICA_BUDGET,
                                   progress=progress if die_at > 0 else False)
    except R.ReshardError as e:
        log.append({"error": type(e).__name__, "message": str(e)[:300]})
        _write(path, log)
        return log
    _write(path, log)
    while receiver.version < last:
        previous = receiver.version
        t0 = time.perf_counter()
        try:
            stats = receiver.refit(wait=TIMEOUT, go_live=not deferred)
        except R.TransferError as e:  # a lost peer: keep serving the previous version
            kept = all(matches(lay, rank, targets[n], salt=previous)
                       for n, lay in layouts.items())
            log.append({"error": "TransferError", "kept_previous": kept,
                        "version": receiver.version, "message": str(e)[:300],
                        "seconds": time.perf_counter() - t0})
            _write(path, log)
            continue
        except R.ReshardError as e:
            log.append({"error": type(e).__name__, "message": str(e)[:300]})
            _write(path, log)
            return log
        if stats is None:
            log.append({"left": True, "version": receiver.version})
            _write(path, log)
            return log
        waited = None
        if deferred:  # received whole, not live: the live targets still hold the previous
            waited = receiver.version == previous and all(
                matches(lay, rank, targets[n], salt=previous) if previous >= 0
                else not targets[n].any() for n, lay in layouts.items())
            receiver.go_live()
        exact = all(matches(lay, rank, targets[n], salt=stats.version)
                    for n, lay in layouts.items())
        log.append({"version": stats.version, "exact": exact, "waited": waited,
                    "epoch": receiver.epoch,
                    "offset": receiver.offsets[rid], "received": stats.bytes_received,
                    "sent": stats.bytes_sent})
        _write(path, log)
        if stats.version == leave_after:
            receiver.leave()
    receiver.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["trainer", "replica"])
    ap.add_argument("port", type=int)
    ap.add_argument("dir")
    ap.add_argument("--requests", default="")
    ap.add_argument("--id", default="A")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--leave-after", type=int, default=-1)
    ap.add_argument("--bad", action="store_true")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--rejoin", type=float, default=30)
    ap.add_argument("--last", type=int, default=1 << 30, help="stop after this version")
    ap.add_argument("--sparse", default="off")
    ap.add_argument("--deferred", action="store_true",
                    help="refit(go_live=False), then go_live()")
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if a.role == "trainer":
        requests = [int(x) for x in a.requests.split(",")]
        run_processes(trainer, TRAINER, a.port, a.dir, requests, a.rejoin, a.sparse, init=False,
                      timeout=300)
    elif a.rank >= 0:
        torch.set_num_threads(1)
        replica(a.rank, a.tp, a.port, a.dir, a.id, a.leave_after, a.bad, a.last, a.die_at)
    else:
        run_processes(replica, a.tp, a.port, a.dir, a.id, a.leave_after, a.bad, a.last,
                      -1, a.deferred, init=False, timeout=300)


if __name__ == "__main__":
    main()
