"""Parity with DTensor: for many random layouts, the local tensor ``distribute_tensor``
gives each rank (over a real gloo world of 8 processes) is exactly what
``Layout.from_dtensor(dt).shard(global, rank)`` builds, shape and values.

The cases (tensor shape, mesh, placements) are drawn in the parent from a fixed seed and
handed to every rank, so all ranks run the same collectives in the same order. Each case
is distributed twice: with ``src_data_rank=None`` (each rank splits locally) and with the
default scatter from group rank 0 (pad, scatter, unpad). Both must match reshard, with two
DTensor-side exceptions that are counted, not failed:

* the scatter path refuses uneven ``_StridedShard`` splits (an ``AssertionError`` in
  ``_StridedShard._shard_tensor``: its ``_split_tensor`` never pads);
* on meshes whose ranks are not ascending along a dim, the scatter path hands chunk k to
  the k-th *smallest* rank of that dim's process group (``new_group`` sorts ranks), not to
  mesh coordinate k, which ``to_local()`` metadata, the split path and reshard all use.
"""

from __future__ import annotations

import random
import time
from math import prod

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import reshard as R
from reshard.tools.launch import run_processes

pytestmark = pytest.mark.multiproc

WORLD = 8
SEED = 20240611
NUM_CASES = 300

# (mesh shape, member ranks in row-major order). Full meshes cover all 8 ranks; some
# use a shuffled rank order; subset meshes leave ranks out (they must hold nothing).
_PERM = [3, 6, 0, 5, 7, 1, 4, 2]
MESHES: list[tuple[tuple[int, ...], tuple[int, ...]]] = [
    ((8,), tuple(range(8))),
    ((2, 4), tuple(range(8))),
    ((4, 2), tuple(range(8))),
    ((2, 2, 2), tuple(range(8))),
    ((1, 8), tuple(range(8))),
    ((2, 1, 4), tuple(range(8))),
    ((4, 2), tuple(_PERM)),
    ((2, 2, 2), tuple(reversed(_PERM))),
    ((2, 4), (0, 2, 4, 6, 1, 3, 5, 7)),  # column-major: not row-major, still ascending
    ((2, 2), (1, 5, 3, 7)),
    ((4,), (1, 3, 5, 7)),
    ((2, 2), (6, 2, 4, 0)),
    ((3,), (0, 4, 5)),
    ((2, 3), (7, 1, 2, 3, 4, 6)),
    ((3, 2), (0, 1, 2, 3, 4, 5)),
    ((2,), (2, 5)),
    ((1,), (4,)),
]

# A placement spec: ("R",), ("S", dim) or ("SS", dim, split_factor).
Spec = tuple


def _draw_cases(seed: int, n: int) -> list[tuple[int, tuple[int, ...], tuple[Spec, ...]]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        m = rng.randrange(len(MESHES))
        mesh_ndim = len(MESHES[m][0])
        if rng.random() < 0.04:
            cases.append((m, (), tuple(("R",) for _ in range(mesh_ndim))))
            continue
        ndim = rng.randint(1, 4)
        # mostly small sizes (uneven over meshes of 2..8), sometimes 0
        shape = tuple(0 if rng.random() < 0.06 else rng.randint(1, 13) for _ in range(ndim))
        specs: list[Spec] = []
        for _ in range(mesh_ndim):
            u = rng.random()
            d = rng.randrange(ndim)
            if u < 0.2:
                specs.append(("R",))
            elif u < 0.6:
                specs.append(("S", d))
            else:
                specs.append(("SS", d, rng.randint(1, 3)))
        cases.append((m, shape, tuple(specs)))
    return cases


def _ascending(shape: tuple[int, ...], ranks: tuple[int, ...]) -> bool:
    """Whether ranks increase along every mesh dim (then each dim's process group ranks its
    members in mesh-coordinate order; ``new_group`` sorts them by global rank)."""
    grid = torch.tensor(ranks).reshape(shape)
    return all(bool((grid.diff(dim=d) > 0).all()) for d in range(len(shape)))


def _to_torch(spec: Spec):
    if spec[0] == "R":
        return Replicate()
    if spec[0] == "S":
        return Shard(spec[1])
    return _StridedShard(spec[1], split_factor=spec[2])


def _compare(lay: R.Layout, full, got, rank: int) -> str | None:
    if tuple(got.shape) != lay.local_shape(rank):
        return f"DTensor local shape {tuple(got.shape)}, reshard {lay.local_shape(rank)}"
    mine = lay.shard(full, rank)
    if tuple(mine.shape) != tuple(got.shape) or not torch.equal(mine, got):
        return (f"DTensor holds {got.flatten().tolist()[:24]}, "
                f"reshard shard() gives {mine.flatten().tolist()[:24]}")
    return None


def _worker(rank: int, world: int, cases) -> dict:
    start = time.perf_counter()
    meshes = [DeviceMesh("cpu", torch.tensor(ranks).reshape(shape)) for shape, ranks in MESHES]
    status: dict[int, str] = {}  # case -> which DTensor paths this member rank verified
    refused: dict[int, str] = {}
    mismatches, permuted_scatter = [], []
    for i, (m, shape, specs) in enumerate(cases):
        placements = [_to_torch(s) for s in specs]
        full = torch.arange(prod(shape)).reshape(shape)
        got, lay = {}, None
        # "split": src_data_rank=None, each rank splits locally (no padding, no scatter);
        # "scatter": the default, coordinate 0 pads, scatters, each rank unpads.
        for path, src in (("split", None), ("scatter", 0)):
            try:
                dt = distribute_tensor(full, meshes[m], placements, src_data_rank=src)
            except Exception as e:  # noqa: BLE001 - DTensor refusing a combination is a skip
                refused[i] = f"{path}: {type(e).__name__}: {e}"[:160]
                continue
            lay = R.Layout.from_dtensor(dt)
            got[path] = dt.to_local()
        if lay is None:
            status[i] = "skipped"
            continue
        if lay.shape != shape or lay.ranks != MESHES[m][1]:
            mismatches.append((i, "layout", f"shape/ranks {lay.shape}/{lay.ranks}"))
        if rank not in lay.rank_set:
            status[i] = "nonmember"
            for path, t in got.items():
                if t.numel():
                    mismatches.append((i, path, f"non-member holds {tuple(t.shape)}"))
            continue
        status[i] = "+".join(sorted(got))
        ascending = _ascending(*MESHES[m])
        for path, t in got.items():
            problem = _compare(lay, full, t, rank)
            if problem is None:
                continue
            if path == "scatter" and not ascending:
                permuted_scatter.append((i, problem))
            else:
                mismatches.append((i, path, problem))
    return {"status": status, "refused": refused, "mismatches": mismatches,
            "permuted_scatter": permuted_scatter, "seconds": time.perf_counter() - start}


def _describe(cases) -> list[dict]:
    """Per case, computed in the parent from reshard alone: what the case exercises."""
    out = []
    for m, shape, specs in cases:
        lay = R.Layout(shape, R.Mesh(torch.tensor(MESHES[m][1]).reshape(MESHES[m][0])),
                       [_to_torch(s) for s in specs])
        shapes = {lay.view_of_slot(s).local_shape for s in range(len(lay.ranks))}
        out.append({"uneven": len(shapes) > 1, "strided": any(s[0] == "SS" for s in specs),
                    "empty": 0 in shape, "ascending": _ascending(*MESHES[m])})
    return out


def summarise(results: list[dict], cases) -> dict:
    """Counts over the whole world: a case is checked when some member rank compared at
    least one DTensor path, skipped when DTensor refused both paths on every member."""
    info = _describe(cases)
    checked, scatter_checked, skipped = set(), set(), set()
    for res in results:
        for i, st in res["status"].items():
            if st == "skipped":
                skipped.add(i)
            elif st != "nonmember":
                checked.add(i)
                if "scatter" in st:
                    scatter_checked.add(i)
    skipped -= checked
    return {
        "cases": len(cases), "checked": len(checked), "skipped_by_dtensor": len(skipped),
        "scatter_checked": len(scatter_checked),
        "scatter_refused": len(checked - scatter_checked),
        "uneven": sum(info[i]["uneven"] for i in checked),
        "strided": sum(info[i]["strided"] for i in checked),
        "uneven_strided": sum(info[i]["uneven"] and info[i]["strided"] for i in checked),
        "zero_size": sum(info[i]["empty"] for i in checked),
        "permuted_mesh": sum(not info[i]["ascending"] for i in checked),
        "mismatches": sum(len(res["mismatches"]) for res in results),
        "permuted_scatter_diffs": sum(len(res["permuted_scatter"]) for res in results),
        "worker_seconds": max(res["seconds"] for res in results),
    }


@pytest.fixture(scope="module")
def parity():
    cases = _draw_cases(SEED, NUM_CASES)
    return cases, run_processes(_worker, WORLD, cases, timeout=240)


def test_distribute_tensor_matches_layout_shard(parity):
    cases, results = parity
    bad = [(rank, cases[m[0]], m) for rank, res in enumerate(results) for m in res["mismatches"]]
    assert not bad, "\n".join(map(repr, bad[:20]))


def test_parity_covers_enough_layouts(parity):
    cases, results = parity
    s = summarise(results, cases)
    print(s)
    assert s["checked"] >= 100, s
    assert s["uneven"] >= 20, s
    assert s["strided"] >= 20, s
    assert s["uneven_strided"] >= 10, s
    assert s["scatter_checked"] >= 60, s


def test_permuted_mesh_scatter_is_the_only_known_difference(parity):
    """DTensor's scatter path sends chunk k to the k-th *smallest* global rank of each
    mesh-dim group (``new_group`` sorts ranks), while ``to_local`` metadata, the
    ``src_data_rank=None`` path and reshard use the mesh coordinate. Differences may only
    come from meshes whose ranks are not ascending along some dim."""
    cases, results = parity
    for res in results:
        for i, _ in res["permuted_scatter"]:
            assert not _ascending(*MESHES[cases[i][0]])
