"""HF -> vLLM mapping of MLA (DeepSeek-V3), Mamba2 hybrids (NemotronH) and Gemma 3: each
rank's logical vLLM tensors built through the mapping equal those sliced and
concatenated here by hand, the way vLLM's loaders do (``fused_qkv_a_proj`` = [q_a |
kv_a], column-parallel ``q_b_proj`` / ``kv_b_proj``; Mamba ``in_proj`` = [z | x | B | C |
dt] and ``conv1d`` = [x | B | C], each block split over the ranks; ``A`` from ``A_log``).
Also what keeps vLLM's Gemma 2 (its LM head is the embedding module) exact: that
embedding reloaded, not written in place, and the weight check of packed GEMMs."""

from __future__ import annotations

import pytest
import torch

from reshard.integrations.vllm_mapping import MappingError, hf_to_vllm

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


def test_a_stale_packed_gemm_is_found_by_the_weight_check():
    """``reshard_verify``'s packed-GEMM check: a linear whose weight changed after vLLM
    packed its CPU GEMM copy computes with the old weights; the check applies both the
    live copy and one packed fresh from the reference to one input and names it."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from reshard.integrations.vllm import packed_gemm_mismatches

    g = torch.Generator().manual_seed(0)
    old, new = (torch.randn(64, 32, generator=g).bfloat16() for _ in range(2))
    model = torch.nn.Module()
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(old.clone(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(model.proj, remove_weight=False)  # vLLM's own packing
    assert packed_gemm_mismatches(model, {"proj.weight": old}, {}) == []
    model.proj.weight.data.copy_(new)  # written in place: the packed copy is stale
    assert packed_gemm_mismatches(model, {"proj.weight": new}, {}) == ["proj (packed GEMM)"]
    dispatch_cpu_unquantized_gemm(model.proj, remove_weight=False)  # what a reload does
    assert packed_gemm_mismatches(model, {"proj.weight": new}, {}) == []
