"""``python -m reshard.tools.demo_rl --trainer megatron``: the RL demo with a real
Megatron-Core trainer, run as a user runs it.

TP2 x PP2 (4 gloo ranks, 1F1B across the stages) trains a tiny Qwen3 ``GPTModel`` by
REINFORCE on rollouts sampled from a vLLM engine (TP2), which it refits after each of two
steps. The engine starts from a Hugging Face checkpoint of Megatron's initial weights;
after each refit the demo checks that vLLM's greedy tokens equal those of the transformers
model holding that step's state (converted from every rank's shards by
``reshard.tools.megatron_hf``), that every logical vLLM weight is bit for bit what vLLM's
own loader makes of it, that each vLLM rank received exactly its bytes and that the
version is the step; it exits 1 on any failure. Its output reads clean: one sampled
completion per step as text, none of the libraries' warnings, tracebacks or forced
shutdowns. About a minute.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("the vLLM engine binds one core per TP rank and needs 2 cores",
                allow_module_level=True)
for _module in ("vllm", "megatron"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed (make setup installs it)",
                    allow_module_level=True)

STEPS = 2


def test_rl_demo_with_a_megatron_tp2_pp2_trainer_verifies_every_step(tmp_path):
    cmd = [sys.executable, "-m", "reshard.tools.demo_rl", "--trainer", "megatron",
           "--parallel", "tp2,pp2", "--steps", str(STEPS)]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout
    # the whole run kept beside the test's files, for a failure's diagnosis
    (tmp_path / "demo.out").write_text(out)
    (tmp_path / "demo.err").write_text(proc.stderr)
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"Megatron-Core \(pp2,tp2, 4 ranks\) built its model", out), out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == STEPS, out
    for k, line in enumerate(steps, 1):
        # the version is the step; each check of the step passed
        assert f"refit v{k}:" in line and line.endswith("=> OK"), line
        assert "generation vs transformers OK, weights vs vLLM loader OK" in line, line
        sent = int(re.search(r"trainer sent (\d+) B", line)[1])
        received = [int(b) for b in re.search(r"received \[([\d, ]+)\] B", line)[1].split(",")]
        # no byte twice: what the trainer sent is what the vLLM ranks took in
        assert sent == sum(received), line
    assert f"{STEPS} of {STEPS} RL steps verified: all OK" in out
    # prompts and completions print as text (the tiny model's tokenizer, loaded by vLLM)
    samples = re.findall(r'^ +sample: "([a-z ]+)" -> "([a-z<>/ ]+)"$', out, re.M)
    assert len(samples) == STEPS, out
    # a clean run: none of the libraries' warnings, tracebacks or forced shutdowns
    noise = [line for line in (out + proc.stderr).splitlines()
             if re.search(r"Traceback|WARNING|Warning\b|DEPRECATED|force kill|it/s\]"
                          r"|did not exit within", line)]
    assert not noise, "\n".join(noise) + f"\n(the run in {tmp_path}/demo.out, demo.err)"
