"""The refit into a vLLM engine loaded from an FP8 block checkpoint, against vLLM's own
weight loaders, with no FP8 kernel (vLLM 0.32's CPU ones need AMX): a tiny Qwen3 with
``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
"activation_scheme": "dynamic"}`` over TP2. The trainer's bf16 tensors are FSDP2 rows
on 3 ranks, or Megatron-Core TP4 (the layouts ``reshard.integrations.megatron`` gives:
q, k, v interleaved by query group), blocks split across ranks either way; each trainer
rank quantizes its own pieces (the amax of split blocks exchanged), the refit's plan
moves FP8 codes and scale rows to the engine ranks, and the mapping writes them into
each rank's logical ``qkv_proj`` / ``gate_up_proj`` / ``o_proj`` / ``down_proj``
``weight`` and ``weight_scale_inv``. Those
are compared bit for bit with what vLLM's real ``QKVParallelLinear``,
``MergedColumnParallelLinear`` and ``RowParallelLinear`` (built with vLLM's ``Fp8Config``
at that TP rank) load from the full reference-quantized checkpoint: the weight shard
and the block-scale narrowing of every part. The layers' FP8 GEMM kernel, which nothing
here calls, is stubbed out (the only stand-in: it cannot be built without AMX)."""

from __future__ import annotations

import types

import pytest
import torch

import reshard as R
from reshard import planner
from reshard.errors import Fp8BlockError, MappingError
from reshard.integrations.megatron import Coords, hf_entries
from reshard.integrations.vllm.mapping import check_family, hf_to_vllm
from reshard.local import execute_local
from reshard.quant import BlockFormat, quantize_reference, quantize_shards
from reshard.quant.targets import plan_fp8_refit, scale_name

FMT = BlockFormat((128, 128))
QUANT = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
H, HEADS, KV, HD, INTER, TP = 256, 4, 4, 64, 512, 2
CFG = {"model_type": "qwen3", "hidden_size": H, "num_attention_heads": HEADS,
       "num_key_value_heads": KV, "head_dim": HD, "intermediate_size": INTER,
       "num_hidden_layers": 1, "vocab_size": 300, "tie_word_embeddings": False,
       "quantization_config": QUANT}
ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"
#: vLLM layer -> (its HF parts with their loader shard ids)
LAYERS = {f"{ATTN}.qkv_proj": [(f"{ATTN}.{p}_proj", p) for p in "qkv"],
          f"{MLP}.gate_up_proj": [(f"{MLP}.gate_proj", 0), (f"{MLP}.up_proj", 1)],
          f"{ATTN}.o_proj": [(f"{ATTN}.o_proj", None)],
          f"{MLP}.down_proj": [(f"{MLP}.down_proj", None)]}


def random_state(cfg) -> dict[str, torch.Tensor]:
    """The trainer's full bf16 tensors of ``cfg`` (a test builds them; the refit never
    does): random, the rows of each matrix scaled over 2**-6..2**5."""
    g = torch.Generator().manual_seed(27)
    out = {}
    for name, t in hf_to_vllm(cfg, TP).tensors.items():
        if name.endswith("_scale_inv"):
            continue
        x = torch.randn(t.shape, generator=g)
        if x.dim() == 2:
            x *= 2.0 ** torch.randint(-6, 6, (x.shape[0], 1), generator=g)
        out[name] = x.bfloat16()
    return out


def _full_state():
    out = random_state(CFG)
    out[f"{ATTN}.k_proj.weight"][:128, :128] = 0  # an all-zero block
    return out


def _vllm_layers(rank: int, monkeypatch) -> dict[str, torch.nn.Module]:
    """vLLM's own linear layers of the FP8 checkpoint at TP rank ``rank`` of ``TP``."""
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8",
                              reason="vLLM is not installed")
    import vllm.distributed
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    for module in (linear, parameter, vllm.distributed):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank,
                            raising=False)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: TP,
                            raising=False)
    monkeypatch.setattr(fp8, "init_fp8_linear_kernel", lambda **_: None)  # needs AMX
    config = VllmConfig()
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    quant = fp8.Fp8Config.from_config(QUANT)
    with set_current_vllm_config(config):
        return {
            f"{ATTN}.qkv_proj": linear.QKVParallelLinear(
                H, HD, HEADS, KV, bias=False, quant_config=quant, prefix=f"{ATTN}.qkv_proj"),
            f"{MLP}.gate_up_proj": linear.MergedColumnParallelLinear(
                H, [INTER, INTER], bias=False, quant_config=quant,
                prefix=f"{MLP}.gate_up_proj"),
            f"{ATTN}.o_proj": linear.RowParallelLinear(
                HEADS * HD, H, bias=False, quant_config=quant, prefix=f"{ATTN}.o_proj"),
            f"{MLP}.down_proj": linear.RowParallelLinear(
                INTER, H, bias=False, quant_config=quant, prefix=f"{MLP}.down_proj")}


def _load_checkpoint(layers, checkpoint) -> None:
    """What vLLM's ``load_weights`` does with each checkpoint tensor of these layers."""
    for prefix, parts in LAYERS.items():
        layer = layers[prefix]
        for hf, shard in parts:
            for suffix in ("weight", "weight_scale_inv"):
                param = getattr(layer, suffix)
                args = () if shard is None else (shard,)
                param.weight_loader(param, checkpoint[f"{hf}.{suffix}"], *args)


def _fsdp2(full) -> dict[str, R.Layout]:
    """FSDP2 rows over 3 ranks (86, 86, 84 of 256 rows: blocks on two ranks)."""
    mesh = R.Mesh(list(range(3)))
    return {n: R.Layout(tuple(t.shape), mesh, [R.Shard(0)], "bfloat16")
            for n, t in full.items()}


def _megatron(full, tp: int = 4) -> dict[str, R.Layout]:
    """Megatron-Core TP4 (``reshard.integrations.megatron``'s own layouts): each rank's
    ``linear_qkv`` holds one query group's q, k, v rows (64 each: a 128-row block of q
    on two ranks), ``linear_fc1`` its [gate; up], ``linear_proj`` / ``linear_fc2`` its
    columns; the rest replicated."""
    mesh = R.Mesh(list(range(tp)))
    out = {n: R.Layout(tuple(t.shape), mesh, [R.Replicate()], "bfloat16")
           for n, t in full.items()}
    local = {"self_attention.linear_qkv": ((HEADS + 2 * KV) * HD // tp, H),
             "self_attention.linear_proj": (H, HEADS * HD // tp),
             "mlp.linear_fc1": (2 * INTER // tp, H), "mlp.linear_fc2": (H, INTER // tp)}
    views: dict[str, dict] = {}
    for rank in range(tp):
        coords = Coords(hidden=H, heads=HEADS, groups=KV, head_dim=HD, vocab=300,
                        tp_rank=rank, tp_size=tp)
        for name, shape in local.items():
            for e in hf_entries(f"decoder.layers.0.{name}.weight", shape, coords):
                views.setdefault(e.name, {})[rank] = e.view
    for name, by_rank in views.items():
        out[name] = R.Layout.explicit(tuple(full[name].shape), by_rank, "bfloat16")
    return out


def _refit_locally(full, mapping, fmt, trainer):
    """What each engine rank receives: trainer ranks quantize their own pieces (the
    amax of split blocks exchanged, in process), the refit's plan moves codes and
    scales; returns engine rank -> HF name -> local tensor. A tensor may be held by
    some of the trainer's ranks only (Megatron's experts)."""
    n = 1 + max(r for lay in trainer.values() for r in lay.ranks)
    engine = {name: lay.shifted(n) for name, lay in mapping.layouts.items()}
    src, plan8 = plan_fp8_refit(trainer, engine, fmt, tuple(range(n)), n)
    assert plan8 is not None
    locals_ = {r: {name: lay.shard(full[name], r) for name, lay in trainer.items()
                   if r in lay.ranks} for r in range(n)}
    for t in plan8.plan.tensors:
        shards = quantize_shards({r: locals_[r][t.name] for r in trainer[t.name].ranks},
                                 trainer[t.name], t, fmt)
        for r, shard in shards.items():
            locals_[r][t.name] = shard.qdata
            locals_[r][scale_name(t.name)] = shard.scale_local
    got = execute_local(planner.plan(src, engine, allow_cast=True), locals_)
    return {r - n: v for r, v in got.items()}, plan8


def refit_against_reference(full, mapping, trainer, fmt=FMT):
    """The full reference-quantized checkpoint of ``full`` (what the engine's own
    loaders are fed), and what each engine rank receives from the ``trainer`` layouts
    (:func:`_refit_locally`)."""
    checkpoint = {}
    for name, x in full.items():
        if scale_name(name) in mapping.tensors:
            checkpoint[name], checkpoint[scale_name(name)] = quantize_reference(x, fmt)
    return (checkpoint, *_refit_locally(full, mapping, fmt, trainer))


def received_logical(mapping, rank: int, received) -> dict[str, torch.Tensor]:
    """Engine rank ``rank``'s logical tensors, written by the mapping from what it
    received."""
    logical = mapping.allocate(rank)
    for name, view in mapping.targets(rank, logical).items():
        view.copy_(received[rank][name])
    return logical


@pytest.mark.parametrize("trainer", ["fsdp2", "megatron_tp4"])
def test_every_engine_rank_gets_what_vllms_loaders_take_from_the_fp8_checkpoint(
        monkeypatch, trainer):
    # an FP8 block checkpoint of a checked family needs no opt-in: its refit ran end to end
    # on a host with AMX (tests/integration/test_vllm_fp8.py)
    monkeypatch.delenv("RESHARD_UNCHECKED_FAMILIES", raising=False)
    assert check_family(CFG) == "qwen3"
    mapping = hf_to_vllm(CFG, TP)
    full = _full_state()
    checkpoint, received, plan8 = refit_against_reference(
        full, mapping, (_fsdp2 if trainer == "fsdp2" else _megatron)(full))
    # FSDP2's rows cut blocks (86, 86, 84 rows); so do Megatron's 64-row query groups
    assert plan8.plan.num_shared > 0
    for rank in range(TP):
        logical = received_logical(mapping, rank, received)
        layers = _vllm_layers(rank, monkeypatch)
        _load_checkpoint(layers, checkpoint)
        for prefix, layer in layers.items():
            ours = logical[f"{prefix}.weight"]
            assert ours.dtype == layer.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(ours.view(torch.uint8), layer.weight.data.view(torch.uint8)), (
                rank, prefix)
            scales = logical[f"{prefix}.weight_scale_inv"]
            assert scales.shape == layer.weight_scale_inv.shape, (rank, prefix)
            assert torch.equal(scales.view(torch.int32),
                               layer.weight_scale_inv.data.view(torch.int32)), (rank, prefix)


def test_splits_vllm_refuses_or_serves_wrong_are_refused_by_name():
    """An engine rank's rows or columns not whole blocks (vLLM refuses to load it), and
    a fused part that does not start on a block row (vLLM loads it and serves one part
    with another's scale, vllm#52915): refused by name, before any refit."""
    with pytest.raises(Fp8BlockError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight': "
                                            r"engine rank 0 holds an output size \(rows\) "
                                            r"of 192 of 384"):
        hf_to_vllm(dict(CFG, intermediate_size=384), TP)
    with pytest.raises(Fp8BlockError, match=r"'model.layers.0.self_attn.q_proj.weight': "
                                            r"engine rank 0 holds an output size \(rows\) "
                                            r"of 192 of 384"):
        hf_to_vllm(dict(CFG, num_attention_heads=6, num_key_value_heads=6), TP)
    with pytest.raises(MappingError, match=r"^model.layers.0.self_attn.k_proj.weight: it "
                                           r"fills rows 256..320 of .*qkv_proj.weight .*"
                                           r"vllm#52915"):
        hf_to_vllm(dict(CFG, num_key_value_heads=1), 1)
    moe = dict(CFG, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[])
    fused = {"model.layers.0.mlp.experts.gate_up_proj": (4, 512, H),
             "model.layers.0.mlp.experts.down_proj": (4, H, 256)}
    with pytest.raises(Fp8BlockError, match=r"tensor 'model.layers.0.mlp.experts.gate_up_proj"
                                            r"': .* one 3-D tensor \[4, 512, 256\]"):
        hf_to_vllm(moe, TP, {"model.layers.0.mlp.experts.w13_weight": (4, 256, H),
                             "model.layers.0.mlp.experts.w13_weight_scale_inv": (4, 2, 2)},
                   hf_tensors=fused)
    with pytest.raises(MappingError, match=r"reshard refits FP8 block checkpoints only"):
        hf_to_vllm(dict(CFG, quantization_config={"quant_method": "fp8"}), TP)


def test_attention_scales_vllm_sets_itself_need_no_trainer_tensor():
    """A quantized model's attention layers carry q/k/v/prob scales vLLM sets to 1.0 when
    the checkpoint has none (what the FP8 engine test met on a host with AMX): nothing
    of the trainer fills them and the refit leaves them as a fresh engine has them; any
    other parameter no trainer tensor fills is still named."""
    mapping = hf_to_vllm(CFG, TP)
    scales = [f"model.layers.0.self_attn.attn.{s}_scale" for s in ("q", "k", "v", "prob")]
    assert mapping.uncovered([*mapping.param_shapes, *scales]) == []
    stray = "model.layers.0.self_attn.attn.o_scale"
    assert mapping.uncovered([*mapping.param_shapes, *scales, stray]) == [stray]
