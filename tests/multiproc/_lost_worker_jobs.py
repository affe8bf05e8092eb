"""One rank of the lost-worker test, as its own process (so it can be SIGKILLed alone):

    python _lost_worker_jobs.py trainer|inference RANK DIR --ports P1,P2 --world-port W
        [--port-index I] [--first-step S] [--last-step N] [--victim ROLE:RANK:STEP]

Trainer ranks form their own gloo world (their "training": each step rewrites the
parameters to the synthetic values of that step and all-reduces a gradient stand-in)
and refit the inference ranks through :class:`reshard.refit.RefitSender`, one version
per step. Inference ranks check every refit bit for bit (``reshard.tools.synthetic``). The
victim, on the refit of step ``STEP``, writes ``DIR/victim.json`` (its pid) from inside
the progress callback after the first round and then sleeps: the test SIGKILLs it there,
mid-refit. Whoever sees a ``TransferError`` records when, checks that its live weights
are still the previous version, and (trainer and inference alike) reconnects at the
next port. Every process writes ``DIR/<role><rank>-<pid>.json`` when it ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

import reshard as R
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.synthetic import fill_local, matches

TRAINER, INFERENCE = 2, 2
REFIT_TIMEOUT = timedelta(seconds=10)
CONNECT_TIMEOUT = timedelta(seconds=90)
BUDGET = 16 << 10  # small rounds: many progress callbacks per refit
LIFETIME_S = 200  # no process outlives this, whatever happens


def trainer_layouts() -> dict[str, R.Layout]:
    mesh = R.Mesh([0, 1])
    return {"w1": R.Layout((256, 96), mesh, [R.Shard(0)]),
            "w2": R.Layout((96, 256), mesh, [R.Shard(1)]),
            "b": R.Layout((256,), mesh, [R.Replicate()])}


def inference_layouts() -> dict[str, R.Layout]:
    mesh = R.Mesh([0, 1])
    return {"w1": R.Layout((256, 96), mesh, [R.Shard(1)]),
            "w2": R.Layout((96, 256), mesh, [R.Shard(0)]),
            "b": R.Layout((256,), mesh, [R.Replicate()])}


class Victim:
    """The progress callback: on the chosen refit, announce the pid and wait to be
    killed (after the first round, so the refit is well under way)."""

    def __init__(self, out: Path, armed: bool) -> None:
        self.out, self.armed, self.active = out, armed, False

    def __call__(self, done: int, total: int) -> None:
        if self.armed and self.active:
            self.armed = False
            (self.out / "victim.json.tmp").write_text(json.dumps(
                {"pid": os.getpid(), "time": time.time()}))
            os.replace(self.out / "victim.json.tmp", self.out / "victim.json")
            time.sleep(60)  # SIGKILLed here
            raise SystemExit("victim was not killed")


def _log(log: list, path: Path, **entry) -> None:
    entry["time"] = time.time()
    log.append(entry)
    path.write_text(json.dumps(log))


def trainer(rank: int, a) -> None:
    import torch.distributed as dist

    out = Path(a.dir)
    path = out / f"trainer{rank}-{os.getpid()}.json"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.world_port}", rank=rank,
                            world_size=TRAINER, timeout=timedelta(seconds=60))
    layouts = trainer_layouts()
    params = {n: torch.zeros(lay.local_shape(rank)) for n, lay in layouts.items()}
    role, vrank, vstep = a.victim
    victim = Victim(out, role == "trainer" and vrank == rank)
    port_index = a.port_index
    log: list = []
    sender = RefitSender(params, layouts=layouts, host="127.0.0.1",
                         port=a.ports[port_index], rank=rank, trainer_size=TRAINER,
                         inference_size=INFERENCE, budget_bytes=BUDGET,
                         refit_timeout=REFIT_TIMEOUT, connect_timeout=CONNECT_TIMEOUT,
                         progress=victim)
    for step in range(a.first_step, a.last_step + 1):
        for n, lay in layouts.items():  # the "optimizer step"
            params[n].copy_(fill_local(lay, rank, salt=step))
        grad = torch.ones(4)
        dist.all_reduce(grad)  # the trainer's own group keeps working
        _log(log, path, kind="train", step=step, allreduce_ok=bool((grad == TRAINER).all()))
        if sender.broken:
            port_index += 1
            t0 = time.time()
            sender.reconnect("127.0.0.1", a.ports[port_index], timeout=CONNECT_TIMEOUT)
            _log(log, path, kind="reconnect", port_index=port_index, seconds=time.time() - t0)
        victim.active = step == vstep
        t0 = time.time()
        try:
            stats = sender.refit(step)
            _log(log, path, kind="refit", step=step, ok=True, version=stats.version,
                 gc=gc.isenabled())
        except R.TransferError as e:
            _log(log, path, kind="refit", step=step, ok=False, started=t0,
                 error=str(e)[:300], broken=sender.broken, gc=gc.isenabled())
            if role == "trainer":  # a trainer rank died: this trainer job is torn down
                break


def inference(rank: int, a) -> None:
    out = Path(a.dir)
    path = out / f"inference{rank}-{os.getpid()}.json"
    layouts = inference_layouts()
    targets = {n: torch.zeros(lay.local_shape(rank)) for n, lay in layouts.items()}
    role, vrank, vstep = a.victim
    victim = Victim(out, role == "inference" and vrank == rank)
    port_index = a.port_index
    log: list = []
    receiver = RefitReceiver(targets, layouts, host="127.0.0.1", port=a.ports[port_index],
                             rank=rank, trainer_size=TRAINER, inference_size=INFERENCE,
                             budget_bytes=BUDGET, refit_timeout=REFIT_TIMEOUT,
                             connect_timeout=CONNECT_TIMEOUT, progress=victim)
    _log(log, path, kind="joined", port_index=port_index, version=receiver.version)
    while receiver.version < a.last_step:
        if receiver.broken:
            port_index += 1
            t0 = time.time()
            receiver.reconnect("127.0.0.1", a.ports[port_index], timeout=CONNECT_TIMEOUT)
            _log(log, path, kind="reconnect", port_index=port_index, seconds=time.time() - t0,
                 version=receiver.version)
        previous = receiver.version
        victim.active = previous == vstep - 1
        t0 = time.time()
        try:
            stats = receiver.refit()
        except R.TransferError as e:
            kept = receiver.version == previous and all(
                matches(layouts[n], rank, t, salt=previous) for n, t in targets.items())
            _log(log, path, kind="refit", ok=False, started=t0, version=receiver.version,
                 kept_previous=kept, error=str(e)[:300], broken=receiver.broken,
                 gc=gc.isenabled())
            continue
        exact = all(matches(layouts[n], rank, t, salt=stats.version) for n, t in targets.items())
        _log(log, path, kind="refit", ok=True, version=stats.version, exact=exact,
             gc=gc.isenabled())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["trainer", "inference"])
    ap.add_argument("rank", type=int)
    ap.add_argument("dir")
    ap.add_argument("--ports", type=lambda s: [int(p) for p in s.split(",")], required=True)
    ap.add_argument("--world-port", type=int, default=0)
    ap.add_argument("--port-index", type=int, default=0)
    ap.add_argument("--first-step", type=int, default=1)
    ap.add_argument("--last-step", type=int, default=5)
    ap.add_argument("--victim", default="none:-1:-1",
                    type=lambda s: (s.split(":")[0], int(s.split(":")[1]), int(s.split(":")[2])))
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    torch.set_num_threads(1)
    import signal

    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))  # never outlive the test
    signal.alarm(LIFETIME_S)
    (trainer if a.role == "trainer" else inference)(a.rank, a)
    sys.stdout.flush()
    os._exit(0)  # do not wait on any group teardown


if __name__ == "__main__":
    main()
