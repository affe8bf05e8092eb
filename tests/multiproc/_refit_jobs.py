"""Jobs of the refit test: ``python _refit_jobs.py trainer|inference PORT DIR [--fail-at N]
[--mixed]``.

The trainer job is a real FSDP2 model (``fully_shard``) on its own gloo world taking SGD
steps; after each step it refits the inference job (a TP2 layout with a fused qkv
parameter, a fused gate_up parameter and a padded vocabulary) and saves the full state
dict it sent. The inference job checks every refit bit for bit against that file.
``--mixed``: the trainer alone gives a per-parameter policy (two tensors on
gather_broadcast) and a staging budget smaller than one tensor; the inference side
gives neither, so the two sides must agree on both before anything moves.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import reshard as R
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.launch import free_port, run_processes  # noqa: F401 - free_port for callers

VOCAB, PADDED, H, Q, KV, INTER, TP = 50, 64, 16, 16, 8, 24, 2
STEPS = 3


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.q_proj, self.k_proj = nn.Linear(H, Q, bias=False), nn.Linear(H, KV, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, KV, bias=False), nn.Linear(Q, H, bias=False)
        self.gate_proj = nn.Linear(H, INTER, bias=False)
        self.up_proj = nn.Linear(H, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, H, bias=False)
        self.norm = nn.Parameter(torch.ones(H))

    def forward(self, ids):
        x = self.embed(ids) * self.norm
        x = x + self.o_proj(self.q_proj(x) * torch.cat([self.k_proj(x), self.v_proj(x)], -1))
        return x + self.down_proj(self.gate_proj(x) * self.up_proj(x))


class FailingParams(dict):
    """Source parameters whose ``down_proj`` cannot be read while refit ``fail_at`` sends
    (the first read, by the pre-send check, still works: the failure is midway)."""

    def __init__(self, params, fail_at):
        super().__init__(params)
        self.fail_at, self.reads = fail_at, 0
        self._refit = 0

    @property
    def refit(self):
        return self._refit

    @refit.setter
    def refit(self, value):
        self._refit, self.reads = value, 0

    def __getitem__(self, name):
        if name == "down_proj.weight" and self._refit == self.fail_at:
            self.reads += 1
            if self.reads > 1:
                raise RuntimeError("injected failure while reading down_proj")
        return super().__getitem__(name)


MIXED_POLICY = {"embed.weight": "gather_broadcast", "down_proj.weight": "gather_broadcast"}


def trainer(rank, world, port, out_dir, fail_at, mixed=False, sparse="auto"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = FailingParams(dict(model.named_parameters()), fail_at)
    extra = dict(policy=MIXED_POLICY, budget_bytes=1024) if mixed else {}
    sender = RefitSender(params, host="127.0.0.1", port=port, rank=rank, trainer_size=world,
                         inference_size=TP, timeout=__import__("datetime").timedelta(seconds=60),
                         sparse=sparse, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = []
    for step in range(1, STEPS + 1):
        loss = model(torch.arange(12).view(3, 4) + step).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, Path(out_dir) / f"step{step}.pt")
        params.refit = step
        try:
            stats = sender.refit(step)
            log.append({"step": step, "ok": True, "sent": stats.bytes_sent})
        except R.TransferError as e:
            log.append({"step": step, "ok": False, "error": str(e)})
    return log


def inference_layouts(rank: int):
    """Targets are views into two fused parameters and a padded embedding."""
    qkv = torch.zeros(Q // TP + 2 * (KV // TP), H)
    gate_up = torch.zeros(2 * INTER // TP, H)
    embed = torch.full((PADDED // TP, H), -5.0)  # padding rows must stay untouched
    down = torch.zeros(H, INTER // TP)
    qs, ks, i = Q // TP, KV // TP, INTER // TP
    mesh = R.Mesh([0, 1])
    targets = {"q_proj.weight": qkv[:qs], "k_proj.weight": qkv[qs:qs + ks],
               "v_proj.weight": qkv[qs + ks:], "gate_proj.weight": gate_up[:i],
               "up_proj.weight": gate_up[i:], "down_proj.weight": down,
               "embed.weight": embed, "o_proj.weight": torch.zeros(H, Q // TP),
               "norm": torch.zeros(H)}
    per = PADDED // TP
    vocab_views = {r: ((per, H), [((r * per, 0), (min(per, VOCAB - r * per), H), (0, 0))])
                   for r in range(TP)}
    layouts = {
        "q_proj.weight": R.Layout((Q, H), mesh, [R.Shard(0)]),
        "k_proj.weight": R.Layout((KV, H), mesh, [R.Shard(0)]),
        "v_proj.weight": R.Layout((KV, H), mesh, [R.Shard(0)]),
        "gate_proj.weight": R.Layout((INTER, H), mesh, [R.Shard(0)]),
        "up_proj.weight": R.Layout((INTER, H), mesh, [R.Shard(0)]),
        "down_proj.weight": R.Layout((H, INTER), mesh, [R.Shard(1)]),
        "o_proj.weight": R.Layout((H, Q), mesh, [R.Shard(1)]),
        "embed.weight": R.Layout.explicit((VOCAB, H), vocab_views),
        "norm": R.Layout((H,), mesh, [R.Replicate()]),
    }
    return targets, layouts, (qkv, gate_up, embed)


def inference(rank, world, port, out_dir, fail_at, mixed=False, sparse=None):
    targets, layouts, fused = inference_layouts(rank)
    receiver = RefitReceiver(targets, layouts, host="127.0.0.1", port=port, rank=rank,
                             trainer_size=2, inference_size=TP,
                             timeout=__import__("datetime").timedelta(seconds=60))
    log = []
    for step in range(1, STEPS + 1):
        before = {n: t.clone() for n, t in targets.items()}
        try:
            stats = receiver.refit()
        except R.TransferError as e:
            kept = all(torch.equal(before[n], t) for n, t in targets.items())
            log.append({"step": step, "ok": False, "kept_previous": kept,
                        "version": receiver.version, "error": str(e)[:200]})
            continue
        path = Path(out_dir) / f"step{step}.pt"
        while not path.exists():
            time.sleep(0.05)
        time.sleep(0.2)
        full = torch.load(path)
        bad = [n for n, t in targets.items() if n != "embed.weight"
               and not torch.equal(t, layouts[n].shard(full[n], rank))]
        exact = not bad
        emb = targets["embed.weight"]
        lo = rank * (PADDED // TP)
        real = min(PADDED // TP, VOCAB - lo)
        exact = exact and torch.equal(emb[:real], full["embed.weight"][lo:lo + real])
        exact = exact and bool((emb[real:] == -5.0).all())
        log.append({"step": step, "ok": True, "exact": exact, "bad": bad,
                    "version": receiver.version,
                    "received": stats.bytes_received, "rounds": stats.rounds,
                    "fused_ok": fused[0].data_ptr() == targets["q_proj.weight"].data_ptr()})
    return log


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("side")
    ap.add_argument("port", type=int)
    ap.add_argument("out_dir")
    ap.add_argument("--fail-at", type=int, default=-1)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--sparse", default="auto", choices=("auto", "on", "off"))
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if a.side == "trainer":
        logs = run_processes(trainer, 2, a.port, a.out_dir, a.fail_at, a.mixed, a.sparse,
                             timeout=240)
    else:
        logs = run_processes(inference, TP, a.port, a.out_dir, a.fail_at, a.mixed,
                             timeout=240, init=False)
    print(json.dumps(logs), flush=True)


if __name__ == "__main__":
    main()
