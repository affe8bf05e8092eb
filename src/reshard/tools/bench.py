"""``reshard bench``: move a synthetic transformer-shaped state between two layouts with
every method, on local gloo processes, verify every destination bit for bit, and time it
against the floor (a bare exchange of the same bytes between the same rank pairs).

``dst_dtype="float8_e4m3fn"``: the destination is an FP8 block engine (its linears in
FP8 with float32 scales): the source ranks quantize their own shards first (one
``all_reduce(MAX)`` of the blocks split across them, timed apart), and the methods move
FP8 codes and scales; every destination is checked against the reference quantizer."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard import planner
from reshard.defaults import DEFAULT_BUDGET_BYTES, METHODS
from reshard.executor import Executor
from reshard.layout import Layout
from reshard.mesh import Mesh
from reshard.placement import Replicate
from reshard.quant import quantize_reference
from reshard.quant.blocks import BlockFormat
from reshard.quant.targets import FP8, fp8_engine_layouts, plan_fp8_refit, scale_name
from reshard.refit.amax import quantize_for_refit
from reshard.schedule import flat_schedule
from reshard.sim.models import synthetic_model
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.launch import run_processes
from reshard.tools.synthetic import fill_local, matches

__all__ = ["BenchConfig", "run_bench"]


@dataclass
class BenchConfig:
    src: str = "tp4"
    dst: str = "tp2,dp2"
    model_bytes: int = 1 << 30
    methods: tuple[str, ...] = METHODS
    repeats: int = 3
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    dtype: str = "float32"
    topology: Any = None
    nodes: int = 0
    """Run on this many emulated nodes (network namespaces, root only); 0: plain local."""
    link_mbit: float = 500.0
    """Rate of each emulated node's link in Mbit/s. Loopback inside a node carried about
    33 Gbit/s between 8 processes on the 2-core development machine: 4000 is about 8x
    below it (the NVLink : InfiniBand ratio), the default 500 about 60x."""
    nic_per_rank: bool = False
    """On emulated nodes, give every rank its own network card of ``link_mbit`` (as a GPU
    node has one NIC per GPU) instead of one link of ``link_mbit`` per node."""
    dst_dtype: str | None = None
    """``"float8_e4m3fn"``: an FP8 block engine (see the module docstring)."""
    extra: dict = field(default_factory=dict)


def build_plan(cfg: BenchConfig):
    plan, world, _ = build_plans(cfg)
    return plan, world


def build_plans(cfg: BenchConfig):
    """(the transfer plan, the world size, the FP8 part or None)."""
    model = synthetic_model(cfg.model_bytes, dtype=cfg.dtype)
    src_spec, dst_spec = ParallelSpec.parse(cfg.src), ParallelSpec.parse(cfg.dst)
    src = model_layouts(model.tensors, src_spec, dtype=cfg.dtype)
    dst = model_layouts(model.tensors, dst_spec, first_rank=src_spec.world_size, dtype=cfg.dtype)
    fp8 = None
    if cfg.dst_dtype == FP8:
        n = src_spec.world_size
        src, fp8 = plan_fp8_refit(src, fp8_engine_layouts(dst), BlockFormat(),
                                  tuple(range(n)), n)
        dst = fp8_engine_layouts(dst)
    return planner.plan(src, dst), src_spec.world_size + dst_spec.world_size, fp8


def _timed(comm_barrier, fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        comm_barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _worker(rank: int, world: int, cfg: BenchConfig) -> dict:
    """One rank: verify every method once, then time them interleaved (floor, each
    method, floor, ...) so that load from the rest of the machine hits all alike, the
    order rotated every repeat so that each also takes every place in it."""
    from reshard.comm import Comm

    plan, _, fp8 = build_plans(cfg)
    comm = Comm.from_group()
    result: dict[str, Any] = {"methods": {}}
    src = _sources(plan, fp8, rank, result, cfg.repeats)
    dst = {t.name: torch.zeros(t.dst.local_shape(rank), dtype=getattr(torch, t.dst.dtype))
           for t in plan.tensors if rank in t.dst.rank_set}
    runs: dict[str, Any] = {"floor": floor_runner(plan, comm)}
    for method in cfg.methods:  # "reshard+sum" / "p2p+crc32": with per-message checksums
        if method == "redistribute":
            continue
        base, _, checksum = method.partition("+")
        ex = Executor(plan, comm, method=base, budget_bytes=cfg.budget_bytes,
                      topology=cfg.topology if base == "reshard" else None,
                      checksum=checksum or False)
        for tensor in dst.values():
            tensor.zero_()
        stats = ex.run(src, dst)  # checked run, then verified bit for bit
        ok = _verified(plan, fp8, rank, dst)
        moved = stats.bytes_received if base == "colocated" else stats.bytes_sent  # pulled
        result["methods"][method] = {"times": [], "sent": moved, "ok": ok,
                                     "staging": stats.peak_staging_bytes}
        runs[method] = lambda ex=ex: ex.run(src, dst, check=False)
    if "redistribute" in cfg.methods:
        _add_redistribute(plan, comm, src, dst, cfg, result, runs)
    if "colocated" in cfg.methods:
        _add_memcpy_floor(plan, comm.rank, result, runs)
    runs["floor"]()
    floor_times: list[float] = []
    order = list(runs.items())
    for i in range(cfg.repeats):  # rotated each repeat: no method always follows the same one
        for name, fn in order[i % len(order):] + order[:i % len(order)]:
            seconds = _timed(comm.barrier, fn, 1)[0]
            (floor_times if name == "floor" else result["methods"][name]["times"]).append(
                seconds)
    result["floor"] = {"times": floor_times}
    return result


def _sources(plan, fp8, rank: int, result: dict, repeats: int) -> dict:
    """This rank's source tensors: synthetic, or for an FP8 engine their FP8 codes and
    scales, quantized ``repeats`` times (timed; the source ranks' amax exchange over a
    group of their own, which every rank creates)."""
    plain = {t.name: fill_local(t.src, rank) for t in plan.tensors
             if rank in t.src.rank_set and (fp8 is None or t.name not in fp8.source_checks())}
    if fp8 is None:
        return plain
    import torch.distributed as dist

    group = dist.new_group(list(fp8.sources))
    given = {n: fill_local(lay, rank) for n, lay in fp8.layouts.items() if rank in lay.rank_set}
    if rank not in fp8.sources:
        return plain

    def reduce(vec):
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)

    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        made = quantize_for_refit(fp8, given, rank, reduce)
        times.append(time.perf_counter() - t0)
    result["quantize"] = {"times": times[1:], "amax_bytes": fp8.plan.exchange_bytes}
    return {**plain, **made}


def _verified(plan, fp8, rank: int, dst: dict) -> bool:
    """Every destination bit for bit: the synthetic values, or for an FP8 engine's
    tensors the reference quantizer's codes and scales of the full synthetic tensor."""
    made = fp8.source_checks() if fp8 is not None else {}
    ok = all(matches(t.dst, rank, dst[t.name]) for t in plan.tensors
             if t.name in dst and t.name not in made)
    for name in (n for n in (fp8.names if fp8 else ()) if n in dst):
        lay = fp8.layouts[name]
        whole = Layout(lay.shape, Mesh([0]), [Replicate()], lay.dtype)
        q, scale = quantize_reference(fill_local(whole, 0), fp8.plan.fmt)
        ok = ok and torch.equal(dst[name].view(torch.uint8),
                                plan[name].dst.shard(q.view(torch.uint8), rank))
        ok = ok and torch.equal(dst[scale_name(name)],
                                plan[scale_name(name)].dst.shard(scale, rank))
    return ok


def _add_redistribute(plan, comm, src, dst, cfg: BenchConfig, result: dict, runs: dict) -> None:
    """The one-call collective on the same plan: the model as ``{name: DTensor}``, the
    destination given as ``out=`` DTensors over the same buffers. Timed calls are repeated
    calls (the plan, schedule and topology come from its cache; the agreement collective
    runs every call, as ``check=True`` does for an executor)."""
    from reshard.dtensor import redistribute

    sources = dtensors_of(plan, comm.rank, src, "src")
    outs = dtensors_of(plan, comm.rank, dst, "dst")
    for tensor in dst.values():
        tensor.zero_()
    redistribute(sources, out=outs, budget_bytes=cfg.budget_bytes)  # plans; verified below
    ok = all(matches(t.dst, comm.rank, dst[t.name]) for t in plan.tensors if t.name in dst)
    # the same plan, method and budget as the `reshard` executor: the same bytes move
    ex = Executor(plan, comm, method="reshard", budget_bytes=cfg.budget_bytes,
                  topology=cfg.topology)
    stats = ex.run(src, dst)
    result["methods"]["redistribute"] = {"times": [], "sent": stats.bytes_sent, "ok": ok,
                                         "staging": stats.peak_staging_bytes}
    runs["redistribute"] = lambda: redistribute(sources, out=outs,
                                                budget_bytes=cfg.budget_bytes)


def dtensors_of(plan, rank: int, locals_: dict, side: str) -> dict:
    """Each tensor of the plan as a DTensor over ``locals_`` (shared memory), on a
    DeviceMesh per distinct rank grid (every rank builds the same ones, in order)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from reshard.dtensor import torch_placements

    meshes: dict[tuple, Any] = {}
    out = {}
    for t in plan.tensors:
        layout = getattr(t, side)
        key = (layout.ranks, layout.mesh.shape)
        if key not in meshes:
            meshes[key] = DeviceMesh("cpu", torch.tensor(layout.ranks).reshape(
                layout.mesh.shape))
        local = locals_.get(t.name, torch.empty(0, dtype=getattr(torch, layout.dtype)))
        stride = torch.empty(layout.shape).stride() if layout.shape else ()
        out[t.name] = DTensor.from_local(local, meshes[key], torch_placements(
            layout.placements), run_check=False, shape=torch.Size(layout.shape),
            stride=stride)
    return out


def _add_memcpy_floor(plan, rank: int, result: dict, runs: dict) -> None:
    """The colocated transport's floor: one bare memory copy of the bytes this rank
    receives, between two preallocated buffers (both written once, see floor_runner)."""
    pairs = flat_schedule(plan, 1 << 62).bytes_by_pair()
    n = sum(nbytes for (s, d), nbytes in pairs.items() if d == rank and s != rank)
    a = torch.full((n,), 0x5A, dtype=torch.uint8)
    b = torch.zeros(n, dtype=torch.uint8)
    result["methods"]["memcpy floor"] = {"times": [], "sent": n, "ok": True, "staging": 0}
    runs["memcpy floor"] = lambda: b.copy_(a)


def floor_runner(plan, comm):
    """The floor: one preallocated message per (sender, receiver) pair of the plan,
    nothing packed, nothing planned, all posted together.

    Every buffer is written once here. A never-written ``torch.empty`` buffer is backed
    by the kernel's shared zero page, so sending it would read one cached 4 KiB page
    over and over instead of the message's memory: a floor about 10% too fast."""
    pairs = flat_schedule(plan, 1 << 62).bytes_by_pair()
    sends = [(torch.full((n,), 0x5A, dtype=torch.uint8), d) for (s, d), n in pairs.items()
             if s == comm.rank]
    recvs = [(torch.zeros(n, dtype=torch.uint8), s) for (s, d), n in pairs.items()
             if d == comm.rank]

    def run():
        for w in comm.exchange(sends, recvs):
            w.wait()

    return run


def _summarise(per_rank: list[dict], cfg: BenchConfig) -> dict:
    def refit_seconds(entries):  # a refit ends when its slowest rank ends
        return statistics.median(max(ts) for ts in zip(*(e["times"] for e in entries)))

    floor = refit_seconds([r["floor"] for r in per_rank])
    out: dict[str, Any] = {"src": cfg.src, "dst": cfg.dst, "model_bytes": cfg.model_bytes,
                           "floor_seconds": floor, "methods": {}}
    for m in per_rank[0]["methods"]:  # the methods asked for, then any floor they add
        entries = [r["methods"][m] for r in per_rank]
        secs = refit_seconds(entries)
        sent = sum(e["sent"] for e in entries)
        out["methods"][m] = {
            "seconds": secs, "bytes": sent, "gbps": sent / secs / 1e9,
            "vs_floor": secs / floor, "peak_staging_bytes": max(e["staging"] for e in entries),
            "verified": all(e["ok"] for e in entries)}
    if "quantize" in per_rank[0]:
        quant = [r["quantize"] for r in per_rank if "quantize" in r]
        out["quantize"] = {"seconds": refit_seconds(quant),
                           "amax_bytes_per_source_rank": quant[0]["amax_bytes"]}
    gb = out["methods"].get("gather_broadcast")
    if gb and "reshard" in out["methods"]:
        out["speedup_vs_gather_broadcast"] = gb["seconds"] / out["methods"]["reshard"]["seconds"]
    return out


def node_of_rank(cfg: BenchConfig) -> dict[int, int]:
    """Trainer ranks fill the first half of the nodes, inference ranks the rest."""
    n_src, n_dst = ParallelSpec.parse(cfg.src).world_size, ParallelSpec.parse(cfg.dst).world_size
    src_nodes = max(1, cfg.nodes // 2)
    dst_nodes = max(1, cfg.nodes - src_nodes)
    out = {r: r * src_nodes // n_src for r in range(n_src)}
    out.update({n_src + r: src_nodes + r * dst_nodes // n_dst for r in range(n_dst)})
    return out


def run_bench(cfg: BenchConfig, *, timeout: float = 1800) -> dict:
    """Run the benchmark on local processes and return the summary."""
    plan, world = build_plan(cfg)
    if cfg.nodes <= 0:
        per_rank = run_processes(_worker, world, cfg, timeout=timeout)
        return _summarise(per_rank, cfg)
    from functools import partial

    from reshard.tools.netns import EmulatedCluster, NetnsUnavailableError, cards_unavailable_reason

    if cfg.nic_per_rank and (reason := cards_unavailable_reason()):
        raise NetnsUnavailableError(reason)
    nodes = node_of_rank(cfg)
    cards = card_of_rank(nodes) if cfg.nic_per_rank else None
    with EmulatedCluster(cfg.nodes, rate_mbit=cfg.link_mbit,
                         nics_per_node=max(cards.values()) + 1 if cards else 1) as cluster:
        names = {r: cluster.ns_name(n) for r, n in nodes.items()}
        per_rank = run_processes(_worker, world, cfg, timeout=timeout,
                                 setup=partial(enter_rank_namespace, names, cards),
                                 master_addr=cluster.node_addr(0),
                                 env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    out = _summarise(per_rank, cfg)
    out["nodes"], out["link_mbit"] = cfg.nodes, cfg.link_mbit
    out["nic_per_rank"] = cfg.nic_per_rank
    out["node_of_rank"] = nodes
    out["link_bytes"] = link_classes(cfg, nodes, plan)
    return out


def link_classes(cfg: BenchConfig, nodes: dict[int, int], plan=None) -> dict:
    """Bytes per link class of the reshard and p2p schedules on these nodes, and the
    inter-node lower bound (each node receives each byte it needs once)."""
    from reshard.topology import Topology, domain_schedule, inter_domain_lower_bound, link_bytes

    plan = plan if plan is not None else build_plan(cfg)[0]
    topo = Topology(domains=nodes)
    return {"reshard": link_bytes(domain_schedule(plan, topo, cfg.budget_bytes), topo),
            "p2p": link_bytes(flat_schedule(plan, cfg.budget_bytes), topo),
            "inter_lower_bound": inter_domain_lower_bound(plan, topo)}


def card_of_rank(nodes: dict[int, int]) -> dict[int, int]:
    """Each rank's own network card on its node: its position among the node's ranks."""
    seen: dict[int, int] = {}
    out = {}
    for r in sorted(nodes):
        out[r] = seen[nodes[r]] = seen.get(nodes[r], -1) + 1
    return out


def enter_rank_namespace(names: dict[int, str], cards: dict[int, int] | None, rank: int) -> None:
    from reshard.tools.netns import EmulatedCluster, enter_namespace, use_card

    enter_namespace(names[rank])
    if cards is None:
        os.environ["GLOO_SOCKET_IFNAME"] = EmulatedCluster.iface  # the node's one link
    else:
        use_card(cards[rank])
