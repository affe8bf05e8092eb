"""HF -> vLLM mapping of MLA (DeepSeek-V3), Mamba2 hybrids (NemotronH), Gemma 3 and
Mixtral: each rank's logical vLLM tensors built through the mapping equal those sliced
and concatenated here by hand, the way vLLM's loaders do (``fused_qkv_a_proj`` = [q_a |
kv_a], column-parallel ``q_b_proj`` / ``kv_b_proj``; Mamba ``in_proj`` = [z | x | B | C |
dt] and ``conv1d`` = [x | B | C], each block split over the ranks; ``A`` from ``A_log``;
Mixtral's router and experts in ``block_sparse_moe``). Also what keeps a family the rules
only half know from refitting wrong without a word: the family gate, the embedding that
is itself the LM head, the weight check of packed GEMMs."""

from __future__ import annotations

import pytest
import torch

from reshard.integrations.vllm.mapping import (
    UNCHECKED_FAMILIES_ENV,
    MappingError,
    check_family,
    hf_to_vllm,
)

H = 16
MLA = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 4,
       "q_lora_rank": 4, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
       "v_head_dim": 4, "vocab_size": 64, "n_routed_experts": 2, "moe_intermediate_size": 8}
MAMBA = {"hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 4, "mamba_num_heads": 4, "mamba_head_dim": 4, "n_groups": 2,
         "ssm_state_size": 4, "vocab_size": 64}


def random_state(shapes: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def blocks(t: torch.Tensor, sizes, tp: int, r: int) -> torch.Tensor:
    return torch.cat([b.chunk(tp)[r] for b in t.split(sizes)])


def test_mla_fuses_q_a_and_kv_a_and_splits_the_up_projections():
    a = "model.layers.0.self_attn"
    shapes = {f"{a}.q_a_proj.weight": (4, H), f"{a}.q_a_layernorm.weight": (4,),
              f"{a}.q_b_proj.weight": (4 * 8, 4), f"{a}.kv_a_proj_with_mqa.weight": (12, H),
              f"{a}.kv_a_layernorm.weight": (8,), f"{a}.kv_b_proj.weight": (4 * 8, 8),
              f"{a}.o_proj.weight": (H, 4 * 4),
              "model.layers.0.mlp.gate.e_score_correction_bias": (2,),
              "model.layers.0.mlp.shared_experts.gate_proj.weight": (8, H),
              "model.layers.0.mlp.shared_experts.up_proj.weight": (8, H)}
    sd = random_state(shapes)
    mapping = hf_to_vllm(MLA, 2, hf_tensors=shapes, dtype="bfloat16")
    assert mapping.param_dtypes["model.layers.0.mlp.gate.e_score_correction_bias"] == "float32"
    for r in range(2):
        got = mapping.load_full(sd, r)
        want = {f"{a}.fused_qkv_a_proj.weight": torch.cat([sd[f"{a}.q_a_proj.weight"],
                                                           sd[f"{a}.kv_a_proj_with_mqa.weight"]]),
                f"{a}.q_b_proj.weight": sd[f"{a}.q_b_proj.weight"].chunk(2)[r],
                f"{a}.kv_b_proj.weight": sd[f"{a}.kv_b_proj.weight"].chunk(2)[r],
                f"{a}.o_proj.weight": sd[f"{a}.o_proj.weight"].chunk(2, dim=1)[r],
                "model.layers.0.mlp.shared_experts.gate_up_proj.weight": torch.cat([
                    sd[f"model.layers.0.mlp.shared_experts.{w}_proj.weight"].chunk(2)[r]
                    for w in ("gate", "up")])}
        for name, t in want.items():
            assert torch.equal(got[name].float(), t.bfloat16().float()), name
        bias = got["model.layers.0.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32
        assert torch.equal(bias, sd["model.layers.0.mlp.gate.e_score_correction_bias"])


def test_mamba2_blocks_split_per_rank_and_a_is_converted_on_commit():
    m = "model.layers.0.mixer"
    inner, bc, heads = 16, 2 * 4, 4
    shapes = {f"{m}.in_proj.weight": (2 * inner + 2 * bc + heads, H),
              f"{m}.conv1d.weight": (inner + 2 * bc, 1, 4), f"{m}.conv1d.bias": (inner + 2 * bc,),
              f"{m}.A_log": (heads,), f"{m}.D": (heads,), f"{m}.dt_bias": (heads,),
              f"{m}.norm.weight": (inner,), f"{m}.out_proj.weight": (H, inner),
              "model.layers.0.norm.weight": (H,), "model.embeddings.weight": (64, H),
              "model.norm_f.weight": (H,)}
    sd = random_state(shapes)
    mapping = hf_to_vllm(MAMBA, 2, hf_tensors=shapes, dtype="float32")
    assert mapping.converts == {f"{m}.A": "neg_exp"}
    for r in range(2):
        got = mapping.load_full(sd, r)
        assert torch.equal(got[f"{m}.in_proj.weight"],
                           blocks(sd[f"{m}.in_proj.weight"], [inner, inner, bc, bc, heads], 2, r))
        for kind in ("weight", "bias"):
            assert torch.equal(got[f"{m}.conv1d.{kind}"],
                               blocks(sd[f"{m}.conv1d.{kind}"], [inner, bc, bc], 2, r))
        for name in ("D", "dt_bias", "norm.weight"):
            assert torch.equal(got[f"{m}.{name}"], sd[f"{m}.{name}"].chunk(2)[r])
        assert torch.equal(got[f"{m}.A"], sd[f"{m}.A_log"].chunk(2)[r])  # converted on commit
        assert torch.equal(got[f"{m}.out_proj.weight"], sd[f"{m}.out_proj.weight"].chunk(2, 1)[r])
        assert torch.equal(got["model.embed_tokens.weight"],
                           sd["model.embeddings.weight"].chunk(2)[r])
    with pytest.raises(MappingError, match=r"n_groups \(2\) is not divisible .* size 4"):
        hf_to_vllm(MAMBA, 4, hf_tensors=shapes)


def test_gemma3_norms_are_replicated():
    names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm"]
    shapes = {f"model.layers.0.{n}.weight": (H,) for n in names}
    mapping = hf_to_vllm({"hidden_size": H, "num_attention_heads": 4}, 2, hf_tensors=shapes)
    for r in range(2):
        assert mapping.shard_bytes(r) == 4 * H * 2  # four bf16 norms, whole on every rank


def test_an_attention_that_dropped_its_weight_after_loading_is_refused_by_name():
    """vLLM CPU's AMX MLA backend packs its own copies of ``kv_b_proj`` and leaves the
    parameter empty: no reload can refill it, so the refit is refused before the mapping,
    naming the layer and the backend that keeps it."""
    pytest.importorskip("vllm")  # the integration module imports vLLM's backend classes
    from reshard.integrations.vllm import refuse_unreloadable

    attn = torch.nn.Module()
    attn.kv_b_proj = torch.nn.Linear(8, 32, bias=False)
    attn.is_amx_bmm_enabled = False  # the reference backend: kv_b_proj kept
    model = torch.nn.Sequential(attn)
    refuse_unreloadable(model)
    attn.is_amx_bmm_enabled = True
    with pytest.raises(MappingError, match=r"^0: .*kv_b_proj.*CPU_MLA"):
        refuse_unreloadable(model)


MIXTRAL = {"model_type": "mixtral", "hidden_size": H, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 4, "num_local_experts": 2,
           "intermediate_size": 8, "vocab_size": 64}


def test_mixtral_router_and_experts_land_in_vllms_block_sparse_moe():
    """transformers 5 keeps Mixtral's router under ``mlp.gate`` and its experts fused
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); its checkpoint
    and vLLM say ``block_sparse_moe`` (experts ``w1`` gate, ``w3`` up, ``w2`` down). Both
    name sets map to the same vLLM tensors, equal to the hand-made slices."""
    p, e, i = "model.layers.0", 2, 8
    fused = {f"{p}.mlp.gate.weight": (e, H), f"{p}.mlp.experts.gate_up_proj": (e, 2 * i, H),
             f"{p}.mlp.experts.down_proj": (e, H, i)}
    sd = random_state(fused)
    disk = {f"{p}.block_sparse_moe.gate.weight": sd[f"{p}.mlp.gate.weight"]}
    for x in range(e):
        gate, up = sd[f"{p}.mlp.experts.gate_up_proj"][x].chunk(2)
        disk.update({f"{p}.block_sparse_moe.experts.{x}.w1.weight": gate,
                     f"{p}.block_sparse_moe.experts.{x}.w3.weight": up,
                     f"{p}.block_sparse_moe.experts.{x}.w2.weight":
                         sd[f"{p}.mlp.experts.down_proj"][x]})
    a = hf_to_vllm(MIXTRAL, 2, hf_tensors=fused, dtype="float32")
    b = hf_to_vllm(MIXTRAL, 2, hf_tensors={n: tuple(t.shape) for n, t in disk.items()},
                   dtype="float32")
    assert a.param_shapes == b.param_shapes
    w13 = next(n for n in a.param_shapes if n.endswith("w13_weight"))
    w2 = next(n for n in a.param_shapes if n.endswith(".w2_weight"))
    assert w13.startswith(f"{p}.block_sparse_moe.experts.") and not any(
        ".mlp." in n for n in a.param_shapes)
    for r in range(2):
        got, got_disk = a.load_full(sd, r), b.load_full(disk, r)
        assert torch.equal(got[f"{p}.block_sparse_moe.gate.weight"], disk[
            f"{p}.block_sparse_moe.gate.weight"])
        for x in range(e):
            want13 = torch.cat([disk[f"{p}.block_sparse_moe.experts.{x}.{w}.weight"].chunk(2)[r]
                                for w in ("w1", "w3")])
            want2 = disk[f"{p}.block_sparse_moe.experts.{x}.w2.weight"].chunk(2, dim=1)[r]
            assert torch.equal(got[w13][x], want13) and torch.equal(got_disk[w13][x], want13)
            assert torch.equal(got[w2][x], want2) and torch.equal(got_disk[w2][x], want2)


def test_a_family_never_checked_end_to_end_is_refused_unless_the_caller_opts_in(
        monkeypatch):
    """A family whose names and shapes all map can still refit wrong (vLLM's Gemma 2 makes
    its logits from a packed copy of the embedding): only the families checked end to
    end pass unasked; any other is refused by name, with the way to opt in."""
    monkeypatch.delenv(UNCHECKED_FAMILIES_ENV, raising=False)
    for family in ("gemma2", "mixtral", "qwen3", "gemma3_text"):
        assert check_family({"model_type": family}) == family
    with pytest.raises(MappingError) as e:
        check_family({"model_type": "phi3", "hidden_size": H})
    assert str(e.value).startswith(
        "model_type 'phi3' is not among the families whose refit into vLLM was checked end "
        "to end (deepseek_v3, gemma2, gemma3_text, llama, mistral, mixtral, nemotron_h, "
        "qwen2, qwen3, qwen3_moe): ")
    assert ("pass unchecked_family_ok=True to reshard_init (or ReshardInitInfo) or set "
            "RESHARD_UNCHECKED_FAMILIES=1" in str(e.value))
    assert check_family({"model_type": "phi3"}, unchecked_ok=True) == "phi3"
    # a multimodal wrapper is its own family, not its (checked) text model's
    with pytest.raises(MappingError, match=r"^model_type 'gemma3' is not among"):
        check_family({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
                                                              "hidden_size": H}})
    monkeypatch.setenv(UNCHECKED_FAMILIES_ENV, "1")
    assert check_family({"model_type": "phi3"}) == "phi3"
    # a loading the rules do not model is refused even with the opt-in
    with pytest.raises(MappingError, match=r"^qwen3: the config sets quantization_config "
                                           r"\(a quantized checkpoint"):
        check_family({"model_type": "qwen3", "quantization_config": {"quant_method": "fp8"}},
                     unchecked_ok=True)


def test_the_meeting_refuses_an_unchecked_family_before_mapping():
    """``map_or_explain`` (what every vLLM rank runs at the meeting) refuses it first."""
    pytest.importorskip("vllm")
    from reshard.integrations.vllm import map_or_explain

    cfg = {"model_type": "phi3", "hidden_size": H, "num_attention_heads": 4}
    shapes = {"model.norm.weight": (H,)}
    with pytest.raises(MappingError, match=r"^model_type 'phi3' is not among"):
        map_or_explain(cfg, 2, shapes, shapes, "float32")
    mapping = map_or_explain(cfg, 2, shapes, shapes, "float32", unchecked_family_ok=True)
    assert mapping.param_shapes == shapes


class VocabParallelEmbedding(torch.nn.Module):
    """Stands for vLLM's class of that name (the integration looks at the type name)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.quant_method = object()


class ParallelLMHead(VocabParallelEmbedding):
    pass


def test_an_embedding_that_is_the_lm_head_is_not_written_in_place():
    """vLLM's Gemma 2 has no LM head module: its logits come from the embedding module,
    through the GEMM copy vLLM CPU packs of it after loading. Written in place, the
    embedding would change and its copy (so the logits) would not: it must be reloaded.
    With an LM head of its own, the embedding is only looked up and stays in place."""
    pytest.importorskip("vllm")
    from reshard.integrations.vllm import has_own_lm_head, kept_live

    model = torch.nn.Module()
    model.embed_tokens = VocabParallelEmbedding()
    where = {"embed_tokens.weight": ("embed_tokens", "weight", (8, 4), torch.float32)}
    assert not has_own_lm_head(model) and kept_live(model, where) == set()
    model.lm_head = ParallelLMHead()
    assert has_own_lm_head(model) and kept_live(model, where) == {"embed_tokens.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stale_packed_gemm_is_found_by_the_weight_check(dtype):
    """``reshard_verify``'s packed-GEMM check: a linear whose weight changed after vLLM
    packed its CPU GEMM copy computes with the old weights; the check applies both the
    live copy and one packed fresh from the reference to one input and names it. Where
    this host's vLLM packs no copy (bf16 on an AVX2-only host: ``_cpu_gemm``) the GEMM
    reads the live weight: nothing is stale and the check says so, yet still names a
    live weight that is not the reference."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from reshard.integrations.vllm import packed_gemm_mismatches

    from ._cpu_gemm import packs_a_copy

    g = torch.Generator().manual_seed(0)
    old, new = (torch.randn(64, 32, generator=g).to(dtype) for _ in range(2))
    x = torch.randn(3, 32, generator=g).to(dtype)
    model = torch.nn.Module()
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(old.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(model.proj, remove_weight=False)  # vLLM's own packing
    before = model.proj.cpu_linear(x, model.proj.weight, None)
    assert packed_gemm_mismatches(model, {"proj.weight": old}, {}) == []
    model.proj.weight.data.copy_(new)  # written in place: a packed copy is now stale
    packed = torch.equal(model.proj.cpu_linear(x, model.proj.weight, None), before)
    assert packed or not packs_a_copy(dtype)  # float32: the stale case on every host
    if packed:
        assert packed_gemm_mismatches(model, {"proj.weight": new}, {}) == [
            "proj (packed GEMM)"]
    else:  # F.linear of the live weight: the new weights are read, the old ones refused
        assert packed_gemm_mismatches(model, {"proj.weight": new}, {}) == []
        assert packed_gemm_mismatches(model, {"proj.weight": old}, {}) == [
            "proj (packed GEMM)"]
    dispatch_cpu_unquantized_gemm(model.proj, remove_weight=False)  # what a reload does
    assert packed_gemm_mismatches(model, {"proj.weight": new}, {}) == []


def test_a_gemm_vllm_does_not_pack_is_checked_as_a_plain_gemm():
    """MLA's ``kv_b_proj`` (``_cpu_skip_gemm_dispatch``): vLLM CPU packs no copy and runs
    a plain GEMM of the live weight; the check does the same with the reference (a packed
    GEMM there differs from the plain one in the last bits of float32)."""
    pytest.importorskip("vllm")
    from reshard.integrations.vllm import packed_gemm_mismatches

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g)
    model = torch.nn.Module()
    model.kv_b_proj = torch.nn.Module()
    model.kv_b_proj.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
    model.kv_b_proj._cpu_skip_gemm_dispatch = True
    model.kv_b_proj.cpu_linear = torch.nn.functional.linear  # as vLLM sets it
    assert packed_gemm_mismatches(model, {"kv_b_proj.weight": w}, {}) == []
    stale = {"kv_b_proj.weight": w + 1}
    assert packed_gemm_mismatches(model, stale, {}) == ["kv_b_proj (packed GEMM)"]
