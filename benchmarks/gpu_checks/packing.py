"""Probe: packing speed. One rank's regions of a model-shaped state (Qwen3-8B, tp4 ->
tp2,dp2, bf16 by default; as many decoder layers as ``--max-gib`` allows) copied into
the staging arena (pack, on the first source rank) and out of it (unpack, on the first
destination rank) by the executor's own staging code, in GB/s; the report gives each as
a fraction of the device's copy bandwidth measured in the same run (goal: 80 %). Every
region is copied, also those the executor would send without packing."""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass
from math import prod
from typing import Any

import reshard as R
from reshard.schedule import Schedule, flat_schedule
from reshard.sim.models import PRESETS, model_from_config
from reshard.sim.specs import ParallelSpec, model_layouts

from .results import ERROR, FAIL, PASS, SKIPPED, PackingResult, one_line
from .staging import copy_all, make_stager, verify_copies
from .synthetic import plan_dtypes, rank_tensors
from .timing import free_memory, peak_memory, reset_peak, time_median

PACKING_GOAL = 0.8  # of the device's copy bandwidth


@dataclass(frozen=True)
class Workload:
    """A kind of region to pack: the weights it takes (a regex over their names)."""

    name: str
    pattern: str
    what: str

    def tensors(self, model) -> list:
        return [t for t in model.tensors if re.search(self.pattern, t.name)]


WORKLOADS = (
    Workload("row_parallel", r"\.(o_proj|down_proj)\.weight$",
             "row-parallel o_proj/down_proj: strided column blocks on the receiving side"),
    Workload("column_parallel",
             r"\.(gate_proj|up_proj)\.weight$|^(model\.embed_tokens|lm_head)\.weight$",
             "gate/up, embeddings, lm_head: contiguous row blocks"),
    Workload("qkv_norms", r"\.(q_proj|k_proj|v_proj)\.weight$|norm\.weight$",
             "q/k/v (vLLM's fused QKV group) and every norm: many small pieces"),
)


@dataclass(frozen=True)
class PackingSetup:
    """What every packing workload shares."""

    model: str
    src: str
    dst: str
    budget_bytes: int
    max_bytes: int
    packer: str

    @property
    def ranks(self) -> tuple[int, int]:
        """(the first source rank, which packs; the first destination rank, which unpacks)"""
        return 0, ParallelSpec.parse(self.src).world_size

    @property
    def total_layers(self) -> int:
        return int(PRESETS[self.model]["num_hidden_layers"])

    def layouts(self, workload: Workload, layers: int):
        """Source and destination layouts of ``workload``'s weights, first ``layers``
        decoder layers only."""
        model = model_from_config({**PRESETS[self.model], "num_hidden_layers": layers},
                                  name=self.model)
        tensors = workload.tensors(model)
        return (model_layouts(tensors, self.src),
                model_layouts(tensors, self.dst, first_rank=self.ranks[1]))

    def memory_needed(self, workload: Workload, layers: int) -> int:
        """Device bytes of the packing rank's and the unpacking rank's tensors, plus two
        arenas of the staging budget."""
        src, dst = self.layouts(workload, layers)
        return (rank_bytes(src, self.ranks[0]) + rank_bytes(dst, self.ranks[1])
                + 2 * self.budget_bytes)

    def fit_layers(self, workload: Workload) -> int:
        """The most decoder layers that fit in ``max_bytes`` (0: not even one)."""
        return next((n for n in range(self.total_layers, 0, -1)
                     if self.memory_needed(workload, n) <= self.max_bytes), 0)


def rank_bytes(layouts: dict, rank: int) -> int:
    """Bytes of ``rank``'s local tensors under ``layouts``."""
    return sum(prod(lay.local_shape(rank)) * lay.itemsize for lay in layouts.values()
               if rank in lay.rank_set)


def measure_side(plan, schedule: Schedule, side: str, rank: int, *, device: str,
                 repeats: int, packer: str) -> dict[str, Any]:
    """Check one rank's copies between its tensors and its arena once, then time them."""
    reset_peak(device)
    stager = make_stager(packer, schedule, rank, plan_dtypes(plan), device)
    tensors = rank_tensors(plan, rank, side, device)
    src, dst = (tensors, {}) if side == "pack" else ({}, tensors)
    rounds = stager.messages(side)
    verified = verify_copies(stager, side, rounds, src, dst)
    seconds = time_median(lambda: copy_all(stager, side, rounds, src, dst), device, repeats)
    hops = [h for msgs in rounds for _, _, hs, _ in msgs for h in hs]
    return {"status": PASS if verified else FAIL, "num_regions": len(hops),
            "nbytes": sum(h.nbytes for h in hops), "seconds": seconds,
            "packer": stager.name, "peak_bytes": peak_memory(device),
            "detail": "" if verified else "a region's bytes differ from the arena's"}


def measure_workload(setup: PackingSetup, workload: Workload, layers: int, device: str,
                     repeats: int) -> list[PackingResult]:
    """Pack on the first source rank and unpack on the first destination rank."""
    plan = R.plan(*setup.layouts(workload, layers))
    schedule = flat_schedule(plan, setup.budget_bytes)
    label = f"{layers}/{setup.total_layers}"
    out = []
    for side, rank in zip(("pack", "unpack"), setup.ranks):
        try:
            got = measure_side(plan, schedule, side, rank, device=device, repeats=repeats,
                               packer=setup.packer)
            out.append(PackingResult(workload.name, side, rank, label, **got))
        except Exception as e:  # out of memory, say: the other workloads still run
            out.append(PackingResult(workload.name, side, rank, label, ERROR,
                                     detail=one_line(e)))
        free_memory(device)
    return out


def measure_packing(args: argparse.Namespace) -> tuple[dict[str, Any], list[PackingResult]]:
    """Every workload, as many layers as fit in ``--max-gib``."""
    setup = PackingSetup(args.model, args.src, args.dst, args.budget_mib << 20,
                         int(args.max_gib * (1 << 30)), args.packer)
    out: list[PackingResult] = []
    full = model_from_config(PRESETS[setup.model])
    for workload in WORKLOADS:
        layers = setup.fit_layers(workload) if workload.tensors(full) else 0
        if layers == 0:
            why = (f"one layer needs more than --max-gib {args.max_gib}"
                   if workload.tensors(full) else "no weight of this model matches")
            out += [PackingResult(workload.name, side, rank, f"0/{setup.total_layers}",
                                  SKIPPED, detail=why)
                    for side, rank in zip(("pack", "unpack"), setup.ranks)]
        else:
            out += measure_workload(setup, workload, layers, args.device, args.repeats)
    info = {**asdict(setup), "total_layers": setup.total_layers,
            "dtype": full.tensors[0].dtype,
            "schedule": "flat (p2p)", "ranks": {"pack": setup.ranks[0],
                                                "unpack": setup.ranks[1]},
            "workloads": {w.name: w.what for w in WORKLOADS}}
    return info, out
