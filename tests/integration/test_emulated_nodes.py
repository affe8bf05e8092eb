"""The bench on emulated nodes (network namespaces, rate-limited links): results are
bit-exact for every method inside real namespaces, and the domain-aware schedule beats
the flat one because it crosses the slow link once instead of twice."""

from __future__ import annotations

import pytest

from reshard.tools.bench import BenchConfig, run_bench
from reshard.tools.netns import cards_unavailable_reason, netns_unavailable_reason

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def netns():
    reason = netns_unavailable_reason()
    if reason:
        print(f"SKIP emulated nodes: {reason}")
        pytest.skip(f"emulated nodes unavailable: {reason}")


def test_two_nodes_tp4_to_tp2_dp2(netns):
    cfg = BenchConfig(src="tp4", dst="tp2,dp2", model_bytes=24 << 20, repeats=1,
                      methods=("reshard", "p2p", "gather_broadcast"), nodes=2, link_mbit=400,
                      budget_bytes=16 << 20)
    result = run_bench(cfg, timeout=300)
    methods = result["methods"]
    assert all(m["verified"] for m in methods.values()), methods
    # a ratio measured in one run: the flat path sends every region across twice
    ratio = methods["p2p"]["seconds"] / methods["reshard"]["seconds"]
    print(f"p2p / reshard on 2 emulated nodes: {ratio:.2f}x")
    assert ratio > 1.4, result


def test_two_nodes_a_card_per_rank(netns):
    """Every rank has its own network card (as every GPU has its own NIC): reshard
    splits the node's network receive over the four cards, while gather-and-broadcast's
    root pushes the full state to three of its receivers through its one card."""
    reason = cards_unavailable_reason()
    if reason:
        print(f"SKIP a card per rank: {reason}")
        pytest.skip(f"a card per rank unavailable: {reason}")
    cfg = BenchConfig(src="tp4", dst="tp2,dp2", model_bytes=24 << 20, repeats=1,
                      methods=("reshard", "p2p", "gather_broadcast"), nodes=2, link_mbit=400,
                      budget_bytes=16 << 20, nic_per_rank=True)
    result = run_bench(cfg, timeout=300)
    methods = result["methods"]
    assert all(m["verified"] for m in methods.values()), methods
    assert result["nic_per_rank"]
    vs_p2p = methods["p2p"]["seconds"] / methods["reshard"]["seconds"]
    vs_gb = methods["gather_broadcast"]["seconds"] / methods["reshard"]["seconds"]
    print(f"a card per rank, 2 emulated nodes: {vs_p2p:.2f}x vs p2p, {vs_gb:.2f}x vs G+B")
    assert vs_p2p > 1.2 and vs_gb > 3.0, result
