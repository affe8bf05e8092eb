"""Refit time of a fleet of R inference replicas, fed directly or through relays
(:mod:`reshard.fanout`), predicted from the cost model's loads of one replica.

The cost model (:mod:`reshard.sim.costmodel`) predicts the ``reshard`` schedule into one
replica: per-NIC network loads (the trainer's NICs out, the replica's NICs in), the
forward stage inside the replica's domain, the pipeline's fill and a latency per round.
A fleet repeats that replica R times; replicas share a fast domain when it holds
several (``k`` = GPUs per domain // replica size, at most R; ``D = ceil(R / k)`` replica
domains), and the domain schedule sends each byte into a domain once, whatever it
holds. Assumptions, stated once:

* ``direct``: the trainer's NICs send one copy per replica domain (its busiest NIC's
  load times ``D``), and its rounds, so its per-round latency, grow alike; each replica
  domain's NICs receive as for one replica.
* ``relay``: the trainer's NICs send one copy; each replica domain's receiving NICs also
  forward what they received to the next domain (links are full duplex: out as large as
  in, concurrent); the chain adds its fill, one network chunk (a sixth of the budget)
  per domain after the first, each with a network hop's and a round's latency.
* Replicas sharing a domain get their copies over the fast links from the one that
  received it: ``k - 1`` copies of a replica rank's share out of each receiving rank.
* ``sparse`` (``changed=F``: a refit after the first, ``F`` of the engine-dtype values
  changed; :mod:`reshard.sim.sparse`), after the detection, which does not grow with R.
  Direct: over the flat schedule (no forward inside a domain), so the trainer's NICs
  send each replica its encoded share (the one-replica sparse loads times R: each
  region's sender is the same for every replica). Relayed: the trainer's NICs send one
  share, into the first replica of a chain of all R (replica to replica, whether or not
  they share a domain: the sparse transport has no forward inside a domain, and a link
  of the chain inside one is as costly here as one between domains); the chain adds a
  step per replica after the first, each the smaller of a sixth of the budget and a
  receiving NIC's whole share, with a network hop's and a round's latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil
from typing import Any

from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.sim.cluster import Cluster, get_cluster
from reshard.sim.links import Prediction

__all__ = ["FleetPoint", "fleet_curve", "fleet_point"]


@dataclass(frozen=True)
class FleetPoint:
    replicas: int
    domains: int
    """Replica domains (fast domains holding replicas)."""
    direct_s: float
    relay_s: float
    trainer_copies_direct: int
    trainer_copies_relay: int
    sparse_s: float | None = None
    """A sparse refit's seconds (``changed``), as built: direct, after the detection."""
    trainer_copies_sparse: float | None = None
    """Its bytes out of the trainer's domain, in dense model copies."""
    sparse_relay_s: float | None = None
    """The sparse refit relayed replica to replica."""
    trainer_copies_sparse_relay: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fleet_point(one: Prediction, cluster: Cluster, replicas: int, replica_gpus: int,
                budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                sparse: Prediction | None = None) -> FleetPoint:
    """The fleet of ``replicas`` copies of the replica whose ``reshard`` prediction is
    ``one`` (with its loads), each of ``replica_gpus`` GPUs; ``sparse``: that replica's
    sparse prediction too (its loads the flat schedule's of the encoded bytes)."""
    assert one.loads is not None, "a reshard prediction carries its loads"
    nic, intra = cluster.nic_gb_per_s * 1e9, cluster.intra_gb_per_s * 1e9
    t_out = float(one.loads.nic_out.max(initial=0.0)) / nic
    t_in = float(one.loads.nic_in.max(initial=0.0)) / nic
    copy = one.loads.network_bytes
    per_domain = max(1, min(replicas, cluster.gpus_per_domain // replica_gpus))
    domains = ceil(replicas / per_domain)
    fwd = max(one.stages.get("forward", 0.0),
              (per_domain - 1) * copy / replica_gpus / intra)
    fill, latency = one.stages.get("pipeline_fill", 0.0), one.stages.get("latency", 0.0)
    direct = _fed_directly(t_out, t_in, domains, fwd, latency) + fill
    hop = (budget_bytes // 6) / nic + cluster.nic_latency_s + cluster.op_latency_s
    relay = max(t_out, t_in, fwd) + fill + latency + (domains - 1) * hop
    if sparse is None:
        return FleetPoint(replicas, domains, direct, relay, domains, 1)
    assert sparse.loads is not None, "a sparse prediction carries its loads"
    s_out = float(sparse.loads.nic_out.max(initial=0.0)) / nic
    s_in = float(sparse.loads.nic_in.max(initial=0.0)) / nic
    sparse_s = sparse.stages["detect"] + _fed_directly(
        s_out, s_in, replicas, sparse.stages["transfer"], sparse.stages["latency"])
    copies = replicas * sparse.loads.network_bytes / copy if copy else 0.0
    step = (min((budget_bytes // 6) / nic, s_in) + cluster.nic_latency_s
            + cluster.op_latency_s)
    sparse_relay = (sparse.stages["detect"] + max(s_out, s_in, sparse.stages["transfer"])
                    + sparse.stages["latency"] + (replicas - 1) * step)
    return FleetPoint(replicas, domains, direct, relay, domains, 1, sparse_s, copies,
                      sparse_relay, copies / replicas)


def _fed_directly(t_out: float, t_in: float, copies: int, floor: float,
                  latency: float) -> float:
    """Seconds of ``copies`` copies sent straight from the trainer's NICs (``t_out`` each,
    ``t_in`` into one receiver, at least ``floor``), its rounds' ``latency`` growing with
    the trainer's share of the time."""
    return max(copies * t_out, t_in, floor) + latency * max(
        1.0, copies * t_out / max(t_out, t_in, 1e-30))


def fleet_curve(model, src: str, replica: str, cluster: Cluster | str,
                replicas: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), *,
                budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                dst_dtype: str | None = None, changed: float | None = None
                ) -> list[FleetPoint]:
    """Plan and simulate one replica (``replica``: its parallel spec, e.g. ``tp8``) from
    the trainer's ``src`` once, then every fleet size of ``replicas``; ``changed``: a
    sparse refit's too (as ``reshard simulate --changed``; FP8 block engines included)."""
    from reshard.sim.simulate import run_case
    from reshard.sim.specs import ParallelSpec

    cluster = get_cluster(cluster)
    case = run_case(model, src, replica, cluster, budget_bytes=budget_bytes,
                    dst_dtype=dst_dtype, methods=("reshard",), changed=changed)
    one, sparse = case["sim"].predictions["reshard"], case["sim"].predictions.get("sparse")
    gpus = ParallelSpec.parse(replica).world_size
    return [fleet_point(one, cluster, r, gpus, budget_bytes, sparse) for r in replicas]
