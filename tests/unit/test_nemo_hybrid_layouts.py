"""The Megatron-shaped layouts of ``benchmarks/nemo_hybrid.py`` describe what Megatron-Core
holds: each TP rank's ``linear_qkv`` and ``linear_fc1``, built here independently from
full tensors with torch ops, equal the local tensors the layouts' pieces assemble."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from reshard.layout import box_slices

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "nemo_hybrid.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPT.parent))  # its shared tools, as when it runs as a script
    spec = importlib.util.spec_from_file_location("nemo_hybrid", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _assemble(layouts, fulls, rank):
    """One local tensor holding every named tensor's pieces for ``rank``."""
    out = None
    for name, layout in layouts.items():
        view = layout.view(rank)
        out = torch.zeros(view.local_shape) if out is None else out
        for p in view.pieces:
            out[box_slices(p.local_offset, p.size)] = fulls[name][box_slices(p.offset, p.size)]
    return out


def test_linear_qkv_is_interleaved_by_query_group(bench):
    m = bench.Shape()
    layouts = bench.megatron_layouts(m)
    p = "model.layers.1.self_attn"
    names = [f"{p}.{x}_proj.weight" for x in "qkv"]
    q, k, v = (torch.randn(layouts[n].shape) for n in names)
    hd, per_group = m.head_dim, m.heads // m.groups
    # Megatron: group g = its q heads, then k_g, then v_g; TP rank t holds a run of groups
    grouped = torch.cat([q.view(m.groups, per_group * hd, -1), k.view(m.groups, hd, -1),
                         v.view(m.groups, hd, -1)], dim=1)
    stage = bench._stage_ranks(1, m)
    for t, rank in enumerate(stage):
        expected = grouped.chunk(bench.TP)[t].reshape(-1, m.hidden)
        got = _assemble({n: layouts[n] for n in names}, dict(zip(names, (q, k, v))), rank)
        assert torch.equal(got, expected)


@pytest.mark.parametrize("prefix", ["model.layers.0.mlp", "model.layers.3.mlp.experts.9"])
def test_linear_fc1_is_gate_then_up(bench, prefix):
    m = bench.Shape()
    layouts = bench.megatron_layouts(m)
    names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
    gate, up = (torch.randn(layouts[n].shape) for n in names)
    holders = layouts[names[0]].ranks
    for t, rank in enumerate(holders):  # dense: TP2 shards; expert: one EP rank, whole
        expected = torch.cat([gate.chunk(len(holders))[t], up.chunk(len(holders))[t]])
        got = _assemble(dict(zip(names, (layouts[n] for n in names))),
                        dict(zip(names, (gate, up))), rank)
        assert torch.equal(got, expected)
    if "experts" in prefix:  # expert 9 of 16 lives on the second rank of stage 1
        assert holders == (3,)


def test_the_split_and_the_plans(bench):
    m = bench.Shape()
    plans = bench.plans(m)
    names = {t.name for t in plans["bulk"].tensors}
    assert all(".mlp." in n and "_proj" in n for n in names)
    assert not any("self_attn" in n for n in names)
    assert len(plans["bulk"]) + len(plans["misc"]) == len(plans["all"])
    stats = plans["all"].stats()
    assert stats.dst_bytes == plans["bulk"].stats().dst_bytes + plans["misc"].stats().dst_bytes


def test_the_layouts_agree_with_the_megatron_integration(bench):
    """The benchmark's layouts and :mod:`reshard.integrations.megatron`'s rules were
    written independently; both say the same pieces for every rank."""
    from reshard.integrations.megatron import Coords, hf_entries

    m = bench.Shape()
    layouts = bench.megatron_layouts(m)
    local_experts = m.experts // bench.TP
    for layer in (0, 3):
        for t, rank in enumerate(bench._stage_ranks(layer, m)):
            c = Coords(hidden=m.hidden, heads=m.heads, groups=m.groups, head_dim=m.head_dim,
                       vocab=m.vocab, tp_rank=t, tp_size=bench.TP, ep_rank=t,
                       ep_size=bench.TP, local_experts=local_experts)
            qkv = (m.groups // bench.TP * (m.heads // m.groups + 2) * m.head_dim, m.hidden)
            names = [(f"decoder.layers.{layer}.self_attention.linear_qkv.weight", qkv),
                     (f"decoder.layers.{layer}.self_attention.linear_proj.weight",
                      (m.hidden, m.heads * m.head_dim // bench.TP))]
            if layer == 0:
                names.append(("decoder.layers.0.mlp.linear_fc1.weight",
                              (2 * m.dense_inter // bench.TP, m.hidden)))
            else:
                names += [(f"decoder.layers.{layer}.mlp.experts.local_experts.{i}."
                           f"linear_fc{k}.weight", shape)
                          for i in range(local_experts)
                          for k, shape in ((1, (2 * m.moe_inter, m.hidden)),
                                           (2, (m.hidden, m.moe_inter)))]
            for name, shape in names:
                for entry in hf_entries(name, shape, c):
                    layout = layouts[entry.name]
                    assert layout.shape == entry.shape and layout.view(rank) == entry.view, \
                        (name, entry.name, rank)
