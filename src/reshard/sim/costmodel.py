"""The cost model: predicted refit time of a plan on a cluster for ``gather_broadcast``,
``p2p`` and ``reshard`` (and NeMo RL's own ``nemo_broadcast`` and ``nemo_hybrid``, see
:mod:`reshard.sim.nemo`), with the bottleneck link and a lower bound.

Everything is computed from per-rank, per-link-class byte loads (NIC out / in per NIC,
fast links out / in per rank), derived from plan templates once per group of tensors
that share a template and both sides' ranks (all the experts of a layer form one group),
never by enumerating hops: a DeepSeek-V3 plan has millions of hops but a few thousand
groups. Assumptions, stated once:

* Links are full duplex; a rank's fast links and its NIC work concurrently; a stage lasts
  as long as its most loaded link, bytes / bandwidth, plus a latency per round.
* ``p2p``: every transfer of the plan (its chosen senders) goes straight from sender to
  receiver: over the fast links inside a domain, else out of the sender's NIC and into
  the receiver's NIC.
* ``reshard``: per region and destination domain, a co-located holder serves the domain
  over the fast links; otherwise the region crosses the network once, into one needer
  of the domain (needers split the receive evenly by bytes, holders split the send), and
  that needer forwards it to the domain's other needers over the fast links. The two
  stages are pipelined in chunks: time = max(network, forward) + one chunk through the
  faster stage. This is :func:`reshard.topology.domain_schedule` in aggregate.
* ``gather_broadcast``: the buckets of :mod:`reshard._transport.baseline`, one after
  another per rank (:mod:`reshard.sim.broadcast` states its model).
* The lower bound: every byte a destination domain needs and holds nowhere must enter it
  through its NICs; every byte held in one domain only and needed elsewhere must leave
  through that domain's NICs; every rank must receive what it lacks through its fast
  links plus its NIC. Latencies are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import ceil
from typing import TYPE_CHECKING, Any

import numpy as np

from reshard.defaults import DEFAULT_BUDGET_BYTES, SIM_METHODS
from reshard.errors import ClusterError, ConfigError
from reshard.planner import gc_paused
from reshard.sim import nemo
from reshard.sim.broadcast import gather_broadcast
from reshard.sim.cluster import Cluster, RankMap, get_cluster
from reshard.sim.links import LinkLoads, Net, Prediction
from reshard.sim.sparse import sparse_prediction
from reshard.stats import tensor_groups

if TYPE_CHECKING:
    from reshard.planner import Plan

__all__ = ["LinkLoads", "Prediction", "Simulation",
           "simulate"]



@dataclass(frozen=True)
class Simulation:
    cluster: Cluster
    ranks: RankMap
    predictions: dict[str, Prediction]
    lower_bound_s: float
    lower_bound: str
    network_bytes: int
    """Bytes that must cross the network (the inter-domain lower bound, in bytes)."""
    pairs: tuple[np.ndarray, np.ndarray, np.ndarray] = field(repr=False, compare=False)
    """(source rank, destination rank, bytes) of every rank pair of the plan."""

    def as_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster.name, "lower_bound_s": self.lower_bound_s,
                "lower_bound": self.lower_bound, "network_bytes": self.network_bytes,
                "predictions": {m: p.as_dict() for m, p in self.predictions.items()}}


def simulate(plan: Plan, cluster: Cluster | str, *, ranks: RankMap | None = None,
             budget_bytes: int = DEFAULT_BUDGET_BYTES,
             methods: Sequence[str] = SIM_METHODS, changed: float | None = None
             ) -> Simulation:
    """Predict the refit time of ``plan`` on ``cluster`` for each of ``methods``.

    ``ranks`` places the plan's ranks (default: ``cluster.place`` of its two sides);
    ``budget_bytes`` is the executor's staging budget (rounds and pipeline chunks);
    ``changed``: also a ``sparse`` row, a refit after the first with that fraction of
    the engine-dtype values changed (:mod:`reshard.sim.sparse`)."""
    cluster = get_cluster(cluster)
    unknown = [m for m in methods if m not in SIM_METHODS]
    if unknown:
        raise ConfigError(f"unknown methods {unknown}; expected some of {SIM_METHODS}")
    src_ranks, dst_ranks = plan.ranks()
    if ranks is None:
        ranks = cluster.place(src_ranks, dst_ranks)
    unplaced = sorted(r for r in src_ranks | dst_ranks
                      if r >= len(ranks.domain) or ranks.domain[r] < 0)
    if unplaced:
        raise ClusterError(f"ranks {unplaced[:8]} of the plan have no domain in the rank map")
    net = Net(cluster, ranks)
    with gc_paused():  # many small tuples, no cycles: see reshard.planner
        groups = tensor_groups(plan.tensors)
        bound_s, bound_what, network_bytes = _lower_bound(groups, net)
        itemsizes: list[int] = []
        pairs = _plan_pairs(plan, groups, itemsizes)
        model = {"p2p": lambda: _p2p(pairs, net, budget_bytes, bound_s),
                 "reshard": lambda: _reshard(groups, net, budget_bytes, bound_s),
                 "gather_broadcast": lambda: gather_broadcast(plan, net, budget_bytes,
                                                              bound_s),
                 "nemo_broadcast": lambda: nemo.broadcast_prediction(
                     plan.tensors, sorted(src_ranks | dst_ranks), net, bound_s,
                     nemo.buffer_bytes(net, budget_bytes)),
                 "nemo_hybrid": lambda: _nemo_hybrid(plan, net, budget_bytes, bound_s)}
        predictions = {m: model[m]() for m in SIM_METHODS if m in methods}
        if changed is not None:
            predictions["sparse"] = sparse_prediction(
                pairs, changed, np.asarray(itemsizes, dtype=np.float64),
                lambda scaled: _p2p(scaled, net, budget_bytes, bound_s))
    return Simulation(cluster, ranks, predictions, bound_s, bound_what, network_bytes, pairs)


# ------------------------------------------------------------------------------- links


# ------------------------------------------------------------------------- lower bound

def _lower_bound(groups, net: Net) -> tuple[float, str, int]:
    """(seconds, what binds, bytes that must cross the network)."""
    dom = net.domain
    need_in: dict[int, float] = {}
    must_leave: dict[int, float] = {}
    recv = np.zeros(net.num_ranks)
    for t, count in groups:
        tpl = t.template
        src, dst = t.src.ranks, t.dst.ranks
        for slot, nbytes in tpl.recv:
            recv[dst[slot]] += nbytes * count
        for u in tpl.units:
            if not u.remote:
                continue
            held = {dom[src[s]] for s, _ in u.holders}
            missing = {dom[dst[s]] for s, _ in u.remote} - held
            amount = u.nbytes * count
            for d in missing:
                need_in[d] = need_in.get(d, 0) + amount
            if missing and len(held) == 1:
                (a,) = held
                must_leave[a] = must_leave.get(a, 0) + amount
    nics = _nics_per_domain(net)
    bounds = [(0.0, "nothing to move")]
    for d, b in need_in.items():
        bounds.append((b / (nics[d] * net.nic_bw), f"domain {d} receives {b / 1e9:.3g} GB "
                                                   f"over {nics[d]} {net.cluster.nic_name}(s)"))
    for a, b in must_leave.items():
        bounds.append((b / (nics[a] * net.nic_bw), f"domain {a} sends {b / 1e9:.3g} GB "
                                                   f"over {nics[a]} {net.cluster.nic_name}(s)"))
    if recv.any():
        r = int(recv.argmax())
        per_rank_nic = net.nic_bw / net.cluster.gpus_per_nic
        bounds.append((recv[r] / (net.intra_bw + per_rank_nic),
                       f"rank {r} receives {recv[r] / 1e9:.3g} GB"))
    seconds, what = max(bounds, key=lambda x: x[0])
    return seconds, what, int(sum(need_in.values()))


def _nics_per_domain(net: Net) -> dict[int, int]:
    seen: dict[int, set[int]] = {}
    for d, k in zip(net.domain, net.nic):
        if d >= 0:
            seen.setdefault(d, set()).add(k)
    return {d: len(ks) for d, ks in seen.items()}


# --------------------------------------------------------------------------------- p2p

def _plan_pairs(plan: Plan, groups, itemsizes: list[int] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, bytes) of every remote transfer, with the plan's chosen senders;
    ``itemsizes``, when given, gets each transfer's engine element size."""
    src: list[int] = []
    dst: list[int] = []
    amount: list[float] = []
    for t, count in groups:  # single-holder regions: the same for every tensor of a group
        s_ranks, d_ranks = t.src.ranks, t.dst.ranks
        for u in t.template.units:
            if u.remote and len(u.holders) == 1:
                s, b = s_ranks[u.holders[0][0]], u.nbytes * count
                for slot, _ in u.remote:
                    src.append(s)
                    dst.append(d_ranks[slot])
                    amount.append(b)
                    if itemsizes is not None:
                        itemsizes.append(t.dst.itemsize)
    for t in plan.tensors:  # replicated regions: each tensor has its own senders
        if t.senders:
            units, s_ranks, d_ranks = t.template.units, t.src.ranks, t.dst.ranks
            for ui, chosen in t.senders:
                u = units[ui]
                for (slot, _), s in zip(u.remote, chosen):
                    src.append(s_ranks[s])
                    dst.append(d_ranks[slot])
                    amount.append(u.nbytes)
                    if itemsizes is not None:
                        itemsizes.append(t.dst.itemsize)
    return (np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
            np.asarray(amount, dtype=np.float64))


def _rounds(per_rank: np.ndarray, budget: float) -> int:
    return max(1, ceil(float(per_rank.max(initial=0)) / max(budget, 1)))


def _p2p(pairs, net: Net, budget: int, bound: float) -> Prediction:
    src, dst, nbytes = pairs
    loads = net.loads(src, dst, nbytes)
    staged = np.bincount(src, nbytes, minlength=net.num_ranks) + \
        np.bincount(dst, nbytes, minlength=net.num_ranks)
    rounds = _rounds(staged, budget)
    seconds, link, words, rank = net.stage(loads)
    c = net.cluster
    hop = c.nic_latency_s if loads.network_bytes else c.intra_latency_s
    latency = rounds * (c.op_latency_s + hop)
    return Prediction("p2p", seconds + latency, words, link, rank, bound,
                      {"transfer": seconds, "latency": latency, "rounds": rounds}, loads)


# ----------------------------------------------------------------------------- reshard

def _fill(loads: list[float], cands: Sequence[int], amount: float) -> list[float]:
    """Split ``amount`` over ranks ``cands``, least loaded first (water filling), add the
    shares to ``loads`` and return them: what picking the least-loaded rank for each of
    many equal regions converges to."""
    if len(cands) == 1:
        loads[cands[0]] += amount
        return [amount]
    if len(set(cands)) < len(cands):  # a rank listed twice (explicit layouts): count it once
        unique = list(dict.fromkeys(cands))
        share = dict(zip(unique, _fill(loads, unique, amount)))
        return [share.pop(c, 0.0) for c in cands]
    order = sorted(range(len(cands)), key=lambda i: loads[cands[i]])
    level, total = 0.0, 0.0
    for k, i in enumerate(order, 1):
        total += loads[cands[i]]
        level = (amount + total) / k
        if k == len(order) or level <= loads[cands[order[k]]]:
            break
    shares = [max(0.0, level - loads[c]) for c in cands]
    for c, s in zip(cands, shares):
        loads[c] += s
    return shares


def _reshard_loads(groups, net: Net) -> tuple[list[np.ndarray], float]:
    """Per-rank bytes (network out, network in, forward out, forward in) of the
    domain-aware schedule, and its largest region; regions are taken largest first, as
    :func:`reshard.topology.domain_schedule` does."""
    n, dom = net.num_ranks, net.domain
    net_out, net_in, fwd_out, fwd_in = ([0.0] * n for _ in range(4))
    items = sorted((-u.nbytes, gi, ui) for gi, (t, _) in enumerate(groups)
                   for ui, u in enumerate(t.template.units) if u.remote)
    for _, gi, ui in items:
        t, count = groups[gi]
        u = t.template.units[ui]
        amount = u.nbytes * count
        holders = [t.src.ranks[s] for s, _ in u.holders]
        by_domain: dict[int, list[int]] = {}
        for slot, _ in u.remote:
            r = t.dst.ranks[slot]
            by_domain.setdefault(dom[r], []).append(r)
        for d, needers in by_domain.items():
            near = [h for h in holders if dom[h] == d]
            if near:  # a co-located holder: fast links only
                for r in needers:
                    _fill(fwd_out, near, amount)
                    fwd_in[r] += amount
                continue
            shares = _fill(net_in, needers, amount)
            _fill(net_out, holders, amount)
            for r, share in zip(needers, shares):
                fwd_out[r] += share * (len(needers) - 1)
                fwd_in[r] += amount - share
    largest = float(-items[0][0]) if items else 0.0
    return [np.asarray(x) for x in (net_out, net_in, fwd_out, fwd_in)], largest


def _reshard(groups, net: Net, budget: int, bound: float) -> Prediction:
    (net_out, net_in, fwd_out, fwd_in), largest = _reshard_loads(groups, net)
    placed = net.nic_arr >= 0
    nic, k = net.nic_arr[placed], max(net.num_nics, 1)
    loads = LinkLoads(np.bincount(nic, net_out[placed], minlength=k),
                      np.bincount(nic, net_in[placed], minlength=k), fwd_out, fwd_in)
    t_net, link_n, words_n, rank_n = net.stage(loads, ("nic",))
    t_fwd, link_f, words_f, rank_f = net.stage(loads, ("intra",))
    chunk = min(budget // 6, largest)  # the schedule's network chunk (topology.py)
    if t_net and t_fwd:  # the faster stage trails (or leads) the slower by one chunk
        fill = chunk / (net.intra_bw if t_net >= t_fwd else net.nic_bw)
    else:
        fill = 0.0
    c = net.cluster
    rounds = max(_rounds(net_out + net_in, budget / 3),
                 _rounds(net_out + net_in + fwd_out + fwd_in, budget))
    latency = rounds * (c.op_latency_s + (c.nic_latency_s if t_net else 0.0)
                        + (c.intra_latency_s if t_fwd else 0.0))
    if t_net >= t_fwd:
        link, words, rank = link_n, words_n, rank_n
    else:
        link, words, rank = link_f, words_f, rank_f
    stages = {"network": t_net, "forward": t_fwd, "pipeline_fill": fill, "latency": latency,
              "rounds": rounds}
    return Prediction("reshard", max(t_net, t_fwd) + fill + latency, words, link, rank, bound,
                      stages, loads)


# ------------------------------------------------------------------------- nemo_hybrid

def _nemo_hybrid(plan: Plan, net: Net, budget: int, bound: float) -> Prediction:
    """NeMo RL's hybrid (:mod:`reshard.sim.nemo`): the FFN weights through reshard's
    domain-aware path, then the rest through NeMo RL's packed broadcast over every rank."""
    bulk, misc = nemo.split_bulk(plan.tensors)
    src_ranks, dst_ranks = plan.ranks()
    bulk_pred = _reshard(tensor_groups(bulk), net, budget, bound)
    misc_pred = nemo.broadcast_prediction(misc, sorted(src_ranks | dst_ranks), net, bound,
                                          nemo.buffer_bytes(net, budget))
    bulk_bytes = float(sum(t.src.numel * t.dst.itemsize for t in bulk))
    return nemo.hybrid_prediction(bulk_pred, misc_pred, bulk_bytes, bound)
