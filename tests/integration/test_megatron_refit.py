"""Real Megatron-Core trainers (gloo processes, CPU) refit a real vLLM engine (TP=2).

Each configuration runs ``_megatron_trainer_job.py`` (tiny ``GPTModel``, local layer
spec, AdamW steps through Megatron's own forward-backward schedule) against one vLLM
engine, the sender fed by :func:`reshard.integrations.megatron.refit_params`:

* TP2, PP2 (1F1B over gloo) and TP2 x PP2 (4 ranks) of a dense Qwen3 model share one
  engine; EP2 of a Qwen3-MoE model (8 experts, 4 per rank, attention replicated over the
  two data-parallel ranks) has its own.

After every refit, the step's Hugging Face state dict is rebuilt from the trainer's
saved shards by ``reshard.tools.megatron_hf`` (independent of
``reshard.integrations.megatron``) and:

* every logical vLLM parameter of every rank equals, bit for bit, what vLLM's own
  loaders make of that state dict (``reshard_verify``);
* each vLLM rank received exactly its shard's bytes (from the config, here);
* the trainer ranks received nothing (a rank that receives nothing cannot assemble a
  tensor it does not hold), sent at most what they hold, and every tensor the sender
  read is Megatron's own parameter storage (a view, no copy);
* after the last step, the engine answers (greedy tokens, prompt logprobs) exactly as a
  fresh engine loaded from a Hugging Face checkpoint of that state dict.

The sender refits sparse (``sparse="on"``): the second refit of every configuration
goes through the sparse transport (fp32 engines: most values change in a step, so most
regions go dense), and all of the above holds for it.

Two steps per configuration; about 4 minutes in all, most of it engine start-up.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_vllm_refit as V  # the engine fixture and helpers of the vLLM refit tests

pytestmark = pytest.mark.integration

if importlib.util.find_spec("megatron") is None:  # imported by the trainer processes only
    pytest.skip("megatron-core is not installed (make setup installs it)",
                allow_module_level=True)

import torch  # noqa: E402

from reshard.integrations import hf  # noqa: E402
from reshard.integrations.vllm import collective  # noqa: E402
from reshard.tools import megatron_hf as MH  # noqa: E402
from reshard.tools.launch import free_port  # noqa: E402

JOB = Path(__file__).with_name("_megatron_trainer_job.py")
STEPS = 2
SIZES = dict(heads=4, groups=2, head_dim=32)
#: the engines' vocabularies (test_vllm_refit's tiny models): Megatron pads 500 to 512
VOCAB = {"qwen3": 500, "qwen3_moe": 512}
#: name -> (engine kind, tp, pp, ep, trainer world)
CONFIGS = {"tp2": ("qwen3", 2, 1, 1, 2), "pp2": ("qwen3", 1, 2, 1, 2),
           "tp2_pp2": ("qwen3", 2, 2, 1, 4), "ep2_moe": ("qwen3_moe", 1, 1, 2, 2)}


def run_config(engines, root: Path, name: str) -> dict:
    kind, tp, pp, ep, world = CONFIGS[name]
    t0 = time.perf_counter()
    llm, model_dir = engines.get(kind)
    t1 = time.perf_counter()
    port, out = free_port(), root / name
    out.mkdir()
    experts = 8 if kind == "qwen3_moe" else 0
    cmd = [sys.executable, str(JOB), str(out), "--kind", kind, "--tp", str(tp), "--pp",
           str(pp), "--ep", str(ep), "--world", str(world), "--steps", str(STEPS),
           "--port", str(port), "--vocab", str(VOCAB[kind]), "--sparse", "on"]
    records = []
    with open(out / "job.out", "w") as so, open(out / "job.err", "w") as se:
        job = subprocess.Popen(cmd, stdout=so, stderr=se)
        try:
            collective(llm, "reshard_init", "127.0.0.1", port, world, timeout_s=180.0)
            for step in range(1, STEPS + 1):
                V.serve_long_prompt(llm)  # cached with the previous weights
                res = collective(llm, "reshard_refit")
                state = MH.to_hf(MH.load_ranks(out, step), experts=experts, vocab=VOCAB[kind],
                                 **SIZES)
                torch.save(state, out / f"hf_step{step}.pt")
                records.append({"res": res, "answers": V.generate(llm),
                                "verify": collective(llm, "reshard_verify",
                                                     str(out / f"hf_step{step}.pt"))})
            job.wait(timeout=180)
        finally:
            job.kill()
            collective(llm, "reshard_close")
    assert job.returncode == 0, (out / "job.err").read_text()[-4000:]
    trainer = json.loads((out / "job.out").read_text().strip().splitlines()[-1])
    print(f"\n{name}: engine {t1 - t0:.0f} s, trainer and refits {time.perf_counter() - t1:.0f} s",
          file=sys.stderr)
    return {"records": records, "trainer": trainer, "model_dir": model_dir, "out": out}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Every selected configuration's refits first (one engine per model), then the
    tests (each starts a fresh engine)."""
    engines = V.Engines(tmp_path_factory.mktemp("megatron_models"))
    root = tmp_path_factory.mktemp("megatron_runs")
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_megatron_trainer_refits_vllm"}
    done: dict[str, object] = {}
    for name in (n for n in CONFIGS if n in selected):
        try:
            done[name] = run_config(engines, root, name)
        except Exception as e:  # noqa: BLE001 - reported by that configuration's test
            done[name] = e
    yield engines, done
    engines.close()


def in_memory_form(state: dict) -> dict:
    """transformers 5 keeps a MoE block's experts fused in memory (``experts.gate_up_proj``
    [E, 2I, H], gate then up; ``experts.down_proj`` [E, H, I]); the checkpoint form names
    each expert. ``save_pretrained`` writes the checkpoint form back."""
    out, experts = {}, {}
    for name, t in state.items():
        m = re.match(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m:
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for prefix, w in experts.items():
        n = len(w["down"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate"][e], w["up"][e]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([w["down"][e] for e in range(n)])
    return out


def fresh_answers(engines, run: dict, step: int):
    """A fresh engine loaded from the Hugging Face checkpoint of ``step`` (float32)."""
    state = in_memory_form(torch.load(run["out"] / f"hf_step{step}.pt"))
    ckpt = hf.save_checkpoint(run["model_dir"], state, run["out"] / f"checkpoint{step}")
    return V.generate(engines.fresh(ckpt))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_trainer_refits_vllm(runs, name):
    engines, done = runs
    run = done[name]
    if isinstance(run, Exception):
        raise run
    cfg = hf.load_model(run["model_dir"], torch.float32).config
    assert cfg.vocab_size == VOCAB[CONFIGS[name][0]]  # the trainer's real vocabulary
    for step, rec in enumerate(run["records"], 1):
        for rank, res in enumerate(rec["res"]):
            assert res["ok"] and res["committed"] and res["version"] == step, res
            # exactly this rank's shard: fused qkv / gate_up / experts, padded vocab;
            # after the first refit sparse, as much as dense and its headers at most
            want = V.expected_shard_bytes(cfg, rank)
            if step == 1:
                assert res["bytes_received"] == want and res["sparse"] is None
            else:
                got = res["sparse"]
                assert got["dense_bytes"] == want, got
                assert res["bytes_received"] == got["wire_bytes"] <= 1.02 * want, got
        for v in rec["verify"]:  # bit for bit what vLLM's loaders make of the HF state
            assert v["mismatched"] == [] and v["checked"] > 0, v
    # the weights moved between the steps
    assert run["records"][0]["answers"] != run["records"][-1]["answers"]
    for log in run["trainer"]:
        mem = log["memory"]
        assert mem["views_of_megatron_params"] == mem["names"] > 0  # no copy
        for entry in log["steps"]:
            assert entry["received"] == 0  # a trainer rank never assembles a tensor
            assert entry["dense"] <= mem["local_param_bytes"]
            assert entry["sparse"] == (entry["step"] > 1)
            assert entry["sent"] <= 1.02 * entry["dense"] + 4096
    # the engine answers exactly as a fresh engine loaded from the last step's checkpoint
    assert run["records"][-1]["answers"] == fresh_answers(engines, run, STEPS)
