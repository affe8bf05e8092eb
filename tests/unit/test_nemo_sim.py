"""NeMo RL's own methods in the cost model (``nemo_broadcast``, ``nemo_hybrid``) and the
NCCL ring's pipeline fill: hand-computed cases, properties that can fail, the split of
weights between NeMo RL's two paths, and the ``--methods`` option."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.sim.cluster import Cluster, RankMap, get_cluster
from reshard.sim.costmodel import simulate
from reshard.sim.models import preset
from reshard.sim.nemo import is_bulk
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.cli import main

from .test_plan_properties import layout_pairs

MiB = 1 << 20


def _tiny(**kw) -> Cluster:
    base = dict(name="tiny", gpus_per_domain=2, intra_gb_per_s=10.0, nic_gb_per_s=1.0,
                intra_latency_s=0.0, nic_latency_s=0.0, op_latency_s=0.0, ring_step_bytes=0)
    return Cluster(**{**base, **kw})


def _two_to_four():
    """4 MiB float32, rows on ranks 0, 1 (domain 0); columns on two replicas, ranks 2, 3
    (domain 1) and 4, 5 (domain 2)."""
    src = R.Layout((1024, 1024), R.Mesh([0, 1]), [R.Shard(0)])
    dst = R.Layout((1024, 1024), R.Mesh([[2, 3], [4, 5]]), [R.Shard(1), R.Replicate()])
    return R.plan(src, dst), RankMap.from_domains({0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2})


def test_nemo_broadcast_uses_every_nic_of_the_root_domain():
    plan, ranks = _two_to_four()
    p = simulate(plan, _tiny(), ranks=ranks).predictions
    nemo = p["nemo_broadcast"]
    # The group is all six ranks; the ring 0 -> 1 -> 2 -> 3 -> 4 -> 5 leaves domain 0
    # through both of its NICs: 2 GB/s, where reshard's own baseline (root + inference
    # ranks) has the root's one NIC: 1 GB/s.
    assert nemo.stages["ring_gb_per_s"] == pytest.approx(2.0)
    assert nemo.stages["broadcast"] == pytest.approx(4 * MiB / 2e9)
    # Export: rank 1 sends its 2 MiB half to the root over the fast links.
    assert nemo.stages["export"] == pytest.approx(2 * MiB / 10e9)
    # One buffer (the 256 MiB fallback: no GPU memory given): export, then broadcast.
    assert nemo.stages["buffers"] == 1
    assert nemo.seconds == pytest.approx(2 * MiB / 10e9 + 4 * MiB / 2e9)
    assert nemo.seconds < p["gather_broadcast"].seconds


def test_buffers_overlap_export_and_broadcast():
    """Two alternating buffers: with n buffers the slower stage runs whole and the faster
    one adds one buffer's worth."""
    plan, ranks = _two_to_four()
    cluster = _tiny(gpu_memory_gb=MiB * 50 / 1e9)  # 2% of it = 1 MiB buffers: 4 buffers
    nemo = simulate(plan, cluster, ranks=ranks).predictions["nemo_broadcast"]
    assert nemo.stages["buffers"] == 4
    export, bcast = 2 * MiB / 10e9, 4 * MiB / 2e9
    assert nemo.seconds == pytest.approx(bcast + export / 4)


def test_ring_fill_adds_one_step_per_hop():
    """A 1 MiB step: the chain 0 -> 2 -> 3 -> 4 -> 5 of reshard's baseline has two hops
    between domains (1 MiB through one NIC each) and two inside (1 MiB over the fast
    links, one channel)."""
    plan, ranks = _two_to_four()
    gb = simulate(plan, _tiny(ring_step_bytes=MiB), ranks=ranks).predictions["gather_broadcast"]
    fill = 2 * MiB / 1e9 + 2 * MiB / 10e9
    assert gb.stages["broadcast"] == pytest.approx(4 * MiB / 1e9 + fill)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(), st.integers(1, 4), st.booleans())
def test_all_rank_ring_is_never_narrower_than_one_nic(pair, domain, shared):
    """The group of every rank crosses each domain boundary with at least one channel, so
    its ring is never narrower than one NIC (nor than the fast links); the hybrid is its
    two parts one after the other, and the bytes split between them add up."""
    plan = R.plan(*pair)
    cluster = get_cluster(f"custom:domain={domain},nic=45,intra=450")
    sim = simulate(plan, cluster, ranks=cluster.place(*plan.ranks(), separate=not shared))
    nemo, hybrid = sim.predictions["nemo_broadcast"], sim.predictions["nemo_hybrid"]
    total = sum(t.src.numel * t.dst.itemsize for t in plan.tensors)
    if "ring_gb_per_s" in nemo.stages:
        assert nemo.stages["ring_gb_per_s"] >= 45.0
    assert nemo.stages["bytes"] == total
    assert hybrid.seconds == pytest.approx(hybrid.stages["bulk"] + hybrid.stages["misc"])
    assert hybrid.stages["bulk_bytes"] + hybrid.stages["misc_bytes"] == total


# ------------------------------------------------------------- realistic layouts

def _plan(model: str, src: str, dst: str, keep=None) -> R.Plan:
    spec = preset(model)
    tensors = [t for t in spec.tensors if keep is None or keep(t.name)]
    first = ParallelSpec.parse(src).world_size
    return R.plan(model_layouts(tensors, src), model_layouts(tensors, dst, first_rank=first))


@pytest.mark.parametrize("model,src,dst", [("qwen3-30b-a3b", "pp2,ep8", "tp16"),
                                           ("llama-3.1-8b", "pp2,tp4", "tp16")])
def test_hybrid_is_its_two_paths_and_sits_between_them(model, src, dst):
    """nemo_hybrid = reshard of the FFN sub-plan + NeMo RL's broadcast of the rest, each
    simulated on its own with the same placement; and, when the inference side splits the
    model over domains (so a broadcast sends each domain bytes it does not need),
    reshard <= hybrid <= broadcast. (When every inference domain needs a whole copy,
    the all-NIC ring is as fast as reshard: both are bound by each domain's NICs.)"""
    cluster = get_cluster("dgx-h100")
    plan = _plan(model, src, dst)
    ranks = cluster.place(*plan.ranks())
    p = simulate(plan, cluster, ranks=ranks).predictions
    bulk = simulate(_plan(model, src, dst, is_bulk), cluster, ranks=ranks,
                    methods=["reshard"]).predictions["reshard"]
    hybrid = p["nemo_hybrid"]
    assert hybrid.stages["bulk"] == pytest.approx(bulk.seconds)
    assert p["reshard"].seconds <= hybrid.seconds <= p["nemo_broadcast"].seconds
    # the root's domain is full of trainer ranks: all 8 of its NICs carry the ring
    assert p["nemo_broadcast"].stages["ring_gb_per_s"] == pytest.approx(8 * 45.0)
    assert p["nemo_broadcast"].seconds < p["gather_broadcast"].seconds


def test_the_split_reproduces_nemo_rl_published_fraction():
    """NeMo RL reports that 97.6% of DeepSeek-V3's refit bytes take its reshard path
    (docs/design-docs/nccl-reshard-refit.md); our split of the preset's weights agrees."""
    spec = preset("deepseek-v3")
    bulk = sum(t.nbytes for t in spec.tensors if is_bulk(t.name))
    assert round(bulk / spec.nbytes, 3) == 0.976


@pytest.mark.parametrize("name,bulk", [
    ("model.layers.3.mlp.experts.7.gate_proj.weight", True),
    ("model.layers.3.mlp.experts.255.down_proj.weight", True),
    ("model.layers.0.mlp.up_proj.weight", True),
    ("model.layers.3.mlp.shared_experts.up_proj.weight", False),
    ("model.layers.3.mlp.gate.weight", False),
    ("model.layers.3.self_attn.q_proj.weight", False),
    ("model.layers.0.mlp.down_proj.bias", False),
    ("lm_head.weight", False),
])
def test_which_weights_take_the_bulk_path(name, bulk):
    assert is_bulk(name) is bulk


def test_methods_option(capsys):
    rc = main(["simulate", "--model", "tiny-qwen3-moe", "--src", "pp2,ep2", "--dst", "tp2,dp2",
               "--cluster", "custom:domain=2", "--methods", "nemo_hybrid,reshard", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out["predictions"]) == ["reshard", "nemo_hybrid"]
    assert out["predictions"]["nemo_hybrid"]["stages"]["bulk_fraction"] > 0
    with pytest.raises(SystemExit, match="--methods expects some of"):
        main(["simulate", "--model", "tiny-qwen3", "--src", "tp2", "--dst", "tp2",
              "--methods", "nemo"])
