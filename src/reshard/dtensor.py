"""The one-call collective: :func:`redistribute` moves a DTensor (or a ``{name: DTensor}``
model) onto another device mesh and placements, as ``DTensor.redistribute`` does inside
one mesh but across meshes too (disjoint, overlapping or identical).

Every rank of ``group`` calls it with the same arguments; ranks outside a mesh pass the
DTensor they hold there (an empty local tensor, as ``distribute_tensor`` gives them) and
get back, as DTensor does, a DTensor whose local tensor is empty. The plan, its schedule
and the topology are kept per (layouts, method, budget, group): a repeated call costs one
small agreement collective and the transfer, as a reused :class:`reshard.Executor` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import _StridedShard

from reshard.comm import Comm
from reshard.defaults import DEFAULT_BUDGET_BYTES
from reshard.errors import (
    FingerprintMismatchError,
    LayoutError,
    ReshardError,
    TensorMismatchError,
    error_class,
)
from reshard.executor import Executor, local_problem
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.placement import Replicate, Shard, StridedShard, as_placement
from reshard.planner import SINGLE_NAME, Plan, plan

__all__ = ["cache_size", "clear_cache", "plan_of", "redistribute", "torch_placements"]

#: Executors kept for repeated calls, least recently used dropped first.
MAX_CACHED_EXECUTORS = 32
_executors: OrderedDict[tuple, Executor] = OrderedDict()
#: Layouts kept for repeated calls (cleared whole when full).
MAX_KEPT_LAYOUTS = 4096
_layouts: dict[tuple, tuple[Any, Layout]] = {}
_specs: dict[tuple, tuple[Any, Any]] = {}  # destination DTensor specs, kept alike


def redistribute(dtensor: Any, device_mesh: Any = None, placements: Any = None, *,
                 group: Any = None, dtype: torch.dtype | None = None, method: str = "reshard",
                 out: Any = None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Any:
    """``dtensor`` on ``device_mesh`` with ``placements``; collective over ``group``.

    ``dtensor``: a DTensor, or ``{name: DTensor}`` (one plan and one schedule for all;
    then ``device_mesh`` and ``placements`` may be one value for every tensor or a
    mapping by name). ``group``: a process group holding every rank of both meshes (the
    world by default). ``dtype``: cast while sending. ``out``: destination DTensor(s)
    to write in place and return (``device_mesh`` / ``placements`` default to theirs).
    ``method``, ``budget_bytes``: as for :class:`reshard.Executor`.

    Bad input (shapes, placements, meshes the group does not hold, tensors that do not
    match, ranks that disagree) raises the same :class:`reshard.ReshardError` on every
    rank before any byte moves.
    """
    single = not isinstance(dtensor, Mapping)
    comm = _comm(group)
    request: _Request | None = None
    executor: Executor | None = None
    try:
        request = _Request(dtensor, device_mesh, placements, out, dtype, comm, group)
        key = (request.key, method, budget_bytes, group)
        executor = _executors.get(key)
        the_plan = executor.plan if executor is not None else plan(
            request.src_layouts, request.dst_layouts, allow_cast=True)
        problem = local_problem(the_plan, comm.rank, request.src_locals,
                                request.dst_locals, backend=comm.backend)
        problem = problem and ("TensorMismatchError", problem)
        agreed = f"{the_plan.fingerprint()}/{method}/{budget_bytes}"
    except Exception as e:  # refused on every rank below, before any byte moves
        problem, agreed = (type(e).__name__, _sentence(e)), None
    views = comm.all_gather_object((comm.rank, problem, agreed, executor is not None))
    _raise_if_refused(views)
    assert request is not None
    if not all(hit for *_, hit in views):
        executor = Executor(the_plan, comm, method=method, budget_bytes=budget_bytes)
        _remember(key, executor)
    else:
        _executors.move_to_end(key)
    executor.run(request.src_locals, request.dst_locals, check=False)
    results = request.results()
    return results[SINGLE_NAME] if single else results


def clear_cache() -> None:
    """Drop every kept plan, schedule, executor (their staging memory with them) and
    layout."""
    _executors.clear()
    _layouts.clear()
    _specs.clear()


def cache_size() -> int:
    """How many executors :func:`redistribute` keeps for repeated calls."""
    return len(_executors)


def _remember(key: tuple, executor: Executor) -> None:
    _executors[key] = executor
    while len(_executors) > MAX_CACHED_EXECUTORS:
        _executors.popitem(last=False)


def _sentence(error: Exception) -> str:
    if isinstance(error, ReshardError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _raise_if_refused(views: list[tuple[int, tuple[str, str] | None, str | None, bool]]
                      ) -> None:
    """The first rank's problem, raised as the same error class on every rank."""
    problems = [(r, p) for r, p, _, _ in views if p]
    if problems:
        rank, (kind, problem) = problems[0]
        more = f" (and {len(problems) - 1} more ranks)" if len(problems) > 1 else ""
        raise error_class(kind, TensorMismatchError)(
            f"redistribute refused: rank {rank}: {problem}{more}; nothing was moved")
    agreed = {a for _, _, a, _ in views}
    if len(agreed) > 1:
        who = {a: [r for r, _, b, _ in views if b == a] for a in agreed}
        raise FingerprintMismatchError(
            "redistribute refused: the ranks were called with different tensors, meshes, "
            f"placements or options (plan/method/budget -> ranks: {who}); nothing was moved")


def _comm(group: Any) -> Comm:
    if not dist.is_initialized():
        raise ReshardError("redistribute is a collective: initialise torch.distributed "
                           "first (init_process_group)")
    return Comm.from_group(group)


class _Request:
    """One call's tensors, by name: layouts in group ranks, local sources and targets."""

    def __init__(self, dtensor: Any, device_mesh: Any, placements: Any, out: Any,
                 dtype: torch.dtype | None, comm: Comm, group: Any) -> None:
        sources = dict(dtensor) if isinstance(dtensor, Mapping) else {SINGLE_NAME: dtensor}
        outs = _by_name(out, sources, "out") if out is not None else {}
        to_group = _group_ranks(group)
        self.rank, self.outs = comm.rank, outs
        self.src_layouts: dict[str, Layout] = {}
        self.dst_layouts: dict[str, Layout] = {}
        self.src_locals: dict[str, torch.Tensor] = {}
        self.dst_locals: dict[str, torch.Tensor] = {}
        self.targets: dict[str, tuple[Any, tuple[Any, ...]]] = {}
        for name, src in sources.items():
            self._add(name, src, outs.get(name), device_mesh, placements, dtype, to_group)
        self.key = tuple((n, self.src_layouts[n], self.dst_layouts[n]) for n in sources)

    def _add(self, name: str, src: Any, out: Any, device_mesh: Any, placements: Any,
             dtype: torch.dtype | None, to_group: dict[int, int] | None) -> None:
        _check_dtensor(name, src, "source")
        if out is not None:
            _check_dtensor(name, out, "out")
        mesh = _pick(name, device_mesh, "device_mesh", out.device_mesh if out is not None
                     else None)
        wanted = _pick(name, placements, "placements", out.placements if out is not None
                       else None)
        shape = tuple(src.shape)
        places = _normalised(wanted, len(shape), mesh.ndim, name)
        to = dtype if dtype is not None else (out.dtype if out is not None else src.dtype)
        src_layout = _layout(shape, src.device_mesh, src.placements, src.dtype, to_group)
        dst_layout = _layout(shape, mesh, places, to, to_group)
        if out is not None:
            _check_out(name, out, shape, to, mesh, places)
        self.src_layouts[name], self.dst_layouts[name] = src_layout, dst_layout
        if self.rank in src_layout.rank_set:
            self.src_locals[name] = src.to_local()
        member = self.rank in dst_layout.rank_set
        if out is not None:
            local = out.to_local()
        else:
            local = torch.empty(dst_layout.local_shape(self.rank) if member else (0,),
                                dtype=to, device=_device(mesh, src))
        if member:
            self.dst_locals[name] = local
        self.targets[name] = (mesh, places, local, shape)

    def results(self) -> dict[str, Any]:
        """The destination DTensors (``out`` itself where given)."""
        done = {}
        for name, (mesh, places, local, shape) in self.targets.items():
            if name in self.outs:
                done[name] = self.outs[name]
                continue
            done[name] = _wrap(local, mesh, places, shape)
        return done


def _wrap(local: torch.Tensor, mesh: Any, places: tuple[Any, ...],
          shape: tuple[int, ...]) -> DTensor:
    """A DTensor over ``local``, as ``DTensor.from_local(..., shape=, stride=)`` makes it,
    with its spec kept per (mesh, placements, shape, dtype): ``from_local`` costs about
    half a millisecond a tensor, more than the rest of a repeated call. (It also reads an
    empty shape as "not given", which a scalar's empty non-member local would break.)"""
    key = (id(mesh), places, shape, local.dtype)
    kept = _specs.get(key)
    if kept is None or kept[0] is not mesh:
        if len(_specs) >= MAX_KEPT_LAYOUTS:
            _specs.clear()
        kept = _specs[key] = (mesh, _spec(mesh, places, shape, local.dtype))
    return DTensor(local, kept[1], requires_grad=False)


def _spec(mesh: Any, places: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype
          ) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), _contiguous_strides(shape), dtype)
    return DTensorSpec(mesh, tuple(torch_placements(places)), tensor_meta=meta)


def _by_name(value: Any, sources: Mapping[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        if len(sources) != 1:
            raise TensorMismatchError(f"{what}: expected a mapping name -> DTensor for a "
                                      f"{{name: DTensor}} call, got {type(value).__name__}")
        return {next(iter(sources)): value}
    names = set(sources)
    if set(value) != names:
        raise TensorMismatchError(f"{what} names {sorted(set(value) ^ names)[:5]} that "
                                  "the source does not, or the other way round")
    return dict(value)


def _pick(name: str, value: Any, what: str, default: Any) -> Any:
    """One value for every tensor, or a mapping by name; ``default`` (from ``out``)."""
    if isinstance(value, Mapping):
        value = value.get(name)
    if value is None:
        value = default
    if value is None:
        raise LayoutError(f"tensor {name!r}: no destination {what} given (pass {what}= or "
                          "out=)")
    return value


def _check_dtensor(name: str, value: Any, what: str) -> None:
    if not isinstance(value, DTensor):
        raise TensorMismatchError(f"tensor {name!r}: the {what} is a {type(value).__name__},"
                                  " expected a DTensor")


def _normalised(placements: Any, ndim: int, mesh_ndim: int, name: str) -> tuple[Any, ...]:
    """reshard's placements, dims made non-negative; checked against the mesh."""
    if isinstance(placements, list | tuple):
        try:
            return _normalised_kept(tuple(placements), ndim, mesh_ndim, name)
        except TypeError:  # an unhashable placement: checked below, uncached
            pass
    return _normalised_new(placements, ndim, mesh_ndim, name)


@lru_cache(maxsize=1024)
def _normalised_kept(placements: tuple[Any, ...], ndim: int, mesh_ndim: int,
                     name: str) -> tuple[Any, ...]:
    return _normalised_new(placements, ndim, mesh_ndim, name)


def _normalised_new(placements: Any, ndim: int, mesh_ndim: int, name: str
                    ) -> tuple[Any, ...]:
    if isinstance(placements, str) or not isinstance(placements, Sequence):
        raise LayoutError(f"tensor {name!r}: expected a sequence of placements, got "
                          f"{placements!r}")
    if len(placements) != mesh_ndim:
        raise LayoutError(f"tensor {name!r}: expected {mesh_ndim} placements (one per mesh "
                          f"dim), got {len(placements)}: {list(placements)}")
    out = []
    for p in placements:
        dim = getattr(p, "dim", None)
        if isinstance(dim, int) and -ndim <= dim < 0:  # DTensor's Shard(-1)
            p = (_StridedShard(dim + ndim, split_factor=p.split_factor)
                 if type(p).__name__ == "_StridedShard" else TorchShard(dim + ndim))
        out.append(as_placement(p))
    return tuple(out)


def torch_placements(placements: Sequence[Any]) -> list[Any]:
    """PyTorch's placements for reshard's (or PyTorch's, or strings like ``"S(0)"``)."""
    return [_to_torch(as_placement(p)) for p in placements]


def _to_torch(p: Any) -> Any:
    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    if isinstance(p, Shard):
        return TorchShard(p.dim)
    assert isinstance(p, Replicate)
    return TorchReplicate()


def _group_ranks(group: Any) -> dict[int, int] | None:
    """Global rank -> group rank, or None for the world (the identity)."""
    if group is None or group is dist.group.WORLD:
        return None
    return {g: i for i, g in enumerate(dist.get_process_group_ranks(group))}


def _layout(shape: tuple[int, ...], device_mesh: Any, placements: Any, dtype: Any,
            to_group: dict[int, int] | None) -> Layout:
    """The layout in group ranks, kept per (mesh object, group, shape, placements, dtype):
    reading a DeviceMesh's ranks costs far more than a repeated call may."""
    key = (id(device_mesh), None if to_group is None else tuple(to_group), shape,
           tuple(placements), dtype)
    kept = _layouts.get(key)
    if kept is not None and kept[0] is device_mesh:
        return kept[1]
    layout = _new_layout(shape, device_mesh, placements, dtype, to_group)
    if len(_layouts) >= MAX_KEPT_LAYOUTS:
        _layouts.clear()
    _layouts[key] = (device_mesh, layout)  # the mesh kept alive: its id stays its own
    return layout


def _new_layout(shape: tuple[int, ...], device_mesh: Any, placements: Any, dtype: Any,
                to_group: dict[int, int] | None) -> Layout:
    ranks = device_mesh.mesh.tolist()
    if to_group is not None:
        ranks = _in_group(ranks, to_group)
    return Layout(shape, Mesh(ranks, getattr(device_mesh, "mesh_dim_names", None)),
                  placements, dtype)


def _in_group(ranks: Any, to_group: dict[int, int]) -> Any:
    if isinstance(ranks, list):
        return [_in_group(r, to_group) for r in ranks]
    if ranks not in to_group:
        raise LayoutError(f"mesh rank {ranks} is not in the group (its ranks: "
                          f"{sorted(to_group)}); pass a group that holds both meshes")
    return to_group[ranks]


def _check_out(name: str, out: Any, shape: tuple[int, ...], dtype: torch.dtype, mesh: Any,
               places: tuple[Any, ...]) -> None:
    theirs = _normalised(out.placements, len(shape), mesh.ndim, name)
    if tuple(out.shape) != shape:
        raise TensorMismatchError(f"tensor {name!r}: out has shape {list(out.shape)}, the "
                                  f"source {list(shape)}")
    if out.dtype != dtype:
        raise TensorMismatchError(f"tensor {name!r}: out has dtype {out.dtype}, expected "
                                  f"{dtype}")
    if (out.device_mesh is not mesh and out.device_mesh != mesh) or theirs != places:
        raise TensorMismatchError(
            f"tensor {name!r}: out lies on {Mesh.from_device_mesh(out.device_mesh)} with "
            f"{[str(p) for p in theirs]}, the call asks for "
            f"{Mesh.from_device_mesh(mesh)} with {[str(p) for p in places]}")


def _device(device_mesh: Any, src: Any) -> torch.device:
    local = src.to_local()
    if local.device.type == device_mesh.device_type:
        return local.device
    if device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_mesh.device_type)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def plan_of(dtensor: Any, device_mesh: Any, placements: Any) -> Plan:
    """The plan :func:`redistribute` would run for one DTensor (no communication; for
    inspection: ``print(plan_of(dt, mesh, [Shard(0)]))``)."""
    shape = tuple(dtensor.shape)
    places = _normalised(placements, len(shape), device_mesh.ndim, SINGLE_NAME)
    return plan(_layout(shape, dtensor.device_mesh, dtensor.placements, dtensor.dtype, None),
                _layout(shape, device_mesh, places, dtensor.dtype, None))
