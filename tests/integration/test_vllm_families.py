"""More model families refitted end to end into a real vLLM CPU engine, each checked
bit for bit against a fresh engine.

Each case: a trainer job (``_vllm_trainer_job.py``: 2 gloo ranks, FSDP2 or tensor
parallelism, fp32 master weights, AdamW steps) refits a vLLM engine (CPU, TP 1, 2 or 4,
bf16 or fp32). After every refit:

* each vLLM rank received exactly its shard of every tensor (what the mapping computes
  for that rank: fused, padded and replicated tensors included), never a full tensor;
* every logical vLLM parameter is, bit for bit, what vLLM's own loaders make of the
  trainer's full state dict of that step (``reshard_verify``);
* the engine's greedy tokens and prompt logprobs equal, bit for bit, those of a fresh
  engine (same dtype, same TP) loaded from the trainer's checkpoint of that step.

The same engine code on both sides makes the comparison exact in bf16 as in fp32 (a
greedy tie breaks the same way in both). Each case starts two engines (~25-40 s each
on 2 cores), one at a time. The figures of docs/vllm.md's family table come from here:
``pytest tests/integration/test_vllm_families.py -s | grep '^| '``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

CORES = sorted(os.sched_getaffinity(0))
if len(CORES) < 2:
    pytest.skip("the vLLM family tests bind one core per TP rank and need 2 cores",
                allow_module_level=True)
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
try:
    from vllm import LLM
except Exception as e:  # ImportError, or a broken install
    pytest.skip(f"vllm is not importable: {e!r}", allow_module_level=True)

import torch  # noqa: E402
from _engine_procs import start_job  # noqa: E402
from test_vllm_refit import (  # noqa: E402
    EXT,
    JOB,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    close_llm,
    generate,
    serve_long_prompt,
    start_llm,
)

from reshard.integrations import hf  # noqa: E402
from reshard.integrations.vllm import collective  # noqa: E402
from reshard.tools.launch import free_port  # noqa: E402

#: (family, trainer sharding, engine dtype, vLLM TP, refit steps): every family in bf16;
#: in fp32 too where the dtype changes what vLLM computes from the weights at commit
#: (Nemotron-H's Mamba ``A = -exp(A_log)``); a dense model at TP1 (fp32), and with one kv
#: head at TP2 (``llama_1kv``: the kv head replicated on both ranks, as 2 kv heads are at
#: TP4). The other families' fp32 cases map, send and load as their bf16 ones do (the
#: sender casts as the engine's loader casts), and TP4 runs four engine processes on two
#: cores (166 s a case), so they are in MORE_CASES, on a suite that must stay near 25
#: minutes
CASES = [
    ("gemma2", "fsdp", "bfloat16", 2, 1),
    ("mixtral", "fsdp", "bfloat16", 2, 1),
    ("mistral", "tp", "bfloat16", 2, 1),
    ("gemma3", "fsdp", "bfloat16", 2, 1),
    ("deepseek_v3", "fsdp", "bfloat16", 2, 1),
    ("nemotron_h", "fsdp", "bfloat16", 2, 1),
    ("nemotron_h", "fsdp", "float32", 2, 1),
    ("llama", "fsdp", "float32", 1, 1),
    ("llama_1kv", "fsdp", "bfloat16", 2, 1),
]
#: the other dtype of each family, and at TP1 and TP4, run with RESHARD_ALL_FAMILIES=1
MORE_CASES = [
    ("mistral", "tp", "float32", 2, 1),
    ("gemma3", "fsdp", "float32", 2, 1),
    ("deepseek_v3", "fsdp", "float32", 2, 1),
    ("gemma2", "fsdp", "float32", 2, 1),
    ("mixtral", "fsdp", "float32", 2, 1),
    ("llama", "fsdp", "bfloat16", 1, 1),
    ("llama", "fsdp", "bfloat16", 4, 1),
    ("llama", "fsdp", "float32", 4, 1),
]
#: families with routed experts (vLLM CPU's unquantized MoE: a commit prepacks them in place)
MOE_KINDS = ("mixtral", "deepseek_v3")
#: test kinds that are a family's tiny model with other sizes: kind -> (family, overrides)
VARIANTS = {"llama_1kv": ("llama", {"num_key_value_heads": 1})}
if os.environ.get("RESHARD_ALL_FAMILIES") == "1":
    CASES += MORE_CASES


#: Engine options a family needs on every host. MLA (DeepSeek-V3) on vLLM 0.32 CPU:
#: * the AMX MLA backend is picked wherever the processor has AMX; it loads bf16 only and
#:   drops ``kv_b_proj.weight`` after packing it, so no reload can run on it (reshard
#:   refuses it at init, naming this option): the reference ``CPU_MLA`` backend instead;
#: * ``CPU_MLA`` answers requests batched together differently from call to call, even a
#:   fresh engine (its prompt logprobs change from the second position on; measured: three
#:   different answers in six calls on one unchanged engine), and identically one request
#:   at a time: ``max_num_seqs=1`` makes the "same engine, same answer" check exact.
#: NemotronH (Mamba2) on vLLM 0.32 CPU: the Mamba2 prefill kernel
#: (``mamba_chunk_scan_fwd_cpu``) takes another path when a step holds 16 prefill tokens
#: or more, and in float32 a sequence's outputs then differ in the last bits (measured:
#: the 7-token prompt's scan outputs differ between a 15- and a 16-token step in 37 of 50
#: random draws in float32, in none of 50 in bfloat16). ``LLM.generate`` hands its
#: requests over one by one and the engine core starts a step as soon as the first one is
#: there, so the same three prompts are prefilled in one 21-token step or in a 7- and a
#: 15-token step depending on timing: one unchanged engine, a fresh one too, answered the
#: test's prompts with prompt logprobs one float32 ulp apart from one call to the next
#: (the refitted and the fresh engine hold the same parameters and buffers: no refit
#: defect). One request at a time, every step's make-up is fixed and the answers are
#: exact; a user comparing NemotronH answers bit for bit must control this too.
#: NemotronH's prefix caching (vLLM's Mamba 'align' mode) kills vLLM 0.32 CPU's engine
#: core on any prompt longer than a KV block, before any refit ("IndexError: index 18 is
#: out of bounds for dimension 0 with size 1" in mamba_mixer2's conv_ssm_forward, the long
#: prompt of test_vllm_refit): those engines run without a prefix cache, so nothing stale
#: can be read there, and the long prompt still checks a refit over several blocks.
#: vLLM itself turns the prefix cache off for MLA on CPU (DeepSeek-V3's rows).
FAMILY_ENGINE_ARGS = {"deepseek_v3": {"attention_backend": "CPU_MLA", "max_num_seqs": 1},
                      "nemotron_h": {"max_num_seqs": 1, "enable_prefix_caching": False}}


def engine(model_dir: Path, tp: int, dtype: str, *, reshard: bool, kind: str) -> LLM:
    """A vLLM CPU engine; TP ranks are bound round-robin to the cores (TP 4 on 2 cores:
    two ranks a core)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(CORES[r % len(CORES)])
                                                       for r in range(tp))
    extra = ({"worker_extension_cls": EXT, "weight_transfer_config": {"backend": "reshard"}}
             if reshard else {})
    options = dict(skip_tokenizer_init=True, enforce_eager=True, dtype=dtype,
                   max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0,
                   kv_cache_memory_bytes=KV_CACHE_BYTES)
    return start_llm(tp, model=str(model_dir),
                     **{**options, **FAMILY_ENGINE_ARGS.get(kind, {})}, **extra)


def close(llm: LLM) -> None:
    close_llm(llm)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root, dirs = tmp_path_factory.mktemp("family_models"), {}

    def get(kind: str) -> Path:
        if kind not in dirs:
            family, overrides = VARIANTS.get(kind, (kind, {}))
            dirs[kind] = hf.build_tiny_model(root / kind, family, **overrides)
        return dirs[kind]
    return get


def refit_steps(model_dir: Path, tmp_path: Path, shard: str, dtype: str, tp: int,
                steps: int, *, engine_dir: Path | None = None,
                reference: Callable[[Path], Path] = lambda state: state,
                job_args: Sequence[str] = ()) -> tuple[list[dict], list]:
    """The trainer job (on ``model_dir``; ``job_args``: more of its options) refits a
    reshard engine (loaded from ``engine_dir``, by default the same) ``steps`` times;
    per step: each rank's refit result, the answers, the weight check against
    ``reference(the step's state)``."""
    llm = engine(engine_dir or model_dir, tp, dtype, reshard=True, kind=model_dir.name)
    port, out = free_port(), tmp_path / "out"
    out.mkdir()
    records = []
    try:
        with open(tmp_path / "job.out", "w") as so, open(tmp_path / "job.err", "w") as se:
            job = start_job(JOB, [model_dir, port, out, "--shard", shard, "--steps", steps,
                                  "--inference-size", tp, *job_args], stdout=so.name,
                            stderr=se.name)
            try:
                infos = collective(llm, "reshard_init", "127.0.0.1", port, 2)
                assert [i["rank"] for i in infos] == list(range(tp))
                for step in range(1, steps + 1):
                    serve_long_prompt(llm)  # cached with the previous weights
                    res = collective(llm, "reshard_refit")
                    tokens, lps = generate(llm)
                    records.append({
                        "res": res, "tokens": tokens, "lps": lps,
                        "info": collective(llm, "reshard_info"),
                        "verify": collective(llm, "reshard_verify",
                                             str(reference(out / f"step{step}.pt")))})
                job.wait(timeout=120)
            finally:
                job.kill()
                collective(llm, "reshard_close")
    finally:
        close(llm)
    assert job.returncode == 0, (tmp_path / "job.err").read_text()[-4000:]
    trainer = json.loads((tmp_path / "job.out").read_text().strip().splitlines()[-1])
    return records, trainer


def fresh_answers(model_dir: Path, state_path: Path, tmp_path: Path, dtype: str, tp: int,
                  kind: str):
    """Tokens and prompt logprobs of a fresh engine loaded from the trainer's checkpoint
    of that step (its full state dict saved as a Hugging Face model in fp32: the engine
    casts on load as the sender casts on send)."""
    hf.save_checkpoint(model_dir, torch.load(state_path), tmp_path)
    llm = engine(tmp_path, tp, dtype, reshard=False, kind=kind)
    try:
        return generate(llm)
    finally:
        close(llm)


def model_bytes(state_path: Path, dtype: str) -> int:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(t.numel() for t in torch.load(state_path).values()) * itemsize


@pytest.mark.parametrize("kind, shard, dtype, tp, steps", CASES,
                         ids=[f"{k}-{s}-{d}-tp{t}" for k, s, d, t, _ in CASES])
def test_family_refit_matches_a_fresh_engine(models, tmp_path, kind, shard, dtype, tp,
                                             steps):
    model_dir = models(kind)
    records, trainer = refit_steps(model_dir, tmp_path, shard, dtype, tp, steps)
    assert all(e["ok"] for rank_log in trainer for e in rank_log), trainer
    for step, rec in enumerate(records, 1):
        for res in rec["res"]:
            assert res["ok"] and res["committed"] and res["version"] == step, res
            # exactly this rank's shard: fused, padded, replicated tensors included
            assert res["bytes_received"] == res["expected_bytes"] > 0, res
        for v in rec["verify"]:  # bit for bit what vLLM's own loaders make of the state
            assert v["mismatched"] == [] and v["checked"] > 0, v
        if kind in MOE_KINDS:  # experts prepacked in place, checked against vLLM's own
            assert all(i["prepacked_experts"] for i in rec["info"]), rec["info"]
        state = tmp_path / "out" / f"step{step}.pt"
        fresh = fresh_answers(model_dir, state, tmp_path / f"fresh{step}", dtype, tp, kind)
        assert (rec["tokens"], rec["lps"]) == fresh, (kind, step)  # exactly
    full = model_bytes(tmp_path / "out" / f"step{steps}.pt", dtype)
    res = records[-1]["res"]
    received = "/".join(str(r["bytes_received"]) for r in res)
    seconds = max(r["seconds"] for r in res)
    print(f"\n| {kind} | {shard} | {tp} | {dtype} | {received} of {full} | "
          f"{seconds * 1000:.0f} ms |")
