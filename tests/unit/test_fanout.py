"""Fan-out to replicas (``reshard.fanout``): relayed, the sources' domain sends about one
copy of the model whatever the number of replica domains; every destination byte is
written exactly once and equals its expected shard; every region's chain visits the
domains in one order; a relay chain is a pipeline of chunks; ``auto`` follows the link
rates; separate replica tensors of one source relay to each other."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.fanout import choose_fanout, fanout_costs
from reshard.local import execute_schedule_local
from reshard.schedule import DEST
from reshard.topology import Topology, domain_schedule, inter_domain_lower_bound, link_bytes

SHAPES = {"w": (24, 8), "b": (24,), "e": (6, 4, 8)}


def _fleet(num_replicas: int, tp: int, trainer: int = 2, dtype: str = "float32"):
    """Trainer ranks 0..trainer-1 (FSDP-like Shard(0)) in domain 0; replica i's TP ranks
    in domain i+1; one plan whose destination is replicated over the replicas."""
    first = trainer
    grid = [[first + i * tp + j for j in range(tp)] for i in range(num_replicas)]
    src = {n: R.Layout(s, R.Mesh(list(range(trainer))), [R.Shard(0)], dtype)
           for n, s in SHAPES.items()}
    dst = {n: R.Layout(s, R.Mesh(grid), [R.Replicate(), R.Shard(len(s) - 1)], dtype)
           for n, s in SHAPES.items()}
    domains = {r: 0 for r in range(trainer)}
    domains.update({r: 1 + i for i, row in enumerate(grid) for r in row})
    return R.plan(src, dst), Topology(domains=domains)


def _global(shape):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape) * 1.5 - 7


def _out_of(schedule, topo, domain: int) -> int:
    return sum(h.nbytes for _, h in schedule.hops() if not h.is_local
               and topo.domain(h.src_rank) == domain != topo.domain(h.dst_rank))


def _check_exact_once(plan, schedule):
    """Every destination element written exactly once, and equal to its shard."""
    writes: dict[tuple[str, int], torch.Tensor] = {}
    for t in plan.tensors:
        for r in t.dst.ranks:
            writes[t.name, r] = torch.zeros(t.dst.local_shape(r), dtype=torch.int32)
    for _, h in schedule.hops():
        sl = tuple(slice(o, o + s) for o, s in zip(h.dst_offset, h.size))
        writes[h.name, h.dst_rank][sl] += 1
    assert all(bool((w == 1).all()) for w in writes.values())
    src = {}
    for t in plan.tensors:
        for r in t.src.ranks:
            src.setdefault(r, {})[t.name] = t.src.shard(_global(t.src.shape), r)
    out = execute_schedule_local(schedule, plan, src)
    for t in plan.tensors:
        for r in t.dst.ranks:
            assert torch.equal(out[r][t.name], t.dst.shard(_global(t.dst.shape), r))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 5), st.sampled_from([1, 2]), st.sampled_from([96, 512, 1 << 20]))
def test_relay_sends_one_copy_and_is_exact(num_replicas, tp, budget):
    plan, topo = _fleet(num_replicas, tp)
    model = sum(t.src.nbytes for t in plan.tensors)
    relay = domain_schedule(plan, topo, budget, fanout="relay")
    direct = domain_schedule(plan, topo, budget, fanout="direct")
    assert relay.fanout == "relay" and direct.fanout == "direct"
    for sched in (relay, direct):
        _check_exact_once(plan, sched)
        # each replica domain still receives each byte it needs exactly once
        assert link_bytes(sched, topo)["inter"] == inter_domain_lower_bound(plan, topo)
    assert _out_of(relay, topo, 0) == model  # the trainer's link: one copy
    assert _out_of(direct, topo, 0) == num_replicas * model
    # no replica domain forwards more than one copy
    assert all(_out_of(relay, topo, d) <= model for d in range(1, num_replicas + 1))
    # one chain order for every region: each domain link carries one stream each way,
    # from the domain before it and to the domain after it
    links = {(topo.domain(h.src_rank), topo.domain(h.dst_rank)) for _, h in relay.hops()
             if topo.domain(h.src_rank) != topo.domain(h.dst_rank)}
    assert links == {(d, d + 1) for d in range(num_replicas)}, links


@pytest.mark.parametrize("tp", [1, 2])
def test_relay_chain_is_a_pipeline_of_chunks(tp):
    budget = 96  # chunks of 16 bytes: the 1.6 KB model in ~100 chunks
    rounds = {}
    for num in (2, 6):
        plan, topo = _fleet(num, tp)
        relay = domain_schedule(plan, topo, budget, fanout="relay")
        relayed = [h for _, h in relay.hops() if h.read_from == DEST
                   and topo.domain(h.src_rank) != topo.domain(h.dst_rank)]
        assert relayed and all(h.after >= 0 for h in relayed)
        for k, hops in enumerate(relay.rounds):  # a relay sends a chunk once it arrived
            assert all(h.after < k for h in hops)
        rounds[num] = len(relay.rounds)
    # three times the replicas: the chain adds its fill (a round a domain), no more
    assert rounds[6] <= rounds[2] + 2 * (6 - 2), rounds


def test_auto_follows_the_link_rates():
    plan, topo = _fleet(4, 2)
    assert choose_fanout(plan, topo, 96) == "relay"
    assert choose_fanout(plan, topo, 1 << 20) == "direct"  # one chunk: the fill is all
    fat = Topology(domains=topo.domains, domain_gbps={0: 50.0 * 8})  # the trainer's: 8x
    costs = fanout_costs(plan, fat, 96)
    assert costs["direct"] < costs["relay"], costs
    assert choose_fanout(plan, fat, 96) == "direct"
    one, topo1 = _fleet(1, 2)
    assert choose_fanout(one, topo1, 1 << 20) == "direct"  # one replica: nothing to relay
    with pytest.raises(R.ConfigError, match=r"unknown fanout 'tree'; expected one of"):
        domain_schedule(plan, topo, 1 << 20, fanout="tree")


def test_separate_replica_tensors_of_one_source_relay():
    """The elastic group's shape: each replica's tensors under their own names."""
    src = R.Layout((16, 8), R.Mesh([0, 1]), [R.Shard(0)], "float32")
    srcs, dsts, same = {}, {}, {}
    for first in (2, 4, 6):
        name = f"{first}:w"
        srcs[name] = src
        dsts[name] = R.Layout((16, 8), R.Mesh([first, first + 1]), [R.Shard(1)], "float32")
        same[name] = "w"
    plan = R.plan(srcs, dsts)
    topo = Topology(domains={0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3})
    relay = domain_schedule(plan, topo, 256, fanout="relay", same_source=same)
    alone = domain_schedule(plan, topo, 256, fanout="relay")  # not told: three sources
    assert _out_of(relay, topo, 0) == 16 * 8 * 4
    assert _out_of(alone, topo, 0) == 3 * 16 * 8 * 4
    assert any(h.read_name for _, h in relay.hops())
    _check_exact_once(plan, relay)


def test_an_elastic_replica_takes_targets_and_layouts_or_prepare_before_any_store():
    from reshard.errors import ConfigError
    from reshard.refit import ElasticReceiver

    common = dict(host="127.0.0.1", port=1, replica_id="A", rank=0, tp_size=1)
    with pytest.raises(ConfigError, match="give targets and layouts, or prepare="):
        ElasticReceiver(**common)  # neither
    with pytest.raises(ConfigError, match="give targets and layouts, or prepare="):
        ElasticReceiver({}, {}, prepare=lambda trainer: ({}, {}, []), **common)  # both
