"""Random layout pairs and a many-tensor model through every method on real gloo
processes: every destination bit-identical to its expected shard."""

from __future__ import annotations

import random
from math import prod

import pytest
import torch

import reshard as R
from reshard.executor import Executor
from reshard.sim.models import synthetic_model
from reshard.sim.specs import model_layouts
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches

pytestmark = pytest.mark.multiproc
WORLD = 8
DTYPES = ["float32", "bfloat16", "int64", "float16"]


def _random_layout(rng: random.Random, shape, ranks, dtype) -> R.Layout:
    mesh_shape = []
    n = len(ranks)
    while n > 1 and len(mesh_shape) < 3:
        f = rng.choice([d for d in (2, 3, 4) if n % d == 0] or [n])
        mesh_shape.append(f)
        n //= f
    mesh_shape = mesh_shape or [1]
    mesh = R.Mesh(torch.tensor(ranks[:prod(mesh_shape)]).reshape(mesh_shape).tolist())
    placements = []
    for _ in mesh_shape:
        kind = rng.choice(["R", "S", "SS"]) if shape else "R"
        d = rng.randrange(len(shape)) if shape else 0
        placements.append(R.Replicate() if kind == "R" else R.Shard(d) if kind == "S"
                          else R.StridedShard(d, rng.randint(1, 3)))
    return R.Layout(shape, mesh, placements, dtype)


def _random_pairs(seed: int, count: int):
    rng = random.Random(seed)
    src, dst = {}, {}
    for i in range(count):
        shape = tuple(rng.randint(0, 11) for _ in range(rng.randint(0, 4)))
        dtype = rng.choice(DTYPES)
        kind = rng.choice(["disjoint", "overlap", "identical"])
        a = rng.sample(range(WORLD // 2) if kind == "disjoint" else range(WORLD),
                       rng.choice([1, 2, 3, 4]))
        if kind == "identical":
            b = a[:]
        elif kind == "overlap":
            b = rng.sample(range(WORLD), rng.choice([1, 2, 4, 6]))
        else:
            b = rng.sample(range(WORLD // 2, WORLD), rng.choice([1, 2, 3, 4]))
        src[f"t{i}"] = _random_layout(rng, shape, a, dtype)
        dst[f"t{i}"] = _random_layout(rng, shape, b, dtype)
    return src, dst


def _worker(rank, world, src_layouts, dst_layouts, methods):
    plan = R.plan(src_layouts, dst_layouts)
    src = {t.name: fill_local(t.src, rank, salt=3) for t in plan.tensors
           if rank in t.src.rank_set}
    out = {}
    for method in methods:
        dst = {t.name: torch.full(t.dst.local_shape(rank), 7, dtype=getattr(torch, t.dst.dtype))
               for t in plan.tensors if rank in t.dst.rank_set}
        Executor(plan, method=method, budget_bytes=4096).run(src, dst)
        out[method] = [t.name for t in plan.tensors if t.name in dst
                       and not matches(t.dst, rank, dst[t.name], salt=3)]
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_random_layouts_every_method(seed):
    src, dst = _random_pairs(seed, 40)
    methods = ["reshard", "p2p", "gather_broadcast", "colocated"]
    for rank, bad in enumerate(run_processes(_worker, WORLD, src, dst, methods, timeout=240)):
        assert bad == {m: [] for m in methods}, f"rank {rank}: {bad}"


def test_many_tensor_model_every_method():
    model = synthetic_model(8 << 20, dtype="bfloat16")
    src = model_layouts(model.tensors, "fsdp2,tp2")
    dst = model_layouts(model.tensors, "tp2,dp2", first_rank=4)
    methods = ["reshard", "p2p", "gather_broadcast", "colocated"]
    for rank, bad in enumerate(run_processes(_worker, WORLD, src, dst, methods, timeout=240)):
        assert bad == {m: [] for m in methods}, f"rank {rank}: {bad}"
