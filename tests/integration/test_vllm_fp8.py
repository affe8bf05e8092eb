"""An FSDP2 trainer (bf16 checkpoint, float32 master weights) refits a vLLM engine loaded
from an FP8 block checkpoint (``quantization_config`` fp8, ``weight_block_size`` [128,
128], dynamic activations), TP2, end to end. After every refit:

* each engine rank received exactly its FP8 codes and scale rows (and the bf16 norms,
  embedding, LM head), what the mapping gives it, never a full tensor;
* every logical vLLM parameter, ``weight_scale_inv`` included, is bit for bit what vLLM's
  own loaders make of the reference-quantized checkpoint of that step
  (``reshard_verify``);
* the engine's greedy tokens and prompt logprobs equal, bit for bit, those of a fresh
  engine loaded from the reference-quantized FP8 checkpoint of that step.

vLLM 0.32's CPU FP8 block kernels (``CPUFp8BlockScaledMMKernel`` and its W8A8 variant)
need AMX tiles: without them vLLM fails while building the model. On such hosts the
whole module skips and says why; ``tests/unit/test_fp8_vllm_mapping.py`` still checks
every rank's FP8 bytes and scales against vLLM's loaders there, and
``tests/multiproc/test_fp8_refit.py`` the quantizing refit across processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration


def amx_tiles() -> bool:
    """vLLM's own test for its CPU FP8 kernels (``torch.cpu._is_amx_tile_supported``),
    else the processor's ``amx_tile`` flag."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if probe is not None:
        return bool(probe())
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


if not amx_tiles():
    pytest.skip("vLLM 0.32's CPU FP8 block kernels (CPUFp8BlockScaledMMKernel, W8A8 "
                "variant) need a CPU with AMX tiles (Sapphire Rapids or newer); this host "
                "has none, so no FP8 engine can be built here", allow_module_level=True)
try:
    from vllm import LLM  # noqa: F401
except Exception as e:  # ImportError, or a broken install
    pytest.skip(f"vllm is not importable: {e!r}", allow_module_level=True)

from test_vllm_families import close, engine, refit_steps  # noqa: E402
from test_vllm_refit import generate  # noqa: E402

from reshard.integrations import hf  # noqa: E402
from reshard.integrations.vllm.fp8 import fp8_state  # noqa: E402
from reshard.integrations.vllm.mapping import hf_to_vllm  # noqa: E402

TP, STEPS, DTYPE = 2, 2, "bfloat16"
#: every TP2 split on whole 128 x 128 blocks (q, k, v 128 rows a rank, MLP 256)
DIMS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
            intermediate_size=512)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(the trainer's bf16 checkpoint, the engine's FP8 block checkpoint of it)."""
    root = tmp_path_factory.mktemp("fp8_models")
    bf16 = hf.build_tiny_model(root / "qwen3", "qwen3", **DIMS)
    state = hf.load_model(bf16, torch.float32).state_dict()
    return bf16, hf.save_fp8_checkpoint(bf16, state, root / "qwen3_fp8")


def _fp8_reference(state: Path) -> Path:
    """The step's reference FP8 checkpoint, as a state dict (``reshard_verify``'s input)."""
    path = state.with_name(state.stem + "_fp8.pt")
    torch.save(fp8_state(torch.load(state)), path)
    return path


def test_fsdp2_trainer_refits_an_fp8_engine_like_a_fresh_one(checkpoints, tmp_path,
                                                             monkeypatch):
    bf16, fp8_dir = checkpoints
    # no opt-in: an FP8 block checkpoint of a checked family (qwen3) is refitted as is
    monkeypatch.delenv("RESHARD_UNCHECKED_FAMILIES", raising=False)
    # the trainer refits sparse (issue 39): step 1 dense (no base), then only the FP8
    # blocks any element of which changed, each whole with its scale
    records, trainer = refit_steps(bf16, tmp_path, "fsdp", DTYPE, TP, STEPS,
                                   engine_dir=fp8_dir, reference=_fp8_reference,
                                   job_args=("--sparse", "on", "--lr", "1e-3"))
    assert all(e["ok"] for rank_log in trainer for e in rank_log), trainer
    config = json.loads((fp8_dir / "config.json").read_text())
    mapping = hf_to_vllm(config, TP, dtype=DTYPE)
    for step, rec in enumerate(records, 1):
        for rank, res in enumerate(rec["res"]):
            assert res["ok"] and res["committed"] and res["version"] == step, res
            if step == 1:  # dense: FP8 codes + scales, what the mapping gives the rank
                assert res["sparse"] is None, res
                assert res["bytes_received"] == mapping.shard_bytes(rank), res
            else:  # sparse: the encoded bytes its stats count, at most about a dense's
                sparse = res["sparse"]
                assert sparse is not None and res["bytes_received"] == sparse["wire_bytes"]
                print(f"step {step} rank {rank}: {sparse['changed_fraction']:.1%} changed, "
                      f"{res['bytes_received']} B of {mapping.shard_bytes(rank)} dense")
        for v in rec["verify"]:
            assert v["mismatched"] == [] and v["checked"] > 0, v
        state = torch.load(tmp_path / "out" / f"step{step}.pt")
        fresh = engine(hf.save_fp8_checkpoint(bf16, state, tmp_path / f"fresh{step}"), TP,
                       DTYPE, reshard=False, kind="qwen3")
        try:
            assert (rec["tokens"], rec["lps"]) == generate(fresh), step  # exactly
        finally:
            close(fresh)
