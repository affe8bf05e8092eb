"""The refit of a MoE's routed experts into a vLLM engine loaded from an FP8 block
checkpoint, against vLLM's own expert loader, with no FP8 kernel: a tiny Qwen3-MoE (4
experts, hidden 256, ``moe_intermediate_size`` 256) with ``quantization_config =
{"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme":
"dynamic"}`` over TP2 (128 intermediate rows a rank: one scale row of ``w13`` for the
gate half, one for the up half, one scale column of ``w2``). The trainer's bf16 tensors
are FSDP2 rows on 3 ranks, or Megatron-Core experts over EP2 x expert-TP4 on 8 ranks
(``reshard.integrations.megatron``'s own layouts: 2 experts an EP rank, each expert's
``linear_fc1`` [gate; up] rows and ``linear_fc2`` columns in 64s), blocks split across
ranks either way; each trainer rank quantizes its own pieces (the amax of split blocks
exchanged), the refit's plan moves FP8 codes and scale rows to the engine ranks, and
the mapping writes the per-expert checkpoint tensors (``experts.{e}.gate_proj`` /
``up_proj`` / ``down_proj`` ``weight`` and ``weight_scale_inv``) into each rank's
logical ``w13_weight`` / ``w2_weight`` and ``w13_weight_scale_inv`` /
``w2_weight_scale_inv``.

Those are compared bit for bit with what vLLM 0.32's real MoE layer loads from the full
reference-quantized checkpoint at that TP rank: ``FusedMoEFactory`` (what
``Qwen3MoeSparseMoeBlock`` builds) with vLLM's ``Fp8Config``, its ``RoutedExperts``
created by ``Fp8MoEMethod.create_weights``, and the checkpoint fed to the runner's own
``load_weights`` (what the model's ``AutoWeightsLoader`` calls: vLLM's expert mapping,
then ``weight_loader(param, w, weight_name, shard_id, expert_id)`` with the TP narrowing
of weights and of block scales, the w1 / w3 halves' scale row offsets included). No
``process_weights_after_loading``: the checkpoint form is what a refit writes.

Stand-ins, and why: there is no distributed world, so the TP rank comes from
monkeypatched ``get_tensor_model_parallel_rank`` (read by vLLM's
``FusedMoEParallelConfig``) and ``get_tensor_model_parallel_world_size`` (read by
``Fp8MoEMethod.create_weights`` and ``validate_fp8_block_shape_moe``), and the factory
is given ``tp_size``, ``dp_size`` and ``pcp_size`` (its own arguments, instead of the
process groups it would ask); the model config is a namespace with the dtype only, as
in tests/unit/test_fp8_vllm_mapping.py. Nothing else is stubbed: on a CPU vLLM 0.32
picks no FP8 MoE kernel at build time (``Fp8MoeBackend.NONE``), so none needs AMX
here, and nothing calls one."""

from __future__ import annotations

import types

import pytest
import torch

import reshard as R
from reshard.errors import Fp8BlockError, MappingError
from reshard.integrations.megatron import Coords, hf_entries
from reshard.integrations.vllm.mapping import check_family, hf_to_vllm

from .test_fp8_vllm_mapping import (
    QUANT,
    _fsdp2,
    random_state,
    received_logical,
    refit_against_reference,
)

H, HEADS, KV, HD, EXPERTS, INTER, TP = 256, 4, 4, 64, 4, 256, 2
CFG = {"model_type": "qwen3_moe", "hidden_size": H, "num_attention_heads": HEADS,
       "num_key_value_heads": KV, "head_dim": HD, "num_experts": EXPERTS,
       "num_experts_per_tok": 2, "moe_intermediate_size": INTER, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "num_hidden_layers": 1, "vocab_size": 300,
       "tie_word_embeddings": False, "quantization_config": QUANT}
MOE = "model.layers.0.mlp.experts"  # vLLM's prefix of the layer (Qwen3MoeSparseMoeBlock)
PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


def _full_state():
    out = random_state(CFG)
    out[f"{MOE}.1.up_proj.weight"][128:, 128:] = 0  # an all-zero block (rank 1's, up half)
    out[f"{MOE}.2.down_proj.weight"][:128, :128] = 0  # and one of w2 (rank 0's columns)
    return out


def _megatron_experts(full, ep: int = 2, etp: int = 4) -> dict[str, R.Layout]:
    """Megatron-Core MoE on ``ep * etp`` ranks (rank = ep_rank * etp + etp_rank):
    the grouped-GEMM experts ``experts.linear_fc1.weight{i}`` ([gate; up] rows of this
    expert-TP rank: 64 of each, a 128-row block on two ranks) and
    ``experts.linear_fc2.weight{i}`` (64 columns) of EP rank e's experts
    ``e * E_local + i``, through ``reshard.integrations.megatron``'s own rules; the rest
    (attention, router, norms, embeddings) replicated."""
    n, local = ep * etp, EXPERTS // ep
    mesh = R.Mesh(list(range(n)))
    out = {name: R.Layout(tuple(t.shape), mesh, [R.Replicate()], "bfloat16")
           for name, t in full.items()}
    views: dict[str, dict] = {}
    for rank in range(n):
        coords = Coords(hidden=H, heads=HEADS, groups=KV, head_dim=HD, vocab=300,
                        ep_rank=rank // etp, ep_size=ep, etp_rank=rank % etp,
                        etp_size=etp, local_experts=local)
        for i in range(local):
            for name, shape in ((f"linear_fc1.weight{i}", (2 * INTER // etp, H)),
                                (f"linear_fc2.weight{i}", (H, INTER // etp))):
                for e in hf_entries(f"decoder.layers.0.mlp.experts.{name}", shape, coords):
                    views.setdefault(e.name, {})[rank] = e.view
    assert len(views) == 3 * EXPERTS  # every expert's gate, up and down
    for name, by_rank in views.items():
        out[name] = R.Layout.explicit(tuple(full[name].shape), by_rank, "bfloat16")
    return out


def _vllm_experts(rank: int, monkeypatch, inter: int = INTER) -> torch.nn.Module:
    """vLLM's own MoE layer of the FP8 checkpoint at TP rank ``rank`` of ``TP`` (the
    ``MoERunner`` ``FusedMoEFactory`` returns; its weights on ``.routed_experts``)."""
    fp8 = pytest.importorskip("vllm.model_executor.layers.quantization.fp8",
                              reason="vLLM is not installed")
    import vllm.distributed
    import vllm.model_executor.layers.fused_moe.config as moe_config
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    monkeypatch.setattr(moe_config, "get_tensor_model_parallel_rank", lambda: rank)
    for module in (vllm.distributed, fp8):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: TP)
    config = VllmConfig()
    object.__setattr__(config, "model_config", types.SimpleNamespace(dtype=torch.bfloat16))
    with set_current_vllm_config(config):
        runner = FusedMoEFactory(
            num_experts=EXPERTS, top_k=CFG["num_experts_per_tok"], hidden_size=H,
            intermediate_size=inter, quant_config=fp8.Fp8Config.from_config(QUANT),
            prefix=MOE, tp_size=TP, dp_size=1, pcp_size=1)
    experts = runner.routed_experts
    assert type(experts.quant_method).__name__ == "Fp8MoEMethod"
    assert (experts.moe_config.tp_rank, experts.moe_config.tp_size) == (rank, TP)
    return runner


def _load_checkpoint(runner, checkpoint) -> None:
    """What the model's ``AutoWeightsLoader`` does with the experts' checkpoint tensors:
    the runner's ``load_weights``, names relative to it (``0.gate_proj.weight``, ...)."""
    ours = {n[len(MOE) + 1:]: t for n, t in checkpoint.items() if n.startswith(f"{MOE}.")}
    loaded = list(runner.load_weights(ours.items()))
    # every tensor taken once: 3 weights and 3 scale grids an expert
    assert len(loaded) == 6 * EXPERTS
    assert {n.rsplit(".", 1)[1] for n in loaded} == set(PARAMS)


@pytest.mark.parametrize("trainer", ["fsdp2", "megatron_ep2_etp4"])
def test_every_engine_rank_gets_what_vllms_expert_loader_takes_from_the_fp8_checkpoint(
        monkeypatch, trainer):
    # FP8 experts ran end to end nowhere yet: refused without the opt-in, by name
    monkeypatch.delenv("RESHARD_UNCHECKED_FAMILIES", raising=False)
    with pytest.raises(MappingError, match="FP8 block checkpoint with experts.*never checked"):
        check_family(CFG)
    assert check_family(CFG, unchecked_ok=True) == "qwen3_moe"
    mapping = hf_to_vllm(CFG, TP)
    full = _full_state()
    checkpoint, received, plan8 = refit_against_reference(
        full, mapping, (_fsdp2 if trainer == "fsdp2" else _megatron_experts)(full))
    assert sum(n.startswith(f"{MOE}.") for n in checkpoint) == 6 * EXPERTS
    # FSDP2's rows cut blocks (86, 86, 84 rows); so do Megatron's 64-row expert-TP shards
    shared = {t.name for t in plan8.plan.tensors if t.shared}
    assert f"{MOE}.0.gate_proj.weight" in shared and f"{MOE}.3.down_proj.weight" in shared
    for rank in range(TP):
        logical = received_logical(mapping, rank, received)
        runner = _vllm_experts(rank, monkeypatch)
        vllm_params = dict(runner.named_parameters(prefix=MOE))
        _load_checkpoint(runner, checkpoint)
        wrong = []
        for p in PARAMS:
            name = f"{MOE}.routed_experts.{p}"  # vLLM's own name: the mapping's too
            theirs, ours = vllm_params[name].data, logical[name]
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (rank, p)
            bits = torch.uint8 if ours.dtype == torch.float8_e4m3fn else torch.int32
            differ = (ours.view(bits) != theirs.view(bits)).flatten(1).any(1)
            wrong += [(p, e) for e in differ.nonzero().flatten().tolist()]
        assert not wrong, f"engine rank {rank}: (vLLM parameter, expert) differing: {wrong}"
        # the all-zero blocks: code 0 and vLLM's (and the reference's) scale for them
        w13, w2 = (logical[f"{MOE}.routed_experts.{p}"] for p in PARAMS[:2])
        if rank == 1:
            assert not w13[1, 128:, 128:].view(torch.uint8).any()
        else:
            assert not w2[2, :128, :].view(torch.uint8).any()


def test_a_split_vllm_refines_is_refused_by_name(monkeypatch):
    """An engine rank's expert rows not whole blocks (``moe_intermediate_size`` 384 over
    TP2: 192 a rank): vLLM 0.32 loads it on a refined 64 x 64 scale grid (the checkpoint's
    scales repeated, ``resolve_fp8_moe_weight_block_shape``), which reshard's 128 x 128
    scale layouts do not model; reshard refuses it by name, before any refit."""
    runner = _vllm_experts(0, monkeypatch, inter=384)
    assert runner.routed_experts.quant_method.weight_scale_refine == (2, 2)
    assert tuple(runner.routed_experts.w13_weight_scale_inv.shape) == (EXPERTS, 6, 4)
    with pytest.raises(Fp8BlockError, match=rf"tensor '{MOE}.0.gate_proj.weight': engine "
                                            r"rank 0 holds an output size \(rows\) of 192"):
        hf_to_vllm(dict(CFG, moe_intermediate_size=384), TP)
