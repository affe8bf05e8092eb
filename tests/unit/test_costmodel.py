"""The cost model: plan byte totals, hand-computed predictions on tiny clusters, agreement
with the real schedules' link loads, cluster presets, and the ``simulate`` command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard as R
from reshard.schedule import flat_schedule
from reshard.sim.cluster import CLUSTERS, Cluster, ClusterError, RankMap, get_cluster
from reshard.sim.costmodel import simulate
from reshard.sim.models import preset
from reshard.sim.simulate import byte_matrix, sweep
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.cli import main
from reshard.topology import domain_schedule, inter_domain_lower_bound, link_bytes

from .test_plan_properties import layout_pairs

MiB = 1 << 20


def _plan(model: str, src: str, dst: str) -> R.Plan:
    spec = preset(model)
    first = ParallelSpec.parse(src).world_size
    return R.plan(model_layouts(spec.tensors, src),
                  model_layouts(spec.tensors, dst, first_rank=first))


def _shard_bytes(plan: R.Plan) -> int:
    """Every destination rank's local shard, summed over tensors, from the layouts."""
    return sum(math.prod(t.dst.local_shape(r)) * t.dst.itemsize
               for t in plan.tensors for r in t.dst.ranks)


CASES = [("tiny-qwen3", "tp2", "tp2,dp2"), ("tiny-qwen3", "fsdp2,tp2", "tp4"),
         ("tiny-qwen3-moe", "pp2,ep2", "tp2,dp2"), ("tiny-qwen3-moe", "ep4", "dp2,ep2,tp2"),
         ("llama-3.1-8b", "pp2,tp2", "tp4,dp2")]


@pytest.mark.parametrize("model,src,dst", CASES)
def test_plan_bytes_are_the_destination_shards(model, src, dst):
    plan = _plan(model, src, dst)
    stats = plan.stats()
    assert stats.bytes_sent + stats.bytes_local == _shard_bytes(plan) == stats.dst_bytes
    sim = simulate(plan, "custom:domain=4")
    src_r, dst_r, nbytes = sim.pairs
    assert nbytes.sum() == stats.bytes_sent  # every remote byte, counted once
    topo = sim.ranks.topology()
    assert sim.network_bytes == inter_domain_lower_bound(plan, topo)
    # reshard crosses the network exactly once per destination domain: the lower bound
    assert sim.predictions["reshard"].loads.nic_in.sum() == pytest.approx(sim.network_bytes)
    assert sim.predictions["reshard"].seconds >= sim.lower_bound_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(), st.integers(1, 4), st.sampled_from(["nccl", "gloo"]),
       st.booleans())
def test_invariants_on_random_layouts(pair, domain, collectives, shared):
    """Any layouts, colocated or not: p2p moves exactly the plan's remote bytes, reshard
    crosses the network exactly the inter-domain lower bound, no method beats the bound."""
    plan = R.plan(*pair)
    cluster = get_cluster(f"custom:domain={domain},collectives={collectives}")
    sim = simulate(plan, cluster, ranks=cluster.place(*plan.ranks(), separate=not shared))
    p = sim.predictions
    sent = plan.stats().bytes_sent
    loads = p["p2p"].loads
    assert loads.intra_in.sum() + loads.nic_in.sum() == sent
    assert sim.network_bytes == inter_domain_lower_bound(plan, sim.ranks.topology())
    assert p["reshard"].loads.nic_in.sum() == pytest.approx(sim.network_bytes)
    for method in ("p2p", "reshard", "gather_broadcast", "nemo_broadcast", "nemo_hybrid"):
        assert p[method].seconds >= sim.lower_bound_s * (1 - 1e-9), method


# ---------------------------------------------------------------- hand-computed cases

def _tiny_cluster(**kw) -> Cluster:
    base = dict(name="tiny", gpus_per_domain=2, intra_gb_per_s=10.0, nic_gb_per_s=1.0,
                intra_latency_s=0.0, nic_latency_s=0.0, op_latency_s=0.0, ring_step_bytes=0)
    return Cluster(**{**base, **kw})


def test_two_trainers_to_four_inference_ranks_in_two_domains():
    """A 1024x1024 float32 matrix (4 MiB), row-sharded on ranks 0,1 (domain 0), column-
    sharded over two replicas: ranks 2,3 (domain 1) both hold columns 0..511, ranks 4,5
    (domain 2) columns 512..1023. NICs 1 GB/s, fast links 10 GB/s, no latency."""
    src = R.Layout((1024, 1024), R.Mesh([0, 1]), [R.Shard(0)])
    dst = R.Layout((1024, 1024), R.Mesh([[2, 3], [4, 5]]), [R.Shard(1), R.Replicate()])
    plan = R.plan(src, dst)
    ranks = RankMap.from_domains({0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2})
    sim = simulate(plan, _tiny_cluster(), ranks=ranks)
    p = sim.predictions
    # Four regions of 512x512x4 B = 1 MiB: rows (top/bottom, held by 0/1) x columns.
    # Lower bound: domain 0 holds all 4 MiB alone and every byte is needed elsewhere:
    # 4 MiB out through its 2 NICs = 4 MiB / 2 GB/s. (Domain 1 receives 2 MiB / 2 GB/s.)
    assert sim.lower_bound_s == pytest.approx(4 * MiB / 2e9)
    # p2p: rank 0 sends its two regions to both replicas: 4 MiB through its NIC.
    assert p["p2p"].seconds == pytest.approx(4 * MiB / 1e9)
    assert p["p2p"].link == "nic_out" and p["p2p"].rank == 0
    # reshard: each region enters each domain once: rank 0 sends 2 MiB (2.097 ms); each
    # receiver forwards 1 MiB to its replica (0.105 ms), pipelined; one chunk (the
    # largest region, 1 MiB) trails through the fast links (0.105 ms).
    assert p["reshard"].stages["network"] == pytest.approx(2 * MiB / 1e9)
    assert p["reshard"].stages["forward"] == pytest.approx(1 * MiB / 10e9)
    assert p["reshard"].seconds == pytest.approx(2 * MiB / 1e9 + 1 * MiB / 10e9)
    # gather_broadcast: all-gather inside domain 0 (each rank gets 2 MiB over NVLink),
    # then a ring broadcast 0 -> 2 -> 3 -> 4 -> 5 whose slowest link is the root's lone
    # NIC: 4 MiB / 1 GB/s.
    assert p["gather_broadcast"].stages["all_gather"] == pytest.approx(2 * MiB / 10e9)
    assert p["gather_broadcast"].stages["broadcast"] == pytest.approx(4 * MiB / 1e9)
    assert p["gather_broadcast"].seconds == pytest.approx(2 * MiB / 10e9 + 4 * MiB / 1e9)


def test_gloo_binomial_broadcast_shares_the_root_link():
    """4 MiB from rank 0 (node 0) to ranks 4..7 (node 1), one 1 GB/s link per node, gloo:
    the tree is 0->4, 0->5, 0->7 (posted together, sharing the node link: 3 x 4 MiB), then
    4->6 over loopback (4 MiB / 10 GB/s)."""
    src = R.Layout((1024, 1024), R.Mesh([0]), [R.Replicate()])
    dst = R.Layout((1024, 1024), R.Mesh([4, 5, 6, 7]), [R.Replicate()])
    cluster = _tiny_cluster(gpus_per_domain=4, gpus_per_nic=4, collectives="gloo")
    sim = simulate(R.plan(src, dst), cluster)
    assert sim.ranks.domain == (0, -1, -1, -1, 1, 1, 1, 1)
    gb = sim.predictions["gather_broadcast"]
    assert gb.seconds == pytest.approx(3 * 4 * MiB / 1e9 + 4 * MiB / 10e9)
    # p2p pushes 4 x 4 MiB through node 0's link; reshard 4 MiB once, then forwards.
    assert sim.predictions["p2p"].seconds == pytest.approx(16 * MiB / 1e9)
    assert sim.predictions["reshard"].stages["network"] == pytest.approx(4 * MiB / 1e9)
    assert sim.lower_bound_s == pytest.approx(4 * MiB / 1e9)


def test_latency_adds_per_round():
    src = R.Layout((1024, 1024), R.Mesh([0]), [R.Replicate()])
    dst = R.Layout((1024, 1024), R.Mesh([2]), [R.Replicate()])
    cluster = _tiny_cluster(nic_latency_s=1e-3, op_latency_s=2e-3)
    p2p = simulate(R.plan(src, dst), cluster, budget_bytes=2 * MiB).predictions["p2p"]
    # 4 MiB sent + received by rank 0 / rank 2 per round of 2 MiB staging: 2 rounds.
    assert p2p.stages["rounds"] == 2
    assert p2p.seconds == pytest.approx(4 * MiB / 1e9 + 2 * (1e-3 + 2e-3))


# ------------------------------------------------------------ agreement with schedules

@pytest.mark.parametrize("model,src,dst", CASES[:4])
def test_loads_match_the_real_schedules(model, src, dst):
    plan = _plan(model, src, dst)
    sim = simulate(plan, "custom:domain=2,nic=1,intra=10")
    topo = sim.ranks.topology()
    dom = np.asarray(sim.ranks.domain)
    # p2p: the flat schedule's hops, per sending rank across domains, exactly
    out = np.zeros(len(dom))
    for _, h in flat_schedule(plan, 1 << 40).hops():
        if dom[h.src_rank] != dom[h.dst_rank]:
            out[h.src_rank] += h.nbytes
    assert np.array_equal(out, sim.predictions["p2p"].loads.nic_out)
    # reshard: the same network bytes as the domain schedule, a comparable busiest NIC
    sched = domain_schedule(plan, topo, 1 << 40)
    recv = np.zeros(len(dom))
    for _, h in sched.hops():
        if dom[h.src_rank] != dom[h.dst_rank]:
            recv[h.dst_rank] += h.nbytes
    loads = sim.predictions["reshard"].loads
    assert loads.nic_in.sum() == pytest.approx(link_bytes(sched, topo)["inter"])
    largest = max(u.nbytes for t in plan.tensors for u in t.template.units)
    assert abs(loads.nic_in.max() - recv.max()) <= max(0.1 * recv.max(), largest)


# ----------------------------------------------------------------------- clusters

def test_presets_and_placement():
    h100 = get_cluster("dgx-h100")
    assert (h100.gpus_per_domain, h100.intra_gb_per_s, h100.nic_gb_per_s) == (8, 450.0, 45.0)
    assert get_cluster("gb200-nvl72").gpus_per_domain == 72
    assert {"dgx-h100", "gb200-nvl72", "emulated"} <= set(CLUSTERS)
    # 12 trainer ranks fill domains 0, 1; the inference side starts on a fresh domain 2
    ranks = h100.place(range(12), range(12, 20))
    assert ranks.domain[11] == 1 and ranks.domain[12] == 2 and ranks.domain[19] == 2
    assert h100.place(range(12), range(12, 20), separate=False).domain[12] == 1
    custom = get_cluster("custom:domain=4,nic=12.5,intra=100,gpus_per_nic=2,nic_lat_us=5")
    assert (custom.gpus_per_domain, custom.nic_gb_per_s, custom.nics_per_domain) == (4, 12.5, 2)
    assert custom.nic_latency_s == pytest.approx(5e-6)
    assert custom.place(range(4), range(4, 8)).nic == (0, 0, 1, 1, 2, 2, 3, 3)


@pytest.mark.parametrize("spec,message", [
    ("tpu-pod", "unknown cluster 'tpu-pod'"),
    ("custom:domain=x", "domain expects a number, got 'x'"),
    ("custom:speed=3", "expected key=value with a key in"),
    ("custom:domain=0", "gpus_per_domain must be an int >= 1, got 0"),
    ("custom:collectives=mpi", "collectives must be one of"),
])
def test_bad_clusters_are_refused(spec, message):
    with pytest.raises(ClusterError, match=message):
        get_cluster(spec)


# ----------------------------------------------------------------------------- cli

def test_simulate_command_json(capsys):
    rc = main(["simulate", "--model", "tiny-qwen3-moe", "--src", "pp2,ep2", "--dst",
               "tp2,dp2", "--cluster", "custom:domain=2", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["predictions"]) == {"gather_broadcast", "p2p", "reshard", "nemo_broadcast",
                                       "nemo_hybrid"}
    assert out["plan_stats"]["bytes_sent"] > 0
    reshard = out["predictions"]["reshard"]
    assert reshard["seconds"] >= out["lower_bound_s"] > 0
    assert reshard["bottleneck"]


def test_simulate_command_table_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    rc = main(["simulate", "--model", "tiny-qwen3", "--src", "tp2", "--dst", "tp2,dp2",
               "--cluster", "custom:domain=2", "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "reshard bottleneck:" in text and "lower bound" in text


def test_byte_matrix_blocks_and_cluster_sweep(tmp_path):
    plan = _plan("tiny-qwen3", "tp2", "tp2,dp4")
    sim = simulate(plan, "custom:domain=2")
    matrix, sb, db = byte_matrix(sim, max_blocks=4)
    assert matrix.shape == (2, 4) and (sb, db) == (1, 2)
    assert matrix.sum() == plan.stats().bytes_sent
    rows = sweep("cluster", "tp2", "tp2,dp4", "custom:domain=2", model="tiny-qwen3")
    assert [r["gpus"] for r in rows] == [4, 6, 10]
    assert all(r["lower_bound_s"] <= r["reshard"] <= r["gather_broadcast"] for r in rows)


def test_simulate_command_counts_fp8_codes_scales_and_the_amax_exchange(capsys):
    """``--dst-dtype float8_e4m3fn``: the linears arrive as FP8 codes plus one float32
    scale a 128 x 128 block, the rest in bf16; the trainer ranks' amax exchange is
    counted; an engine split vLLM would refuse is refused by name."""
    args = ["simulate", "--model", "tiny-qwen3", "--src", "tp2", "--dst", "dp2",
            "--cluster", "custom:domain=2", "--json"]
    outs = []
    for extra in ([], ["--dst-dtype", "float8_e4m3fn"]):
        assert main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out))
    bf16, fp8 = outs
    tensors = preset("tiny-qwen3").tensors
    linears = [t for t in tensors if len(t.shape) == 2 and "embed" not in t.name
               and "lm_head" not in t.name]
    blocks = sum(-(-t.shape[0] // 128) * -(-t.shape[1] // 128) for t in linears)
    numel = sum(t.shape[0] * t.shape[1] for t in linears)
    assert fp8["fp8"]["tensors"] == len(linears) and fp8["fp8"]["scale_bytes"] == 4 * blocks
    # two engine replicas: each gets every linear's codes (1 B) and scales instead of bf16
    saved = 2 * (2 * numel - numel - 4 * blocks)
    assert bf16["plan_stats"]["bytes_sent"] - fp8["plan_stats"]["bytes_sent"] == saved
    # tp2 cuts each 64-row (or 32-column) linear inside its one block: all shared
    assert fp8["fp8"]["shared_blocks"] == blocks
    assert fp8["fp8"]["amax_bytes_per_trainer_rank"] == 4 * blocks
    assert main(["simulate", "--model", "tiny-qwen3", "--src", "tp2", "--dst", "tp2",
                 "--cluster", "custom:domain=2", "--dst-dtype", "float8_e4m3fn"]) != 0
    assert ("'model.layers.0.self_attn.q_proj.weight': engine rank 0 holds an output size "
            "(rows) of 32 of 64") in capsys.readouterr().err
