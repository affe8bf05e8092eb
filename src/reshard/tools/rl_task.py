"""The toy RL task of ``reshard.tools.demo_rl``, whichever launcher runs it (local
processes, or Ray actors: :mod:`reshard.tools.ray_loop`): prompts, reward, one REINFORCE
step, the per-step checkpoint the checks compare vLLM with, vLLM's CPU settings, the
demos' quiet output and an engine's clean shutdown."""

from __future__ import annotations

import builtins
import os
import re
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

#: The start every prompt shares (an RL run's system prompt or chat template): 300 tokens,
#: two full KV blocks of vLLM CPU (128 tokens a block), which its prefix cache keeps from one
#: step to the next: each step's rollouts fill it with the weights of that step, and the
#: checks after the next refit read it again (they must not answer from the old KV).
SYSTEM_PROMPT = [1] + [2 + (37 * i + 11) % 248 for i in range(299)]
PROMPTS = [SYSTEM_PROMPT + p for p in ([17, 42, 99, 256, 3, 7], [300, 301, 302],
                                       [5, 6, 7, 8, 9, 10, 11, 12, 13], [64, 128, 192])]
#: vLLM's context: a prompt and its completion.
MAX_MODEL_LEN = 512
ROLLOUT_TOKENS = 12
CHECK_TOKENS = 8
TP, TRAINERS = 2, 2
#: vLLM CPU's KV cache per engine (``LLM(kv_cache_memory_bytes=...)``): 64 MiB holds
#: ~128k tokens of these tiny models, far more than 16 sequences of 128. Left to
#: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, at least 1), vLLM spends ~11 s of every start-up
#: here allocating it (measured: engine start 26 s -> 14 s); the variable, when set,
#: overrides this.
KV_CACHE_BYTES = 64 << 20

#: One rollout: (prompt token ids, completion token ids).
Rollout = tuple[list[int], list[int]]


def reward(tokens: list[int], vocab: int) -> float:
    """The share of completion tokens in the lower half of the vocabulary."""
    return sum(t < vocab // 2 for t in tokens) / max(1, len(tokens))


def rollouts(llm: Any, step: int) -> list[Rollout]:
    """Two sampled completions of every prompt from the vLLM engine ``llm`` (seeded by
    ``step``)."""
    from vllm import SamplingParams

    sample = SamplingParams(temperature=1.0, max_tokens=ROLLOUT_TOKENS, ignore_eos=True,
                            detokenize=False, n=2, seed=step)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sample, use_tqdm=False)
    return [(list(p), list(c.token_ids)) for p, o in zip(PROMPTS, outs) for c in o.outputs]


def greedy(llm: Any) -> list[list[int]]:
    """The engine's greedy completion of every prompt (``CHECK_TOKENS`` tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reinforce_step(model: Any, opt: Any, batch: list[Rollout]) -> tuple[float, float]:
    """One REINFORCE step on this rank's rollouts (advantage: reward minus the batch
    mean); returns (loss, mean reward). Collective under FSDP2 (backward)."""
    import torch

    vocab = model.config.vocab_size
    rewards = torch.tensor([reward(c, vocab) for _, c in batch])
    advantages = rewards - rewards.mean()
    loss = torch.zeros(())
    for (prompt, completion), adv in zip(batch, advantages):
        ids = torch.tensor([prompt + completion])
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        taken = logp[len(prompt) - 1:].gather(1, ids[0, len(prompt):, None]).sum()
        loss = loss - adv * taken / len(batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach()), float(rewards.mean())


def train_step(model: Any, opt: Any, batch: list[Rollout], rank: int, out_dir: str | Path,
               step: int) -> tuple[float, float]:
    """:func:`reinforce_step`, then the step's full state dict (a collective under FSDP2)
    saved by rank 0: the reference the demos check the engine against."""
    from reshard.integrations import hf

    loss, mean_reward = reinforce_step(model, opt, batch)
    full = hf.full_state_dict(model)
    if rank == 0:
        save_step(full, out_dir, step)
    return loss, mean_reward


def save_step(state: dict[str, Any], out_dir: str | Path, step: int) -> Path:
    """``out_dir/step{step}.pt``, written whole (renamed into place)."""
    import torch

    tmp, path = Path(out_dir) / f".step{step}.pt", Path(out_dir) / f"step{step}.pt"
    torch.save(state, tmp)
    tmp.rename(path)
    return path


def vllm_cpu_env(env: MutableMapping[str, str] = os.environ) -> None:
    """vLLM CPU settings, read at ``import vllm`` and inherited by its workers (the KV
    cache's size is an engine argument: :data:`KV_CACHE_BYTES`), as defaults in ``env``
    (this process's environment, or that of one it starts)."""
    cores = sorted(os.sched_getaffinity(0))
    bind = f"{cores[0]}|{cores[1]}" if len(cores) >= 2 else f"{cores[0]}|{cores[0]}"
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", bind)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # at shutdown vLLM waits this long for its workers to exit on their own (default 5 s;
    # they took 18 s here on a busy host), then terminates them
    env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "60")


#: What the demos set, where the user has not, so that they print what a user needs and
#: nothing of their libraries' start-up chatter (``--verbose`` or ``RESHARD_VERBOSE=1``:
#: none of it, and vLLM logs at its own level, INFO). Children inherit it.
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's set-up warnings (no Triton, eager mode, ...)
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' "Loading weights" bars and others
    "TRANSFORMERS_VERBOSITY": "error",
    "TORCH_LOGS": "-torch",  # torch's Python loggers at ERROR ("Triton not available")
}
#: Python warnings of the libraries that say nothing about the demo: vLLM's use of
#: ``reduce_op`` at import, and of ``all_gather_into_tensor`` (deprecated in torch 2.13)
#: in each TP worker's logits gather, ``CpuCommunicator.all_gather``. vLLM calls it only
#: where its kernel library has no shared-memory collectives, ``torch.ops._C.init_shm_manager``:
#: the AVX2 build (``vllm._C_AVX2``, picked on hosts without AVX-512) has none, the
#: AVX-512 ones (``_C``, ``_C_AVX512``) have them and gather through shared memory.
QUIET_WARNINGS = ("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
                  "ignore:`torch.distributed.all_gather_into_tensor` is deprecated"
                  ":FutureWarning")


def verbose_requested(flag: bool = False) -> bool:
    """Whether the demos show their libraries' logs: ``--verbose`` or ``RESHARD_VERBOSE``
    set to anything but 0."""
    return flag or os.environ.get("RESHARD_VERBOSE", "0") not in ("", "0")


def quiet_env(verbose: bool) -> None:
    """The demos' output to what a user needs (:data:`QUIET_ENV`, :data:`QUIET_WARNINGS`),
    set before vLLM or transformers is imported; with ``verbose``, vLLM's own log level
    (and ``RESHARD_VERBOSE=1`` for the demo's own child processes)."""
    if verbose:
        os.environ["RESHARD_VERBOSE"] = "1"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    filters = [f for f in os.environ.get("PYTHONWARNINGS", "").split(",") if f]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys([*filters, *QUIET_WARNINGS]))
    for spec in QUIET_WARNINGS:
        action, message, category = spec.split(":")
        warnings.filterwarnings(action, message=re.escape(message),
                                category=getattr(builtins, category))


#: How long an engine's processes may take to exit at shutdown before vLLM kills them
#: (``engine_core.shutdown``'s default, 5 s, is short of their teardown on a busy host,
#: "force killing remaining processes": its workers exited in 18 s, the engine core 9 s
#: later, measured with ``--verbose``).
SHUTDOWN_TIMEOUT_S = 120.0


def shutdown(llm: Any) -> list[str]:
    """Shut the vLLM engine ``llm`` down cleanly: its engine core and workers exit on
    their own, within :data:`SHUTDOWN_TIMEOUT_S`. Returns the names of the engine's
    processes vLLM had to kill instead (none when the shutdown was clean), and says so:
    such a process leaves its shared-memory queues to Python's resource tracker, which
    reports them as leaked when the program ends."""
    import signal

    core = llm.llm_engine.engine_core
    core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    killed = [p.name for p in getattr(manager, "processes", None) or []
              if p.exitcode == -signal.SIGKILL]
    if killed:
        print(f"vLLM's {', '.join(killed)} did not exit within {SHUTDOWN_TIMEOUT_S:.0f} s "
              f"of its shutdown and was killed", flush=True)
    return killed


def expected_bytes(engine_rank: dict[str, Any]) -> int:
    """What an engine rank's refit report (a refit's result, ``reshard_last``) must say
    it received: its shard's bytes in a dense refit; in a sparse one (``sparse="auto"``,
    the default, after the first) the encoded messages its sparse stats count, whose
    regions must cover exactly its shard (else -1, which no count equals)."""
    sparse = engine_rank.get("sparse")
    if sparse is None:
        return engine_rank["expected_bytes"]
    return sparse["wire_bytes"] if sparse["dense_bytes"] == engine_rank["expected_bytes"] else -1


def sparse_note(trainer_ranks: list[dict[str, Any]]) -> str:
    """``"sparse, 2.1% changed | "`` when the trainer ranks' refit went sparse, else ``""``
    (each rank's result carries ``sparse``: its ``sparse_summary``, None when dense)."""
    changed = [t["sparse"]["changed_fraction"] for t in trainer_ranks if t.get("sparse")]
    return f"sparse, {max(changed):.1%} changed | " if changed else ""


def sample_text(tokenizer: Any, rollout: Rollout) -> str:
    """One rollout as text: its task (the prompt after :data:`SYSTEM_PROMPT`) and its
    completion, each decoded with ``tokenizer``."""
    prompt, completion = rollout
    task = tokenizer.decode(prompt[len(SYSTEM_PROMPT):])
    return f'"{task}" -> "{tokenizer.decode(completion)}"'

