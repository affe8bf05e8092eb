"""``reshard.redistribute`` over a real gloo world of 8 processes: for a few hundred random
(source DTensor, destination mesh and placements) pairs, what it returns on every rank
is exactly what DTensor itself holds for the same full tensor on the destination mesh
(``distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()``). Uneven
shards, ``_StridedShard``, several mesh axes sharding one dim, casts, and disjoint,
overlapping and identical meshes; then the ``{name: DTensor}`` form over a model,
``out=``, a process subgroup, the cache, and bad input refused on every rank.

The cases are drawn in the parent from a fixed seed and handed to every rank, so all
ranks make the same calls in the same order.
"""

from __future__ import annotations

import random
from math import prod

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import reshard
from reshard import dtensor as rd
from reshard.tools.launch import run_processes

pytestmark = pytest.mark.multiproc

WORLD = 8
SEED = 20261201
NUM_CASES = 300
CASTS = (None, None, None, torch.bfloat16, torch.float64, torch.float16)

# (mesh shape, member ranks in row-major order): full, permuted, subset and disjoint
MESHES: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
    ((8,), tuple(range(8))),
    ((2, 4), tuple(range(8))),
    ((4, 2), tuple(range(8))),
    ((2, 2, 2), tuple(range(8))),
    ((4, 2), (3, 6, 0, 5, 7, 1, 4, 2)),
    ((4,), (0, 1, 2, 3)),
    ((2, 2), (4, 5, 6, 7)),
    ((2, 2), (1, 5, 3, 7)),
    ((3,), (0, 4, 5)),
    ((2, 3), (7, 1, 2, 3, 4, 6)),
    ((3,), (5, 6, 7)),
    ((2,), (2, 5)),
    ((1,), (4,)),
]

Spec = tuple  # ("R",), ("S", dim) or ("SS", dim, split_factor)


def _placements(rng: random.Random, ndim: int, mesh_ndim: int) -> tuple[Spec, ...]:
    specs: list[Spec] = []
    for _ in range(mesh_ndim):
        u, d = rng.random(), rng.randrange(ndim) if ndim else 0
        if u < 0.25 or not ndim:
            specs.append(("R",))
        elif u < 0.7:
            specs.append(("S", d))
        else:
            specs.append(("SS", d, rng.randint(1, 3)))
    return tuple(specs)


def draw_cases(seed: int, n: int) -> list[tuple]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        ndim = rng.randint(0, 3) if rng.random() < 0.05 else rng.randint(1, 3)
        shape = tuple(0 if rng.random() < 0.04 else rng.randint(1, 11) for _ in range(ndim))
        m1, m2 = rng.randrange(len(MESHES)), rng.randrange(len(MESHES))
        u = rng.random()
        if u < 0.15:
            m2 = m1  # the same mesh, other placements (what DTensor.redistribute does)
        elif u < 0.3:  # another job's ranks
            m2 = rng.choice([m for m in range(len(MESHES)) if relation(m1, m) == "disjoint"]
                            or [m2])
        cases.append((shape, m1, _placements(rng, ndim, len(MESHES[m1][0])),
                      m2, _placements(rng, ndim, len(MESHES[m2][0])),
                      rng.choice(CASTS), rng.random() < 0.1))
    return cases


def relation(m1: int, m2: int) -> str:
    a, b = set(MESHES[m1][1]), set(MESHES[m2][1])
    return "identical" if a == b else "disjoint" if not a & b else "overlapping"


def _torch(spec: Spec):
    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


def _full(shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(prod(shape), dtype=torch.float64).reshape(shape) * 1.25 - 3).to(dtype)


def _same(got, want) -> str | None:
    a, b = got.to_local(), want.to_local()
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return f"local {tuple(a.shape)} {a.dtype}, DTensor holds {tuple(b.shape)} {b.dtype}"
    if not torch.equal(a, b):
        return f"values differ: {a.flatten()[:8].tolist()} vs {b.flatten()[:8].tolist()}"
    if tuple(got.shape) != tuple(want.shape) or got.placements != want.placements:
        return f"global {tuple(got.shape)} {got.placements} vs {tuple(want.shape)} " \
               f"{want.placements}"
    if got.device_mesh != want.device_mesh:
        return "destination mesh differs"
    return None


def _random_pairs(rank: int, meshes, cases) -> dict:
    status, mismatches, cached = {}, [], 0
    for i, (shape, m1, p1, m2, p2, cast, again) in enumerate(cases):
        full = _full(shape)
        src_pl, dst_pl = [_torch(s) for s in p1], [_torch(s) for s in p2]
        try:
            dt = distribute_tensor(full, meshes[m1], src_pl, src_data_rank=None)
            want = distribute_tensor(full.to(cast or full.dtype), meshes[m2], dst_pl,
                                     src_data_rank=None)
        except Exception as e:  # noqa: BLE001 - DTensor refusing a combination is a skip
            status[i] = f"skipped: {type(e).__name__}"
            continue
        got = reshard.redistribute(dt, meshes[m2], dst_pl, dtype=cast)
        problem = _same(got, want)
        if again and problem is None:  # a repeated call: served by the kept executor
            size = rd.cache_size()
            problem = _same(reshard.redistribute(dt, meshes[m2], dst_pl, dtype=cast), want)
            cached += rd.cache_size() == size
        status[i] = "checked"
        if problem:
            mismatches.append((i, problem))
    return {"status": status, "mismatches": mismatches, "cached": cached}


MODEL = {  # name: (shape, FSDP placement on the trainer, TP placement on the engine)
    "embed": ((50, 32), Shard(0), Shard(0)),
    "q": ((32, 32), Shard(0), Shard(0)),
    "o": ((32, 32), Shard(0), Shard(1)),
    "up": ((64, 32), _StridedShard(0, split_factor=2), Shard(0)),
    "down": ((32, 64), Shard(0), Shard(1)),
    "norm": ((32,), Shard(0), Replicate()),
    "bias": ((7,), Shard(0), Replicate()),
}


def _model(rank: int) -> dict:
    trainer = DeviceMesh("cpu", torch.arange(4))
    engine = DeviceMesh("cpu", torch.tensor([[4, 5], [6, 7]]), mesh_dim_names=("dp", "tp"))
    fulls = {n: _full(s) for n, (s, _, _) in MODEL.items()}
    src = {n: distribute_tensor(fulls[n], trainer, [p], src_data_rank=None)
           for n, (_, p, _) in MODEL.items()}
    placements = {n: [Replicate(), p] for n, (_, _, p) in MODEL.items()}
    rd.clear_cache()
    got = reshard.redistribute(src, engine, placements, dtype=torch.bfloat16)
    new_executors = rd.cache_size()
    bad = []
    for n in MODEL:
        want = distribute_tensor(fulls[n].bfloat16(), engine, placements[n],
                                 src_data_rank=None)
        if (problem := _same(got[n], want)) is not None:
            bad.append((n, problem))
    # out=: written in place, the same objects returned
    outs = {n: distribute_tensor(torch.zeros(s, dtype=torch.bfloat16), engine, placements[n],
                                 src_data_rank=None) for n, (s, _, _) in MODEL.items()}
    again = reshard.redistribute(src, out=outs, dtype=torch.bfloat16)
    same_objects = all(again[n] is outs[n] for n in MODEL)
    bad += [(n, "out= " + p) for n in MODEL if (p := _same(outs[n], got[n])) is not None]
    return {"bad": bad, "new_executors": new_executors, "same_objects": same_objects}


def _subgroup(rank: int) -> dict:
    """A group of ranks 2..5 holding both meshes: ranks outside it make no call."""
    group = dist.new_group([2, 3, 4, 5])
    a = DeviceMesh("cpu", torch.tensor([2, 3]))
    b = DeviceMesh("cpu", torch.tensor([5, 4]))
    c = DeviceMesh("cpu", torch.tensor([4, 7]))
    full = _full((9, 4))
    if rank not in (2, 3, 4, 5):
        return {"ok": True}
    dt = distribute_tensor(full, a, [Shard(0)], src_data_rank=None)
    got = reshard.redistribute(dt, b, [Shard(1)], group=group)
    want = distribute_tensor(full, b, [Shard(1)], src_data_rank=None)
    outside = None
    try:  # a destination mesh holding rank 7, which the group does not
        reshard.redistribute(dt, c, [Shard(0)], group=group)
    except reshard.ReshardError as e:
        outside = str(e)
    return {"ok": _same(got, want) is None, "outside": outside}


def _refusals(rank: int) -> dict:
    """Bad input: every rank raises the same error and no destination byte changes."""
    mesh_a = DeviceMesh("cpu", torch.arange(4))
    mesh_b = DeviceMesh("cpu", torch.arange(4, 8))
    dt = distribute_tensor(_full((8, 6)), mesh_a, [Shard(0)], src_data_rank=None)
    out = distribute_tensor(torch.full((8, 6), 7.0), mesh_b, [Shard(1)], src_data_rank=None)
    errors = {}
    calls = {
        # rank 3 asks for other placements than everyone else
        "disagree": lambda: reshard.redistribute(
            dt, mesh_b, [Shard(1) if rank == 3 else Shard(0)], out=None),
        # rank 6's out has another shape
        "out_shape": lambda: reshard.redistribute(
            dt, out=out if rank != 6 else distribute_tensor(
                torch.zeros(8, 5), mesh_b, [Shard(1)], src_data_rank=None)),
        # placements for a 2-d mesh on a 1-d one, on every rank
        "placements": lambda: reshard.redistribute(dt, mesh_b, [Shard(0), Shard(1)]),
        # a shard dim the tensor does not have
        "dim": lambda: reshard.redistribute(dt, mesh_b, [Shard(2)]),
        # not a DTensor on rank 1
        "plain": lambda: reshard.redistribute(dt if rank != 1 else dt.to_local(), mesh_b,
                                              [Shard(0)]),
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except reshard.ReshardError as e:
            errors[name] = (type(e).__name__, str(e))
    untouched = bool((out.to_local() == 7).all())
    return {"errors": errors, "untouched": untouched}


def _bare_tensors(rank: int) -> bool:
    """``Executor.run`` of a single-tensor plan takes bare tensors (None where a rank
    holds no part of that side)."""
    src = reshard.Layout((6, 5), reshard.Mesh([0, 1, 2]), [reshard.Shard(0)])
    dst = reshard.Layout((6, 5), reshard.Mesh([[4, 5], [6, 7]]),
                         [reshard.Shard(1), reshard.Shard(0)])
    full = _full((6, 5))
    local = src.shard(full, rank) if rank in src.rank_set else None
    out = torch.zeros(dst.local_shape(rank)) if rank in dst.rank_set else None
    reshard.Executor(reshard.plan(src, dst)).run(local, out)
    return out is None or torch.equal(out, dst.shard(full, rank))


def _worker(rank: int, world: int, cases) -> dict:
    meshes = [DeviceMesh("cpu", torch.tensor(ranks).reshape(shape)) for shape, ranks in MESHES]
    return {"random": _random_pairs(rank, meshes, cases), "model": _model(rank),
            "subgroup": _subgroup(rank), "refusals": _refusals(rank),
            "bare": _bare_tensors(rank)}


@pytest.fixture(scope="module")
def world():
    cases = draw_cases(SEED, NUM_CASES)
    return cases, run_processes(_worker, WORLD, cases, timeout=400)


def test_random_pairs_match_distribute_tensor(world):
    cases, results = world
    bad = [(rank, i, cases[i], p) for rank, res in enumerate(results)
           for i, p in res["random"]["mismatches"]]
    assert not bad, "\n".join(map(repr, bad[:20]))


def test_random_pairs_cover_what_the_issue_lists(world):
    cases, results = world
    checked = [i for i, st in results[0]["random"]["status"].items() if st == "checked"]
    uneven = strided = multi_axis = cast = 0
    relations = {"identical": 0, "overlapping": 0, "disjoint": 0}
    for i in checked:
        shape, m1, p1, m2, p2, dtype, _ = cases[i]
        dims = [s[1] for s in p1 + p2 if s[0] != "R"]
        uneven += any(n % 2 for n in shape)
        strided += any(s[0] == "SS" for s in p1 + p2)
        multi_axis += len(dims) != len(set(dims))
        cast += dtype is not None
        relations[relation(m1, m2)] += 1
    print({"checked": len(checked), "uneven": uneven, "strided": strided,
           "several_axes_one_dim": multi_axis, "cast": cast, **relations})
    assert len(checked) >= 250
    assert min(uneven, strided, multi_axis, cast) >= 30
    assert min(relations.values()) >= 30, relations
    assert all(res["random"]["cached"] >= 10 for res in results)


def test_dict_form_moves_a_model_with_one_executor(world):
    _, results = world
    for rank, res in enumerate(results):
        m = res["model"]
        assert not m["bad"], (rank, m["bad"])
        assert m["new_executors"] == 1 and m["same_objects"], (rank, m)


def test_subgroup_maps_mesh_ranks_to_group_ranks(world):
    _, results = world
    assert all(res["subgroup"]["ok"] for res in results)
    for rank in (2, 3, 4, 5):
        assert "mesh rank 7 is not in the group" in results[rank]["subgroup"]["outside"]


@pytest.mark.parametrize("case, error, text", [
    ("disagree", "FingerprintMismatchError", "the ranks were called with different"),
    ("out_shape", "TensorMismatchError", "rank 6: tensor 'tensor': out has shape [8, 5]"),
    ("placements", "LayoutError", "expected 1 placements (one per mesh dim), got 2"),
    ("dim", "LayoutError", "placement S(2) on mesh dim 0 shards tensor dim 2, but the tensor"),
    ("plain", "TensorMismatchError", "rank 1: tensor 'tensor': the source is a Tensor"),
])
def test_bad_input_refused_on_every_rank(world, case, error, text):
    _, results = world
    seen = {res["refusals"]["errors"][case] for res in results}
    assert len(seen) == 1, seen  # the same error on every rank
    (kind, message), = seen
    assert kind == error and text in message and "nothing was moved" in message, message
    assert all(res["refusals"]["untouched"] for res in results)


def test_executor_takes_bare_tensors_for_one_tensor(world):
    _, results = world
    assert all(res["bare"] for res in results)
