"""The cost model of ``gather_broadcast`` (:func:`gather_broadcast`, one method of
:func:`reshard.sim.costmodel.simulate`): the buckets of
:mod:`reshard._transport.baseline`, one after another per rank: all-gather of the bucket
among its source ranks (ring), then a broadcast from the first source rank to every
destination rank. With NCCL the broadcast is a pipelined ring: each byte crosses each
ring link once, so it takes bytes / (slowest ring link), where a link between domains
gets one channel per NIC the ring has on both sides (a lone root has one NIC), plus the
ring's fill: every hop holds one NCCL step (``Cluster.ring_step_bytes``) before
forwarding it (:func:`reshard.sim.links.ring_fill`). With gloo it is gloo's binomial
tree, store and forward, simulated as fluid flows sharing NICs.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.sim.links import LinkLoads, Net, Prediction, ring, ring_fill
from reshard.stats import distinct_shard_slots

if TYPE_CHECKING:
    from reshard.planner import Plan

__all__ = ["gather_broadcast"]


@dataclass
class _BucketCost:
    """What one bucket of a (source ranks, destination ranks) pair costs, per byte."""

    src_idx: np.ndarray
    dst_idx: np.ndarray
    gather_per_byte: float  # seconds per byte of the largest local share
    gather_latency: float
    gather_label: tuple[str, str, int | None]  # (link class, the slowest link, its rank)
    gather_links: list[tuple[int, int]]
    bcast_per_byte: float
    bcast_latency: float
    bcast_label: tuple[str, str, int | None]
    bcast_links: list[tuple[int, int]]
    gather_bytes: float = 0.0  # accumulated, for the link loads
    bcast_bytes: float = 0.0


def _buckets(plan: Plan, budget: int) -> list[list]:
    """The buckets of :mod:`reshard._transport.baseline`: [gathering source ranks (one replica),
    destination rank set, bytes, bytes each of them holds], consecutive tensors with the
    same ranks, at most ``budget`` bytes each (a larger tensor alone)."""
    out: list[list] = []
    key, size = None, 0
    held: dict[Any, np.ndarray] = {}
    for t in plan.tensors:
        k = (t.src.ranks, t.dst.rank_set)
        nbytes = t.src.numel * t.dst.itemsize
        if k != key or size + nbytes > budget:
            out.append([k[0], k[1], 0.0, np.zeros(len(k[0])), set()])
            key, size = k, 0
        bucket = out[-1]
        bucket[2] += nbytes
        bucket[3] += _held_per_slot(t.src, held)
        bucket[4].update(distinct_shard_slots(t.src))
        size += nbytes
    for bucket in out:  # the baseline gathers over one replica of the source only
        slots = sorted(bucket.pop())
        bucket[0] = tuple(bucket[0][s] for s in slots)
        bucket[3] = bucket[3][slots]
    return out


def _held_per_slot(layout, cache: dict[Any, np.ndarray]) -> np.ndarray:
    found = cache.get(id(layout))
    if found is None:
        found = cache.get(layout.structure)
        if found is None:
            found = np.array([layout.itemsize * int(np.prod(layout.view_of_slot(s).local_shape))
                              for s in range(len(layout.ranks))], dtype=np.float64)
            cache[layout.structure] = found
        cache[id(layout)] = found
    return found



def _tree(members: list[int], root: int, net: Net) -> tuple[float, tuple, list]:
    """gloo's binomial-tree broadcast as fluid flows: (seconds per byte, busiest link,
    links). Virtual rank v (root 0) receives from v with its highest set bit cleared, then
    posts all its sends at once; concurrent flows share each NIC direction and fast link
    equally."""
    n = len(members)
    rank = [members[(v + root) % n] for v in range(n)]
    parent = [0] + [v ^ (1 << (v.bit_length() - 1)) for v in range(1, n)]
    children: dict[int, list[int]] = {v: [] for v in range(n)}
    for v in range(1, n):
        children[parent[v]].append(v)
    cap = {"out": net.nic_bw, "in": net.nic_bw, "io": net.intra_bw, "ii": net.intra_bw,
           "sh": net.shared_bw}
    resources = {v: _flow_resources(rank[parent[v]], rank[v], net) for v in range(1, n)}
    active = {v: 1.0 for v in children[0]}
    carried: dict[tuple, float] = {}
    t = 0.0
    while active:
        count: dict[tuple, int] = {}
        for v in active:
            for res in resources[v]:
                count[res] = count.get(res, 0) + 1
        rate = {v: min(cap[res[0]] / count[res] for res in resources[v]) for v in active}
        dt = min(active[v] / rate[v] for v in active)
        t += dt
        for v in list(active):
            active[v] -= rate[v] * dt
            if active[v] <= 1e-9:
                del active[v]
                active.update((c, 1.0) for c in children[v])
    for v in range(1, n):
        for res in resources[v]:
            carried[res] = carried.get(res, 0.0) + 1.0 / cap[res[0]]
    busiest = max(carried, key=carried.get, default=None)
    links = [(rank[parent[v]], rank[v]) for v in range(1, n)]
    return t, _resource_words(busiest, net), links


def _flow_resources(a: int, b: int, net: Net) -> list[tuple]:
    if net.domain[a] != net.domain[b]:
        return [("out", net.nic[a]), ("in", net.nic[b])]
    shared = [("sh", 0)] if net.shared_bw is not None else []
    return [("io", a), ("ii", b), *shared]


def _resource_words(res: tuple | None, net: Net) -> tuple[str, str, int | None]:
    c = net.cluster
    if res is None:
        return "none", "no link", None
    kind, idx = res
    if kind in ("out", "in"):
        rank = next(r for r, k in enumerate(net.nic) if k == idx)
        return f"{c.nic_name} {kind}", net.nic_ranks(idx), rank
    if kind == "sh":
        return f"{c.intra_name} (shared host)", "all ranks", None
    return f"{c.intra_name} {'out' if kind == 'io' else 'in'}", f"rank {idx}", idx


def _bucket_cost(src: tuple[int, ...], dst: frozenset[int], net: Net) -> _BucketCost:
    c, dom = net.cluster, net.domain
    root = min(src)
    nccl = c.collectives == "nccl"
    gather = sorted(src, key=lambda r: (dom[r], r)) if nccl else sorted(src)
    g_bw, g_label, g_links = (ring(gather, True, net) if len(src) > 1
                              else (1.0, ("none", "", None), []))
    g_hops = len(src) - 1
    crosses = len({dom[r] for r in src}) > 1
    hop = c.nic_latency_s if crosses else c.intra_latency_s
    g_lat = (c.op_latency_s + g_hops * hop) if nccl else 2 * g_hops * hop
    group = sorted({root} | dst)
    if len(group) < 2:
        b_per, b_lat, b_label, b_links = 0.0, 0.0, ("none", "", None), []
    elif nccl:
        chain = [root] + sorted(set(group) - {root},
                                key=lambda r: (dom[r] != dom[root], dom[r], r))
        bw, b_label, b_links = ring(chain, False, net)
        b_per = 1.0 / bw
        b_lat = c.op_latency_s + ring_fill(b_links, net)
    else:
        b_per, b_label, b_links = _tree(group, group.index(root), net)
        b_lat = c.op_latency_s + ceil(np.log2(len(group))) * c.nic_latency_s
    return _BucketCost(np.asarray(src), np.asarray(sorted(dst | {root})),
                       g_hops / g_bw if g_hops else 0.0, g_lat if g_hops else 0.0,
                       g_label, g_links, b_per, b_lat, b_label, b_links)


def gather_broadcast(plan: Plan, net: Net, budget: int, bound: float) -> Prediction:
    """The predicted ``gather_broadcast`` of ``plan``: buckets in order; a rank runs its
    buckets one after another (all-gather, then broadcast), so buckets of disjoint rank
    sets overlap and the rest queue."""
    free = np.zeros(net.num_ranks)
    costs: dict[tuple, _BucketCost] = {}
    spent: dict[str, float] = {}  # seconds per (stage, link class)
    example: dict[str, tuple[float, str, int | None]] = {}
    stage = {"all_gather": 0.0, "broadcast": 0.0}
    for src, dst, nbytes, held in _buckets(plan, budget):
        cost = costs.get((src, dst))
        if cost is None:
            cost = costs[(src, dst)] = _bucket_cost(src, dst, net)
        longest = float(held.max())
        t_gather = cost.gather_per_byte * longest + cost.gather_latency
        t_bcast = cost.bcast_per_byte * nbytes + cost.bcast_latency
        gathered = free[cost.src_idx].max() + t_gather
        free[cost.src_idx] = gathered
        done = max(gathered, free[cost.dst_idx].max()) + t_bcast
        free[cost.dst_idx] = done
        cost.gather_bytes += longest * (len(src) - 1)
        cost.bcast_bytes += nbytes
        for name, (kind, words, rank), t in (("all-gather", cost.gather_label, t_gather),
                                             ("broadcast", cost.bcast_label, t_bcast)):
            if t:
                key = f"{name} over {kind}"
                spent[key] = spent.get(key, 0.0) + t
                if t > example.get(key, (0.0,))[0]:
                    example[key] = (t, words, rank)
        stage["all_gather"] += t_gather
        stage["broadcast"] += t_bcast
    if spent:
        key = max(spent, key=spent.get)
        _, words, rank = example[key]
        label, link = f"{key}, e.g. {words}", key.split(" over ")[0].replace("-", "_")
    else:
        label, link, rank = "nothing to move", "none", None
    return Prediction("gather_broadcast", float(free.max(initial=0.0)), label, link, rank,
                      bound, stage, _gather_broadcast_loads(costs.values(), net))


def _gather_broadcast_loads(costs, net: Net) -> LinkLoads:
    src: list[int] = []
    dst: list[int] = []
    amount: list[float] = []
    for cost in costs:
        for links, nbytes in ((cost.gather_links, cost.gather_bytes),
                              (cost.bcast_links, cost.bcast_bytes)):
            for a, b in links:
                src.append(a)
                dst.append(b)
                amount.append(nbytes)
    return net.loads(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                     np.asarray(amount, dtype=np.float64))
