"""The fleet model (``reshard.sim.fleet``): direct fan-out grows with the replica domains
once the trainer's NICs are the bottleneck, relayed stays within its chain's fill;
replicas sharing an NVLink domain are fed once; the one-replica loads it scales are the
real domain schedule's; a sparse refit goes direct to every replica or relayed replica to
replica."""

from __future__ import annotations

import pytest

import reshard as R
from reshard.sim.cluster import get_cluster
from reshard.sim.fleet import fleet_curve, fleet_point
from reshard.sim.models import synthetic_model
from reshard.sim.simulate import run_case
from reshard.sim.specs import model_layouts
from reshard.topology import Topology, domain_schedule

MODEL = synthetic_model(4 << 30, dtype="bfloat16")


def test_direct_grows_relay_stays():
    points = fleet_curve(MODEL, "tp8", "tp8", "dgx-h100", (1, 2, 8, 64),
                         budget_bytes=8 << 20)
    one = points[0]
    assert one.direct_s == pytest.approx(one.relay_s)
    for p in points[1:]:  # the trainer has as many NICs as a replica: direct is R-fold
        assert p.domains == p.replicas and p.trainer_copies_direct == p.replicas
        assert p.direct_s >= 0.9 * p.replicas * one.direct_s
        assert p.trainer_copies_relay == 1
        assert p.relay_s <= (1.1 if p.replicas <= 8 else 1.5) * one.relay_s
    assert points[-1].relay_s > points[1].relay_s  # the fill is counted


def test_replicas_in_one_nvlink_domain_are_fed_once():
    one = run_case(MODEL, "tp8", "tp8", "gb200-nvl72", methods=("reshard",))
    pred = one["sim"].predictions["reshard"]
    cluster = get_cluster("gb200-nvl72")
    nine = fleet_point(pred, cluster, 9, 8)  # 72 GPUs: one domain
    assert nine.domains == 1 and nine.direct_s == nine.relay_s
    ten = fleet_point(pred, cluster, 10, 8)
    assert ten.domains == 2 and ten.trainer_copies_direct == 2


def test_one_replica_loads_are_the_schedules():
    """What the model scales: one copy out of the trainer's domain, as the real domain
    schedule sends relayed to any number of replicas (and R copies direct)."""
    src = model_layouts(MODEL.tensors, "tp2")
    for replicas in (1, 3):
        dst = model_layouts(MODEL.tensors, f"tp2,dp{replicas}", first_rank=2)
        plan = R.plan(src, dst)
        topo = Topology(domains={r: r // 2 for r in range(2 + 2 * replicas)})
        sim = run_case(MODEL, "tp2", "tp2", "custom:domain=2,nic=45,intra=450",
                       methods=("reshard",))["sim"]
        copy = sim.predictions["reshard"].loads.network_bytes
        for fanout, copies in (("relay", 1), ("direct", replicas)):
            sched = domain_schedule(plan, topo, 64 << 20, fanout=fanout)
            out = sum(h.nbytes for _, h in sched.hops()
                      if topo.domain(h.src_rank) == 0 != topo.domain(h.dst_rank))
            assert out == copies * copy


def test_sparse_refits_go_direct_to_every_replica_or_relayed():
    """At 1% changed (bf16) a replica's sparse share is a few percent of a copy; direct
    (the flat schedule) the trainer sends it to each replica: R shares, where a relayed
    dense refit sends one whole copy; relayed, one share whatever R, the chain adding a
    step per replica. At 100% every byte travels."""
    points = fleet_curve(MODEL, "tp8", "tp8", "dgx-h100", (1, 8, 64), budget_bytes=8 << 20,
                         changed=0.01)
    one = points[0]
    assert 0.02 < one.trainer_copies_sparse < 0.05
    assert one.sparse_s < one.direct_s
    for p in points[1:]:
        assert p.trainer_copies_sparse == pytest.approx(p.replicas * one.trainer_copies_sparse)
        assert p.sparse_s >= one.sparse_s
    assert points[-1].trainer_copies_sparse > points[-1].trainer_copies_relay  # 64 x 3%
    for p in points:
        assert p.trainer_copies_sparse_relay == pytest.approx(one.trainer_copies_sparse)
        assert one.sparse_s <= p.sparse_relay_s <= p.sparse_s + 1e-12
    assert points[1].sparse_relay_s < points[-1].sparse_relay_s < points[-1].relay_s
    everything = fleet_curve(MODEL, "tp8", "tp8", "dgx-h100", (1,), budget_bytes=8 << 20,
                             changed=1.0)[0]
    assert everything.trainer_copies_sparse == pytest.approx(1.0, rel=1e-3)  # every byte
    dense = fleet_curve(MODEL, "tp8", "tp8", "dgx-h100", (1,), budget_bytes=8 << 20)[0]
    assert dense.sparse_s is None and dense.trainer_copies_sparse is None
