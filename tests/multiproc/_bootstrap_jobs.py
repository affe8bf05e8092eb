"""Ranks of the peer-bootstrap test, one process each:

    python _bootstrap_jobs.py peer PORTS DIR --peer I --tp N --rank R --versions 2,3 [--die]
    python _bootstrap_jobs.py new PORTS DIR --peers 2 --tp N --rank R

Two live replicas lend: peer 0 (TP2, rows split) and peer 1 (TP1, whole tensors), their
committed tensors the synthetic ones of their version. The new replica (TP2, columns
split and a replicated bias) meets them once per port of ``PORTS``; each peer lends the
version of ``--versions`` at the same position. ``--die``: this peer rank SIGKILLs itself
after its first round. Every rank writes ``DIR/<peer|new>-<I>-<R>.json``: per meeting,
its outcome (error class, message, seconds) or its bytes, and on the new replica whether
its live tensors are exactly the version (or still zero).
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
from reshard.refit.bootstrap import BootstrapReceiver, BootstrapSender
from reshard.tools.synthetic import fill_local, matches

TIMEOUT = timedelta(seconds=60)
REFIT_TIMEOUT = timedelta(seconds=30)
BUDGET = 4096  # several rounds


def peer_layouts(tp: int) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(tp)))
    return {"w1": R.Layout((64, 48), mesh, [R.Shard(0)], "bfloat16"),
            "w2": R.Layout((48, 64), mesh, [R.Shard(0)], "bfloat16"),
            "b": R.Layout((64,), mesh, [R.Replicate()], "bfloat16")}


def new_layouts(tp: int) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(tp)))
    return {"w1": R.Layout((64, 48), mesh, [R.Shard(1)], "bfloat16"),
            "w2": R.Layout((48, 64), mesh, [R.Shard(1)], "bfloat16"),
            "b": R.Layout((64,), mesh, [R.Replicate()], "bfloat16")}


def peer(a, port: int, version: int) -> dict:
    layouts = peer_layouts(a.tp)
    targets = {n: fill_local(lay, a.rank, salt=version) for n, lay in layouts.items()}

    def progress(done: int, total: int) -> None:
        if a.die and done > 0:
            os.kill(os.getpid(), signal.SIGKILL)

    sender = BootstrapSender(targets, layouts, host="127.0.0.1", port=port, peer=a.peer,
                             rank=a.rank, tp_size=a.tp, version=version, timeout=TIMEOUT,
                             refit_timeout=REFIT_TIMEOUT, budget_bytes=BUDGET,
                             progress=progress if a.die else False)
    stats = sender.send()
    unchanged = all(matches(lay, a.rank, targets[n], salt=version)
                    for n, lay in layouts.items())
    return {"sent": stats.bytes_sent, "version": stats.version, "unchanged": unchanged}


def new(a, port: int) -> dict:
    layouts = new_layouts(a.tp)
    targets = {n: torch.zeros(lay.local_shape(a.rank), dtype=torch.bfloat16)
               for n, lay in layouts.items()}
    rec = {}
    try:
        receiver = BootstrapReceiver(targets, layouts, host="127.0.0.1", port=port,
                                     rank=a.rank, tp_size=a.tp, num_peers=a.peers,
                                     timeout=TIMEOUT, refit_timeout=REFIT_TIMEOUT,
                                     budget_bytes=BUDGET)
        stats = receiver.refit()
        rec = {"received": stats.bytes_received, "version": stats.version,
               "receiver_version": receiver.version}
    finally:
        rec["zero"] = all(not t.any() for t in targets.values())
        rec["exact"] = all(matches(lay, a.rank, targets[n], salt=rec.get("version", -1))
                           for n, lay in layouts.items())
        a.outcome.update(rec)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["peer", "new"])
    ap.add_argument("ports")
    ap.add_argument("dir")
    ap.add_argument("--peer", type=int, default=0)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--versions", default="1")
    ap.add_argument("--die", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ports = [int(p) for p in a.ports.split(",")]
    versions = [int(v) for v in a.versions.split(",")]
    path = Path(a.dir) / f"{a.role}-{a.peer if a.role == 'peer' else 'x'}-{a.rank}.json"
    log = []
    for i, port in enumerate(ports):
        a.outcome = {}
        t0 = time.perf_counter()
        try:
            entry = peer(a, port, versions[i]) if a.role == "peer" else new(a, port)
        except R.ReshardError as e:
            entry = {**a.outcome, "error": type(e).__name__, "message": str(e)[:400]}
        entry["seconds"] = time.perf_counter() - t0
        log.append(entry)
        path.write_text(json.dumps(log))


if __name__ == "__main__":
    main()
