"""SGLang 0.5.23 on a CPU host, for the tests, the benchmark and their docs: every CPU
measure HERE, none in the integration (``reshard.integrations.sglang``).

SGLang is installed with ``--no-deps`` beside the project's CPU torch (it pins torch
2.14.1 and CUDA packages), with its light dependencies (``make setup``). What it still
needs on a CPU, each for an SGLang process only, never for the caller's:

* ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu``; attention falls back to
  ``torch_native`` by itself;
* triton, imported unconditionally: the one ``make setup`` puts in
  ``.venv/megatron-triton`` (not in the venv: torch changes code paths when it finds
  one, and vLLM runs without it);
* torchvision, imported unconditionally: PyPI's 0.28.0 (torch 2.13's) in
  ``.venv/sglang-side``, whose two operator schemas ``shim/sitecustomize.py`` defines
  first (its compiled ops do not load beside CPU torch);
* ``sgl_kernel`` (no CPU wheel on PyPI): ``shim/sgl_kernel``, with the one function a
  dense model calls;
* tensor parallelism: one OpenMP thread set per rank, ``SGLANG_CPU_OMP_THREADS_BIND``
  (``"0|1"`` for TP2 on two cores).

:class:`SglangServer` starts ``python -m sglang.launch_server`` with all of it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reshard.tools.serve import Server

__all__ = ["SHIM_DIR", "SIDE_DIRS", "SglangServer", "sglang_argv", "sglang_env",
           "use_sglang_here"]

SHIM_DIR = Path(__file__).parent / "shim"
_ZYGOTE = None  # the process the servers fork from (reshard.tools.sglang_cpu.launch)
_SHIM: dict[str, Any] = {}  # the stand-ins' globals, where this process ran them
#: where ``make setup`` installs torchvision and triton for SGLang's processes alone
SIDE_DIRS = (Path(sys.prefix) / "sglang-side", Path(sys.prefix) / "megatron-triton")


def sglang_env(tp: int, cores: int | None = None, **overrides: str) -> dict[str, str]:
    """The environment of an SGLang process on this CPU host (see the module's docs);
    ``cores``: how many to spread the ranks over (all of this host's by default)."""
    missing = [str(d) for d in SIDE_DIRS if not d.is_dir()]
    if missing:
        raise RuntimeError(f"SGLang's CPU harness needs {missing} (make setup installs them)")
    cores = cores or os.cpu_count() or 1
    per = max(1, cores // tp)
    bind = "|".join(f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per % cores)
                    for r in range(tp))
    env = dict(os.environ)
    path = [str(SHIM_DIR), *map(str, SIDE_DIRS), env.get("PYTHONPATH", "")]
    env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND=bind,
               PYTHONPATH=os.pathsep.join(p for p in path if p),
               TORCH_CPP_LOG_LEVEL="ERROR", **overrides)
    return env


def use_sglang_here() -> None:
    """Make SGLang importable in this process (a benchmark's trainer rank that joins
    SGLang's own update group): its side folders and the stand-ins on ``sys.path``, the
    torchvision schemas defined. Never in a process that runs vLLM (triton on the path
    changes torch's code paths)."""
    import runpy

    if str(SHIM_DIR) not in sys.path:
        sys.path[:0] = [str(SHIM_DIR), *map(str, SIDE_DIRS)]
        # kept: the schemas go when their torch.library.Library is collected
        _SHIM.update(runpy.run_path(str(SHIM_DIR / "sitecustomize.py")))


def sglang_argv(model: str | Path, *, port: int, host: str = "127.0.0.1", tp: int = 1,
                dtype: str = "bfloat16", max_total_tokens: int = 4096,
                extra: Sequence[str] = ()) -> list[str]:
    """``python -m sglang.launch_server`` for a tiny model on CPU, greedy-reproducible,
    token ids in and out (no tokenizer: it takes seconds to start)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--device", "cpu", "--tp", str(tp), "--dtype", dtype, "--host", host,
            "--port", str(port), "--max-total-tokens", str(max_total_tokens),
            "--random-seed", "0", "--skip-server-warmup", "--skip-tokenizer-init",
            "--log-level", "warning", *extra]


class SglangServer(Server):
    """An SGLang server process (started, waited for and stopped as
    :class:`reshard.tools.serve.Server`: its own process group, ``/health``)."""

    def __init__(self, model: str | Path, *, port: int, log: str | Path, tp: int = 1,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 **argv: Any) -> None:
        self.url = f"http://{host}:{port}"
        self.argv = sglang_argv(model, port=port, host=host, tp=tp, **argv)
        self.env, self.log = env or sglang_env(tp), Path(log)
        self.proc = None

    def start(self) -> SglangServer:
        """Forked from the harness's SGLang zygote (:mod:`.launch`), not spawned."""
        from reshard.tools.sglang_cpu.launch import Zygote

        global _ZYGOTE
        if _ZYGOTE is None:
            _ZYGOTE = Zygote(sglang_env(1))
        i = self.argv.index("sglang.launch_server")
        self.proc = _ZYGOTE.fork(self.argv[i + 1:], env=self.env, log=self.log)
        return self

    def generate(self, tokens: Sequence[int], max_tokens: int, **sampling: Any) -> Any:
        """Greedy tokens and their logprobs (``/generate``, token ids in):
        ``(tokens, token logprobs, prompt logprobs or None, cached prompt tokens)``."""
        body = {"input_ids": list(tokens), "return_logprob": True,
                "logprob_start_len": sampling.pop("logprob_start_len", -1),
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                    "ignore_eos": True, **sampling}}
        meta = self.post("generate", body)["meta_info"]
        out = meta["output_token_logprobs"]
        prompt = meta.get("input_token_logprobs")
        return ([t for _, t, _ in out], [lp for lp, _, _ in out],
                [lp for lp, _, _ in prompt][1:] if prompt else None,
                meta.get("cached_tokens", 0))
