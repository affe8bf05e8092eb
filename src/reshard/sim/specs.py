"""Readable parallelism specs (``tp4``, ``fsdp8``, ``tp2,dp2``, ``pp2,tp2``, ``pp4,ep8,tp2``)
turned into one :class:`Layout` per named weight of a model.

Mesh axes are ordered outermost first: pp, dp, fsdp, ep, tp (whatever order the spec is
written in). Tensor parallelism follows Megatron / vLLM: column-parallel weights
(q/k/v, gate/up, MLA q_b/kv_b, embeddings, lm_head) shard their output dim, row-parallel
ones (o_proj, down_proj) their input dim, norms and routers are replicated. FSDP shards
dim 0 on top (a strided shard when tensor parallelism already split dim 0, as FSDP2
does). Pipeline stages take contiguous layers; routed experts live on one EP group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from reshard.errors import LayoutError
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.placement import Placement, Replicate, Shard, StridedShard, chunk_bounds

__all__ = ["ParallelSpec", "model_layouts", "tensor_parallel_dim"]

AXES = ("pp", "dp", "fsdp", "ep", "tp")
_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|q_b_proj|kv_b_proj|"
                     r"embed_tokens|lm_head|w1|w3)\.(weight|bias)$")
_ROW = re.compile(r"(o_proj|down_proj|w2)\.weight$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class ParallelSpec:
    """Sizes of the parallel axes; absent axes have size 1."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    tp: int = 1

    @classmethod
    def parse(cls, text: str) -> ParallelSpec:
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.lower().split(","))):
            m = re.fullmatch(r"([a-z]+)(\d+)", part)
            if not m or m.group(1) not in AXES or int(m.group(2)) < 1:
                raise LayoutError(f"bad parallel spec {text!r}: expected parts like 'tp4' with "
                                  f"an axis in {AXES} and a size >= 1, got {part!r}")
            if m.group(1) in sizes:
                raise LayoutError(f"bad parallel spec {text!r}: axis {m.group(1)} given twice")
            sizes[m.group(1)] = int(m.group(2))
        if not sizes:
            raise LayoutError(f"empty parallel spec {text!r}")
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        return prod(self.sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def __str__(self) -> str:
        return ",".join(f"{a}{n}" for a, n in zip(AXES, self.sizes) if n > 1) or "dp1"


def tensor_parallel_dim(name: str, ndim: int) -> int | None:
    """The dim tensor parallelism shards for a weight name, or None (replicated)."""
    if _COLUMN.search(name) and ndim >= 1:
        return 0
    if _ROW.search(name) and ndim >= 2:
        return 1
    return None


@lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], dtype: str, mesh: Mesh, placements: tuple) -> Layout:
    return Layout(shape, mesh, placements, dtype)


def _placements(name: str, shape: Sequence[int], spec: ParallelSpec,
                expert: bool) -> tuple[Placement, ...]:
    """Placements over the axes (dp, fsdp, ep, tp) of one stage, in that order."""
    tp_dim = tensor_parallel_dim(name, len(shape))
    tp: Placement = Shard(tp_dim) if tp_dim is not None and spec.tp > 1 else Replicate()
    if not shape or spec.fsdp == 1:
        fsdp: Placement = Replicate()
    elif tp_dim == 0 and spec.tp > 1:
        fsdp = StridedShard(0, spec.tp)
    else:
        fsdp = Shard(0)
    axes = (Replicate(), fsdp, tp) if expert else (Replicate(), fsdp, Replicate(), tp)
    return axes


def model_layouts(tensors: Sequence, spec: ParallelSpec | str, *, first_rank: int = 0,
                  dtype: str | None = None) -> dict[str, Layout]:
    """One layout per tensor (objects with ``name``, ``shape``, ``dtype``) for ``spec``."""
    spec = ParallelSpec.parse(spec) if isinstance(spec, str) else spec
    grid = Mesh.from_shape(spec.sizes, start=first_rank, dim_names=AXES)
    num_layers = 1 + max((int(m.group(1)) for t in tensors if (m := _LAYER.search(t.name))),
                         default=-1)
    num_experts = 1 + max((int(m.group(1)) for t in tensors if (m := _EXPERT.search(t.name))),
                          default=-1)
    if num_experts and num_experts % spec.ep:
        raise LayoutError(f"{num_experts} experts cannot be split evenly over ep={spec.ep}")
    out = {}
    for t in tensors:
        stage = _stage(t.name, num_layers, spec.pp)
        m = _EXPERT.search(t.name)
        ep_rank = int(m.group(1)) // (num_experts // spec.ep) if m else None
        mesh = _submesh(grid, spec, stage, ep_rank)
        places = _placements(t.name, t.shape, spec, m is not None)
        out[t.name] = _layout(tuple(t.shape), dtype or t.dtype, mesh, places)
    return out


def _stage(name: str, num_layers: int, pp: int) -> int:
    m = _LAYER.search(name)
    if m:
        layer = int(m.group(1))
        return next(s for s in range(pp) if layer < chunk_bounds(num_layers, pp, s)[1])
    return 0 if "embed_tokens" in name else pp - 1


@lru_cache(maxsize=4096)
def _submesh(grid: Mesh, spec: ParallelSpec, stage: int, ep_rank: int | None) -> Mesh:
    """The ranks of one pipeline stage as a (dp, fsdp, ep, tp) mesh, or, for an expert,
    the (dp, fsdp, tp) mesh of its EP group."""
    per_stage = prod(spec.sizes[1:])
    ranks = grid.ranks[stage * per_stage:(stage + 1) * per_stage]
    dp, fsdp, ep, tp = spec.sizes[1:]
    if ep_rank is None:
        return Mesh(_nest(ranks, (dp, fsdp, ep, tp)), ("dp", "fsdp", "ep", "tp"))
    picked = [r for i, r in enumerate(ranks) if (i // tp) % ep == ep_rank]
    return Mesh(_nest(picked, (dp, fsdp, tp)), ("dp", "fsdp", "tp"))


def _nest(flat: Sequence[int], shape: Sequence[int]) -> list:
    out: list = list(flat)
    for size in reversed(shape[1:]):
        out = [out[i:i + size] for i in range(0, len(out), size)]
    return out
