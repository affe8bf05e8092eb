"""Megatron-Core shards -> one Hugging Face state dict, written apart from the library.

The reference the Megatron checks compare vLLM with (the refit tests and ``demo_rl
--trainer megatron``): the Megatron trainers save every rank's parameters as they are
(``step{k}.rank{r}.pt``, :func:`reshard.tools.megatron_cpu.save_rank_record`);
:func:`to_hf` rebuilds the full Hugging Face tensors the plain way -- concatenate the TP
shards, then reshape ``linear_qkv`` to ``[groups, q heads + 2, head_dim, hidden]`` and
slice it, halve each ``linear_fc1`` shard, drop the vocabulary padding, renumber layers
and experts. It shares no code with ``reshard.integrations.megatron`` (which never builds
a full tensor): a check against it is a check of that module's rules. Copies that
Megatron replicates (over TP, over data parallelism) must agree bit for bit; :func:`to_hf`
checks it (:class:`ReplicaMismatch`), so a trainer whose replicas drift fails here rather
than hiding behind one copy. Dense and MoE Llama / Qwen2 / Qwen3 names of the local
layer spec only.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch


class ReplicaMismatch(AssertionError):
    """Two copies of one Megatron parameter that Megatron keeps equal are not."""


def load_ranks(out_dir: str | Path, step: int) -> list[dict]:
    """Every rank's record of ``step`` (``out_dir/step{step}.rank{r}.pt``), by rank."""
    files = sorted(Path(out_dir).glob(f"step{step}.rank*.pt"),
                   key=lambda p: int(p.name.split("rank")[1].split(".")[0]))
    return [torch.load(f) for f in files]


def _global_name(name: str, layers: dict, ep: int, local_experts: int) -> str:
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name
    rest = m.group(2)
    e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
    if e:
        rest = f"mlp.experts.{ep * local_experts + int(e.group(1))}.{e.group(2)}"
    return f"layers.{layers[m.group(1)]}.{rest}"


def _by_tp(ranks: list[dict], local_experts: int) -> dict[str, dict[int, torch.Tensor]]:
    """Global Megatron name -> {tp rank: tensor}; replicas (DP, EP copies of dense
    weights) checked equal."""
    out: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for r in ranks:
        for name, t in r["state"].items():
            g = _global_name(name, r["layers"], r["ep"], local_experts)
            seen = out[g].get(r["tp"])
            if seen is not None and not torch.equal(seen, t):
                raise ReplicaMismatch(f"{g}: replicas differ (rank {r['rank']})")
            out[g][r["tp"]] = t
    return out


def _same(shards: dict[int, torch.Tensor], name: str) -> torch.Tensor:
    first = shards[0]
    for tp, t in shards.items():
        if not torch.equal(first, t):
            raise ReplicaMismatch(f"{name}: TP rank {tp}'s copy differs from TP rank 0's")
    return first


def to_hf(ranks: list[dict], *, vocab: int, heads: int, groups: int, head_dim: int,
          experts: int = 0) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of one step, from every rank's saved shards."""
    ep_size = 1 + max(r["ep"] for r in ranks)
    local_experts = experts // ep_size if experts else 0
    hf: dict[str, torch.Tensor] = {}
    for name, shards in _by_tp(ranks, local_experts).items():
        cat0 = torch.cat([shards[k] for k in sorted(shards)], 0)
        cat1 = (torch.cat([shards[k] for k in sorted(shards)], 1)
                if cat0.dim() == 2 else None)
        if name == "embedding.word_embeddings.weight":
            hf["model.embed_tokens.weight"] = cat0[:vocab]
            continue
        if name == "output_layer.weight":
            hf["lm_head.weight"] = cat0[:vocab]
            continue
        if name == "decoder.final_layernorm.weight":
            hf["model.norm.weight"] = _same(shards, name)
            continue
        m = re.match(r"layers\.(\d+)\.(.*)$", name)
        if not m:
            raise KeyError(f"the reference converter does not know {name}")
        p, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest == "input_layernorm.weight":
            hf[p + "input_layernorm.weight"] = _same(shards, name)
        elif rest == "pre_mlp_layernorm.weight":
            hf[p + "post_attention_layernorm.weight"] = _same(shards, name)
        elif rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
            hf[p + f"self_attn.{rest.split('.')[1][0]}_norm.weight"] = _same(shards, name)
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            qpg = heads // groups
            grid = cat0.reshape(groups, qpg + 2, head_dim, *cat0.shape[1:])
            hf[p + f"self_attn.q_proj.{kind}"] = grid[:, :qpg].reshape(heads * head_dim,
                                                                        *cat0.shape[1:])
            hf[p + f"self_attn.k_proj.{kind}"] = grid[:, qpg].reshape(groups * head_dim,
                                                                       *cat0.shape[1:])
            hf[p + f"self_attn.v_proj.{kind}"] = grid[:, qpg + 1].reshape(groups * head_dim,
                                                                           *cat0.shape[1:])
        elif rest == "self_attention.linear_proj.weight":
            hf[p + "self_attn.o_proj.weight"] = cat1
        elif rest == "mlp.router.weight":
            hf[p + "mlp.gate.weight"] = _same(shards, name)
        elif rest.endswith("linear_fc1.weight"):
            owner = p + rest[: -len("linear_fc1.weight")]  # "mlp." or "mlp.experts.{e}."
            halves = [shards[k].chunk(2, 0) for k in sorted(shards)]
            hf[owner + "gate_proj.weight"] = torch.cat([h[0] for h in halves])
            hf[owner + "up_proj.weight"] = torch.cat([h[1] for h in halves])
        elif rest.endswith("linear_fc2.weight"):
            hf[p + rest[: -len("linear_fc2.weight")] + "down_proj.weight"] = cat1
        else:
            raise KeyError(f"the reference converter does not know {name}")
    return hf
