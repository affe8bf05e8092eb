"""A receiver that learns the trainer's tensors at the meeting (``prepare=``): it gets
their names, shapes and dtypes before the group forms and builds its targets from them;
if it cannot (an unknown tensor), every rank of both jobs raises the same error class
naming it, and nothing moves. One trainer rank and two inference ranks (TP2)."""

from __future__ import annotations

import pytest
import torch

import reshard as R
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.launch import free_port, run_processes

pytestmark = pytest.mark.multiproc

FULL = {"w": torch.arange(48.0).reshape(8, 6), "b": torch.arange(6.0)}


def _receiver_side(trainer: dict, rank: int, extra_ok: bool):
    """Column shards of every 2-d tensor over TP2, vectors replicated: from names and
    shapes alone; an unknown name ``"x"`` is refused unless ``extra_ok``."""
    targets, layouts = {}, {}
    mesh = R.Mesh([0, 1])
    for name, layout in trainer.items():
        if name == "x" and not extra_ok:
            raise R.MappingError(f"no rule maps the trainer tensor {name!r}")
        place = [R.Shard(1)] if len(layout.shape) == 2 else [R.Replicate()]
        layouts[name] = R.Layout(layout.shape, mesh, place, layout.dtype)
        targets[name] = torch.zeros(layouts[name].local_shape(rank))
    return targets, layouts, ()


def _job(rank: int, world: int, port: int, extra: bool) -> dict:
    params = dict(FULL, **({"x": torch.ones(3)} if extra else {}))
    try:
        if rank == 0:
            layouts = {n: R.Layout(t.shape, R.Mesh([0]), [R.Replicate()]) for n, t in
                       params.items()}
            side = RefitSender(params, layouts=layouts, host="127.0.0.1", port=port, rank=0,
                               trainer_size=1, inference_size=2)
            side.refit(1)
            return {"ok": True}
        side = RefitReceiver(prepare=lambda tr: _receiver_side(tr, rank - 1, False),
                             host="127.0.0.1", port=port, rank=rank - 1, trainer_size=1,
                             inference_size=2)
        side.refit()
        want = {n: side.meeting.plan[n].dst.shard(t, rank) for n, t in FULL.items()}
        return {"ok": all(torch.equal(side.targets[n], want[n]) for n in FULL),
                "names": sorted(side.targets)}
    except R.ReshardError as e:
        return {"ok": False, "error": (type(e).__name__, str(e))}


def test_receiver_learns_the_trainers_tensors_at_the_meeting():
    results = run_processes(_job, 3, free_port(), False, init=False, timeout=120)
    assert all(r["ok"] for r in results), results
    assert results[1]["names"] == results[2]["names"] == ["b", "w"]


def test_an_unknown_trainer_tensor_is_refused_on_every_rank():
    results = run_processes(_job, 3, free_port(), True, init=False, timeout=120)
    errors = {r.get("error") for r in results}
    assert len(errors) == 1, errors  # the same error on all three ranks, both jobs
    (kind, message), = errors
    assert kind == "MappingError" and "'x'" in message and "nothing was moved" in message
