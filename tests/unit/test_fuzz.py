"""Bad input never moves a byte: random malformed layouts, meshes, placements, plan calls
and tensors thrown at the planner and at the executor's validation. Every case is either
refused with a :class:`reshard.ReshardError` subclass or succeeds with results equal,
bit for bit, to ``layout.shard(global, rank)``; nothing else may escape.

The validation fuzz runs the real :class:`reshard.executor.Executor` (check, schedule,
packing, unpacking) on in-process thread ranks (``_inproc``), and also checks that a
refused call left every destination tensor untouched."""

from __future__ import annotations

from contextlib import contextmanager
from math import prod
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.executor import Executor, local_problem

from ._inproc import run_ranks

COUNTS: dict[str, dict[str, int]] = {}
REFUSED = object()
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)


def _count(kind: str, outcome: str) -> None:
    c = COUNTS.setdefault(kind, {"cases": 0, "refused": 0, "exact": 0})
    c["cases"] += 1
    c[outcome] += 1


@contextmanager
def _nothing():
    yield


def attempt(fn) -> Any:
    """Run ``fn``; a ReshardError is a refusal, anything else escapes and fails the test."""
    try:
        return fn()
    except R.ReshardError:
        return REFUSED


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    total = sum(c["cases"] for k, c in COUNTS.items() if not k.startswith(" "))
    lines = [f"fuzz: {total} cases"] + [
        f"  {k}: {c['cases']} cases, {c['refused']} refused, {c['exact']} exact"
        for k, c in COUNTS.items() if not k.startswith(" ")]
    by_mutation = sorted((k.split("/")[1], c) for k, c in COUNTS.items() if k.startswith(" "))
    if by_mutation:
        lines.append("  validation mutations (refused/exact): " + ", ".join(
            f"{m} {c['refused']}/{c['exact']}" for m, c in by_mutation))
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    with capman.global_and_fixture_disabled() if capman else _nothing():
        print("\n" + "\n".join(lines), flush=True)


# -- garbage ------------------------------------------------------------------------------
class Weird:
    def __repr__(self) -> str:
        return "Weird()"


GARBAGE = st.sampled_from([None, "x", "", "S(0)", 1.5, -1, 0, 7, True, b"ab", [], {}, (),
                           float("nan"), Weird(), [[]], [None], {"a": 1}, np.int64(2),
                           torch.tensor(3), range(0)])


def _torch_placement(kind: str, a: int, b: int) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {"S": lambda: Shard(a), "R": Replicate, "P": Partial,
            "SS": lambda: _StridedShard(a, split_factor=b)}[kind]()


@st.composite
def shapes(draw):
    dims = draw(st.lists(st.integers(0, 6), min_size=0, max_size=3))
    how = draw(st.sampled_from(["ok"] * 14 + ["neg", "junk", "garbage", "numpy", "size",
                                               "huge", "gen"]))
    if how == "neg" and dims:
        dims[draw(st.integers(0, len(dims) - 1))] = draw(st.integers(-5, -1))
    elif how == "junk" and dims:
        dims[draw(st.integers(0, len(dims) - 1))] = draw(GARBAGE)
    elif how == "garbage":
        return draw(GARBAGE)
    elif how == "numpy":
        return np.array(dims, dtype=np.int64)
    elif how == "size":
        return torch.Size(dims)
    elif how == "huge":
        return (1 << 40, 3)
    elif how == "gen":
        return (d for d in dims)
    return tuple(dims) if draw(st.booleans()) else list(dims)


@st.composite
def meshes(draw):
    """(mesh argument, its number of dims as a caller would count them)."""
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    return draw(_meshes(shape)), len(shape)


@st.composite
def _meshes(draw, shape):
    start = draw(st.integers(0, 3))
    flat = list(range(start, start + prod(shape)))
    how = draw(st.sampled_from(["ok"] * 14 + ["mesh"] * 4 + [
        "dup", "neg", "ragged", "junk", "garbage", "numpy", "tensor", "string", "names",
        "empty_row"]))
    if how == "dup" and len(flat) > 1:
        flat[-1] = flat[0]
    elif how == "neg":
        flat[0] = -1
    elif how == "junk":
        flat[0] = draw(GARBAGE)
    elif how == "garbage":
        return draw(GARBAGE)
    elif how == "string":
        return "ab"
    nested: Any = flat
    for size in reversed(shape[1:]):
        nested = [nested[i:i + size] for i in range(0, len(nested), size)]
    if how == "ragged" and isinstance(nested[0], list) and len(nested) > 1:
        nested[-1] = nested[-1][:-1] or [[]]
    elif how == "empty_row" and isinstance(nested[0], list):
        nested[0] = []
    elif how == "numpy":
        return np.array(nested)
    elif how == "tensor":
        return torch.tensor(nested)
    elif how == "mesh":
        return ("Mesh", nested, None)
    elif how == "names":
        return ("Mesh", nested, draw(st.sampled_from([5, "ab", ["a"], ("x", "y", "z"), None,
                                                       [None, None, None]])))
    return nested


@st.composite
def placements(draw, n: int, tensor_ndim: int = 3):
    out = []
    for _ in range(n + draw(st.sampled_from([0] * 8 + [-1, 1]))):
        kind = draw(st.sampled_from(["S"] * 6 + ["R"] * 4 + ["SS"] * 3 + ["str"] * 2
                                    + ["torch"] * 2 + ["garbage", "bad_dim"]))
        a = draw(st.integers(0, max(tensor_ndim - 1, 0)) if draw(st.integers(0, 9))
                 else st.integers(0, 3))
        b = draw(st.integers(1, 3))
        if kind == "S":
            out.append(("Shard", a))
        elif kind == "R":
            out.append(("Replicate",))
        elif kind == "SS":
            out.append(("Strided", a, b))
        elif kind == "str":
            out.append(draw(st.sampled_from(["R", f"S({a})", f"_S({a},{b})", "S(x)", "_S(1)",
                                             "Q", " S ( 1 ) ", "S(-1)", "_S(0,0)"])))
        elif kind == "torch":
            out.append(("torch", draw(st.sampled_from(["S", "R", "P", "SS"])), a, b))
        elif kind == "bad_dim":
            out.append(draw(st.sampled_from([("Shard", -1), ("Strided", 0, 0),
                                             ("Strided", -2, 1), ("Shard", 1.5),
                                             ("Shard", "0"), ("Strided", 0, 1.0)])))
        else:
            out.append(("raw", draw(GARBAGE)))
    if draw(st.integers(0, 20)) == 0:
        return ("raw", draw(st.sampled_from(["S(0)", None, 3, R.Replicate()])))
    return out


def build_placement(spec: Any) -> Any:
    if isinstance(spec, str):
        return spec
    kind = spec[0]
    if kind == "Shard":
        return R.Shard(spec[1])
    if kind == "Replicate":
        return R.Replicate()
    if kind == "Strided":
        return R.StridedShard(spec[1], spec[2])
    if kind == "torch":
        return _torch_placement(*spec[1:])
    return spec[1]


def build_mesh(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "Mesh":
        return R.Mesh(spec[1], spec[2])
    return spec


def build_placements(specs: Any) -> Any:
    if isinstance(specs, tuple) and specs and specs[0] == "raw":
        return specs[1]
    return [build_placement(p) for p in specs]


DTYPES = st.sampled_from(["float32"] * 12 + ["int64", "bfloat16", "float16", torch.float64,
                                           torch.int32, "complex64", "float8_e4m3fn",
                                           "float31", None, 3, torch.float32, "torch.int8",
                                           torch.uint16])


def _global(shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    g = torch.arange(prod(shape), dtype=torch.int64).reshape(shape) % 251 - 120
    return g.to(getattr(torch, dtype))


def _simple(shape: tuple[int, ...], first: int, dtype: str) -> R.Layout:
    """A valid other end to plan against: one rank or rows split over two."""
    if shape and shape[0] >= 2:
        return R.Layout(shape, R.Mesh([first, first + 1]), [R.Shard(0)], dtype)
    return R.Layout(shape, R.Mesh([first]), [R.Replicate()], dtype)


def check_layout_exact(layout: R.Layout) -> str:
    """Plan to and from ``layout``; carry it out locally; compare with ``shard``."""
    if layout.numel > 5000:
        return "exact"  # planning alone must not fail; moving 2**40 elements is not the point
    g = _global(layout.shape, layout.dtype)
    shifted = max(layout.ranks) + 1
    for src, dst in ((layout, _simple(layout.shape, shifted, layout.dtype)),
                     (_simple(layout.shape, shifted, layout.dtype), layout),
                     (layout, layout)):
        p = R.plan(src, dst)
        out = R.execute_local(p, {r: src.shard(g, r) for r in src.ranks})
        for r in dst.ranks:
            expected = dst.shard(g, r)
            assert out[r].dtype == expected.dtype and torch.equal(out[r], expected), (src, dst)
    return "exact"


# -- 1. placement-based layouts -------------------------------------------------------------
@settings(max_examples=1700, **SETTINGS)
@given(shape=shapes(), mesh_ndim=meshes(), data=st.data(), dtype=DTYPES)
def test_fuzz_placement_layouts(shape, mesh_ndim, data, dtype):
    mesh, ndim = mesh_ndim
    specs = data.draw(placements(ndim, len(shape) if isinstance(shape, list | tuple) else 2))

    def go():
        layout = R.Layout(shape, build_mesh(mesh), build_placements(specs), dtype)
        for r in layout.ranks:
            layout.local_shape(r)
        return check_layout_exact(layout)

    out = attempt(go)
    _count("placement layouts", "refused" if out is REFUSED else out)


# -- 2. explicit layouts ------------------------------------------------------------------
@st.composite
def explicit_specs(draw):
    """A valid explicit layout (grid boxes, each held by one or two ranks, stacked along
    dim 0 of each local tensor, maybe padded), then maybe one mutation."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    cuts = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=2)))) if n > 1 else []
            for n in shape]
    bounds = [[0, *c, n] for c, n in zip(cuts, shape)]
    boxes = [((), ())]
    for b in bounds:
        boxes = [(o + (lo,), s + (hi - lo,)) for o, s in boxes for lo, hi in zip(b, b[1:])]
    nranks = draw(st.integers(1, 4))
    held: dict[int, list] = {r: [] for r in range(nranks)}
    for box in boxes:
        for r in set(draw(st.lists(st.integers(0, nranks - 1), min_size=1, max_size=2))):
            held[r].append(box)
    views: dict[Any, Any] = {}
    for r, mine in held.items():
        rows, pieces = 0, []
        for off, size in mine:
            pieces.append([list(off), list(size), [rows] + [0] * (len(shape) - 1)])
            rows += size[0]
        pad = draw(st.integers(0, 1))
        local = [rows + pad] + [max((s[d] for _, s in mine), default=0) + pad
                                for d in range(1, len(shape))]
        views[r + 2] = [local, pieces]
    mutation = draw(st.sampled_from(["none"] * 5 + [
        "offset", "size", "local_offset", "local_shape", "drop", "junk", "arity", "neg",
        "key", "mixed_keys", "not_mapping", "view_arity", "empty", "float", "dims",
        "neg_local_shape", "dup_rank_box", "bool"]))
    ranks = sorted(views)
    r = draw(st.sampled_from(ranks))
    pieces = views[r][1]
    i = draw(st.integers(0, max(len(pieces) - 1, 0)))
    d = draw(st.integers(0, len(shape) - 1))
    delta = draw(st.sampled_from([-1, 1, 2]))
    if mutation in ("offset", "size", "local_offset", "neg", "float", "junk", "bool") \
            and pieces:
        field = {"offset": 0, "size": 1, "local_offset": 2}.get(mutation,
                                                                 draw(st.integers(0, 2)))
        pieces[i][field][d] = {"neg": -1, "float": pieces[i][field][d] + 0.5,
                               "junk": draw(GARBAGE), "bool": True}.get(
            mutation, pieces[i][field][d] + delta)
    elif mutation == "local_shape":
        views[r][0][d] = max(0, views[r][0][d] + delta)
    elif mutation == "neg_local_shape":
        views[r][0][d] = -2
    elif mutation == "drop" and pieces:
        pieces.pop(i)
    elif mutation == "arity" and pieces:
        pieces[i] = pieces[i][:2]
    elif mutation == "view_arity":
        views[r] = [views[r][0]]
    elif mutation == "dims":
        views[r][0] = views[r][0] + [1]
    elif mutation == "key":
        views[draw(st.sampled_from([-1, "0", 1.5, None]))] = views.pop(r)
    elif mutation == "mixed_keys" and len(views) > 1:
        views["a"] = views.pop(r)
    elif mutation == "not_mapping":
        return shape, list(views.items()), mutation
    elif mutation == "empty":
        return shape, {}, mutation
    elif mutation == "dup_rank_box" and pieces:
        pieces.append([list(p) for p in pieces[i]])  # the same box twice on one rank
        pieces[-1][2][0] = views[r][0][0]
        views[r][0][0] += pieces[i][1][0]
    return shape, views, mutation


def _as_views(views: Any) -> Any:
    if not isinstance(views, dict):
        return views
    out = {}
    for k, v in views.items():
        if isinstance(v, list) and len(v) == 2 and isinstance(v[1], list):
            out[k] = (tuple(v[0]), [tuple(tuple(x) if isinstance(x, list) else x for x in p)
                                    for p in v[1]])
        else:
            out[k] = v
    return out


@settings(max_examples=1700, **SETTINGS)
@given(spec=explicit_specs(), dtype=st.sampled_from(["float32", "int64", "bfloat16"]),
       wrap=st.booleans())
def test_fuzz_explicit_layouts(spec, dtype, wrap):
    shape, views, mutation = spec

    def go():
        vs = _as_views(views)
        if wrap and isinstance(vs, dict):  # LocalView objects instead of tuples
            vs = {k: R.LocalView.of(*v) if isinstance(v, tuple) and len(v) == 2 else v
                  for k, v in vs.items()}
        layout = R.Layout.explicit(shape, vs, dtype)
        return check_layout_exact(layout)

    out = attempt(go)
    if mutation == "none":
        assert out is not REFUSED, (shape, views)
    _count("explicit layouts", "refused" if out is REFUSED else out)


# -- 3. plan() and execute_local() calls ----------------------------------------------------
@st.composite
def valid_layouts(draw, shape, first=0, dtype="float32"):
    mesh_shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    ps = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["R", "S", "SS"] if shape else ["R"]))
        if kind == "R":
            ps.append(R.Replicate())
        elif kind == "S":
            ps.append(R.Shard(draw(st.integers(0, len(shape) - 1))))
        else:
            ps.append(R.StridedShard(draw(st.integers(0, len(shape) - 1)),
                                     draw(st.integers(1, 3))))
    return R.Layout(shape, R.Mesh.from_shape(mesh_shape, start=first), ps, dtype)


@st.composite
def plan_calls(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    names = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3,
                          unique=True))
    dt_src = draw(st.sampled_from(["float32", "float32", "int64", "bfloat16"]))
    dt_dst = draw(st.sampled_from([dt_src, dt_src, "float32", "float16"]))
    first = draw(st.integers(0, 4))
    src = {n: draw(valid_layouts(shape, 0, dt_src)) for n in names}
    dst = {n: draw(valid_layouts(shape, first, dt_dst)) for n in names}
    how = draw(st.sampled_from(["ok"] * 5 + ["single", "names", "value", "shape", "mixed",
                                              "garbage", "strings", "lists", "none"]))
    if how == "single":
        return src[names[0]], dst[names[0]], how
    if how == "names":
        dst["zz"] = dst.pop(names[0])
    elif how == "value":
        dst[names[0]] = draw(GARBAGE)
    elif how == "shape":
        other = tuple(n + 1 for n in shape) or (1,)
        dst[names[0]] = draw(valid_layouts(other, first, dt_dst))
    elif how == "mixed":
        return src[names[0]], dst, how
    elif how == "garbage":
        return draw(GARBAGE), draw(GARBAGE), how
    elif how == "strings":
        return "ab", "ab", how
    elif how == "lists":
        return list(src.values()), list(dst.values()), how
    elif how == "none":
        return None, dst, how
    return src, dst, how


@st.composite
def src_locals_mutation(draw):
    return draw(st.sampled_from(["none"] * 4 + ["missing", "shape", "dtype", "list",
                                                 "numpy", "not_mapping", "noncontig",
                                                 "extra_rank"]))


@settings(max_examples=1300, **SETTINGS)
@given(call=plan_calls(), allow_cast=st.booleans(), mutation=src_locals_mutation(),
       data=st.data())
def test_fuzz_plan_and_execute_local(call, allow_cast, mutation, data):
    src, dst, how = call
    p = attempt(lambda: R.plan(src, dst, allow_cast=allow_cast))
    if p is REFUSED:
        _count("plan calls", "refused")
        return
    single = isinstance(src, R.Layout)
    srcs = {"tensor": src} if single else src
    dsts = {"tensor": dst} if single else dst
    names = list(srcs)
    globals_ = {n: _global(srcs[n].shape, srcs[n].dtype) for n in names}
    ranks = sorted({r for n in names for r in srcs[n].ranks})
    locals_: dict[int, Any] = {r: {n: srcs[n].shard(globals_[n], r) for n in names
                                   if r in srcs[n].rank_set} for r in ranks}
    if not ranks:  # an empty plan (two empty mappings) moves nothing
        assert attempt(lambda: R.execute_local(p, {})) == {}
        _count("plan calls", "exact")
        return
    if mutation != "none":
        r = data.draw(st.sampled_from(ranks))
        n = data.draw(st.sampled_from(sorted(locals_[r]))) if locals_[r] else None
        if mutation == "missing":
            locals_.pop(r)
        elif n is not None and mutation == "shape":
            locals_[r][n] = torch.zeros(tuple(x + 1 for x in locals_[r][n].shape) + (1,))
        elif n is not None and mutation == "dtype":
            locals_[r][n] = locals_[r][n].to(torch.float64 if locals_[r][n].dtype !=
                                             torch.float64 else torch.float32)
        elif n is not None and mutation == "list":
            locals_[r][n] = locals_[r][n].tolist()
        elif n is not None and mutation == "numpy":
            locals_[r][n] = locals_[r][n].float().numpy()
        elif mutation == "not_mapping":
            locals_ = list(locals_.values())
        elif n is not None and mutation == "noncontig" and locals_[r][n].dim() >= 2:
            t = locals_[r][n]
            locals_[r][n] = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values
        elif mutation == "extra_rank":
            locals_[max(ranks) + 7] = {"tensor": torch.zeros(2)} if single else {}
    arg = ({r: v["tensor"] for r, v in locals_.items()} if single and isinstance(locals_, dict)
           else locals_)
    out = attempt(lambda: R.execute_local(p, arg))
    if out is REFUSED:
        assert mutation not in ("none", "noncontig", "extra_rank"), (src, dst, mutation)
        _count("plan calls", "refused")
        return
    for n in names:
        d = dsts[n]
        g = globals_[n].to(getattr(torch, d.dtype))
        for r in d.ranks:
            got = out[r] if single else out[r][n]
            expected = d.shard(g, r)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (n, r, how)
    _count("plan calls", "exact")


# -- 4. the executor's validation (local_problem), run for real on thread ranks -------------
GOOD = ("none", "noncontig_dst", "fused_dst", "extra_src", "padded_view")
BAD = ("missing_src", "missing_dst", "shape_src", "shape_dst", "dtype_src", "dtype_dst",
       "list_dst", "alias_dst", "overlap_dst", "expanded_dst", "grad_dst", "meta_src",
       "numpy_src", "none_dst", "interleaved_overlap")


FUSED = ("fused_dst", "alias_dst", "overlap_dst", "interleaved_overlap")


@st.composite
def validation_cases(draw):
    mutation = draw(st.sampled_from(GOOD * 3 + BAD))
    fused = mutation in FUSED
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=2 if fused else 1, max_size=2)))
    if fused:
        shape = (shape[0], max(shape[1], 2))
    nsrc = 2 if fused else draw(st.integers(1, 2))
    src = draw(valid_layouts(shape, 0))
    dst_first = draw(st.sampled_from([0, len(src.ranks)]))
    dst = draw(valid_layouts(shape, dst_first))
    if fused and draw(st.booleans()):
        dst = R.Layout(shape, R.Mesh([dst_first]), [R.Replicate()])  # whole 2-d locals
    src2 = draw(valid_layouts(shape, 0)) if nsrc == 2 else None
    dst2 = (dst if fused else draw(valid_layouts(shape, dst_first))) if nsrc == 2 else None
    method = draw(st.sampled_from(["p2p", "reshard"]))
    budget = draw(st.sampled_from([1024, 1 << 20]))
    return src, dst, src2, dst2, mutation, method, budget


def _dst_tensors(p: R.Plan, rank: int, mutation: str, victim: str) -> dict[str, Any]:
    dst: dict[str, Any] = {}
    fused = mutation in ("fused_dst", "alias_dst", "overlap_dst", "interleaved_overlap")
    mine = [t for t in p.tensors if rank in t.dst.rank_set]
    if fused and mine:  # every destination tensor a view into one flat buffer
        sizes = [prod(t.dst.local_shape(rank)) for t in mine]
        buf = torch.full((sum(sizes) + 8,), -7, dtype=getattr(torch, mine[0].dst.dtype))
        pos = 0
        for t, n in zip(mine, sizes):
            start = pos
            if mutation == "alias_dst" and t.name == victim and len(mine) > 1:
                start = 0
            if mutation == "overlap_dst" and t.name == victim and len(mine) > 1 and pos:
                start = pos - 1
            dst[t.name] = buf[start:start + n].view(t.dst.local_shape(rank))
            pos += n
        if mutation == "interleaved_overlap" and len(mine) > 1:
            shp = [t.dst.local_shape(rank) for t in mine]
            if all(len(s) == 2 and s == shp[0] and s[1] >= 2 for s in shp):
                rows, cols = shp[0]
                big = torch.full((rows, cols * len(mine)), -7.0,
                                 dtype=getattr(torch, mine[0].dst.dtype))
                for j, t in enumerate(mine):  # column blocks; the victim's shifted by one
                    lo = j * cols - (1 if t.name == victim and j else 0)
                    dst[t.name] = big[:, lo:lo + cols]
        return dst
    for t in mine:
        shape = t.dst.local_shape(rank)
        dtype = getattr(torch, t.dst.dtype)
        if mutation == "noncontig_dst" and len(shape) >= 2:
            dst[t.name] = torch.full(shape[::-1], -7, dtype=dtype).transpose(0, 1)
        elif mutation == "padded_view":
            dst[t.name] = torch.full(tuple(n + 2 for n in shape), -7, dtype=dtype)[
                tuple(slice(1, 1 + n) for n in shape)]
        else:
            dst[t.name] = torch.full(shape, -7, dtype=dtype)
    return dst


def _mutate(src: dict, dst: dict, mutation: str, victim: str) -> None:
    if mutation == "missing_src":
        src.pop(victim, None)
    elif mutation == "missing_dst":
        dst.pop(victim, None)
    elif mutation == "shape_src" and victim in src:
        src[victim] = torch.zeros(tuple(src[victim].shape) + (1,))
    elif mutation == "shape_dst" and victim in dst:
        dst[victim] = torch.zeros(tuple(n + 1 for n in dst[victim].shape))
    elif mutation == "dtype_src" and victim in src:
        src[victim] = src[victim].to(torch.float64)
    elif mutation == "dtype_dst" and victim in dst:
        dst[victim] = torch.zeros(dst[victim].shape, dtype=torch.int32)
    elif mutation == "list_dst" and victim in dst:
        dst[victim] = dst[victim].tolist()
    elif mutation == "none_dst" and victim in dst:
        dst[victim] = None
    elif mutation == "expanded_dst" and victim in dst and dst[victim].numel() > 1:
        shape = dst[victim].shape
        dst[victim] = torch.zeros(1).expand(*shape) if shape else dst[victim]
    elif mutation == "grad_dst" and victim in dst:
        dst[victim] = torch.zeros(dst[victim].shape, requires_grad=True)
    elif mutation == "meta_src" and victim in src:
        src[victim] = torch.empty(src[victim].shape, device="meta")
    elif mutation == "numpy_src" and victim in src:
        src[victim] = src[victim].numpy()
    elif mutation == "extra_src":
        src["unplanned"] = torch.zeros(3)


@settings(max_examples=450, **SETTINGS)
@given(case=validation_cases(), data=st.data())
def test_fuzz_executor_validation(case, data):
    src_l, dst_l, src2, dst2, mutation, method, budget = case
    srcs = {"w": src_l, **({"v": src2} if src2 is not None else {})}
    dsts = {"w": dst_l, **({"v": dst2} if dst2 is not None else {})}
    p = R.plan(srcs, dsts)
    ranks = sorted(set(p.ranks()[0]) | set(p.ranks()[1]))
    size = max(ranks) + 1
    globals_ = {n: _global(srcs[n].shape, "float32") for n in srcs}
    victim = data.draw(st.sampled_from(sorted(srcs)))
    side = srcs if mutation.endswith("_src") else dsts  # mutate a rank that holds the victim
    bad_rank = data.draw(st.sampled_from(sorted(side[victim].ranks)))
    tensors = {}
    for r in range(size):
        src = {n: srcs[n].shard(globals_[n], r) for n in srcs if r in srcs[n].rank_set}
        dst = _dst_tensors(p, r, mutation if r == bad_rank else "none", victim)
        if r == bad_rank:
            _mutate(src, dst, mutation, victim)
        tensors[r] = (src, dst)
    problems = {}
    for r in range(size):
        problem = local_problem(p, r, *tensors[r])  # never raises: a sentence or None
        assert problem is None or isinstance(problem, str)
        if problem:
            problems[r] = problem
    before = {r: {n: t.clone() for n, t in tensors[r][1].items() if isinstance(t, torch.Tensor)
                  and not t.is_meta} for r in range(size)}

    def rank_fn(comm):
        return Executor(p, comm, method=method, budget_bytes=budget).run(*tensors[comm.rank])

    results = run_ranks(size, rank_fn)
    for ok, value in results:
        if not ok and not isinstance(value, R.ReshardError):
            raise value
    if problems:
        assert all(not ok and isinstance(v, R.TensorMismatchError) for ok, v in results)
        for r in range(size):  # refused: no byte moved anywhere
            for n, t in before[r].items():
                assert torch.equal(tensors[r][1][n], t), (r, n)
        _count("executor validation", "refused")
        _count(f"  validation/{mutation}", "refused")
        return
    assert all(ok for ok, _ in results), results
    for n, d in dsts.items():
        for r in d.ranks:
            got = tensors[r][1][n]
            assert torch.equal(got, d.shard(globals_[n], r)), (n, r, mutation)
    _count("executor validation", "exact")
    _count(f"  validation/{mutation}", "exact")


def test_fuzz_case_count():
    """Enough cases ran, and both outcomes occurred for every kind of call (when the
    whole module runs; the counts are printed at the end of the module)."""
    kinds = {k: c for k, c in COUNTS.items() if not k.startswith(" ")}
    if len(kinds) == 4:
        assert sum(c["cases"] for c in kinds.values()) >= 5000, kinds
        assert all(c["refused"] and c["exact"] for c in kinds.values()), kinds
