"""reshard.integrations.trl without a server or a trainer job: what it refuses before
anything moves, and the CPU stand-in for AsyncGRPO's FlashAttention (against plain causal
attention). TRL training a live server: tests/integration/test_vllm_serve_trl.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from reshard.defaults import NO_VERSION  # noqa: E402
from reshard.errors import ConfigError  # noqa: E402
from reshard.integrations.trl import ReshardStream, ReshardWeightTransfer  # noqa: E402
from reshard.tools.trl_cpu import flash_attn_varlen_func  # noqa: E402
from reshard.tools.trl_grpo import reward_first_half  # noqa: E402


def test_a_server_url_is_required():
    with pytest.raises(ConfigError, match=r"server_url must be an http\(s\) URL.*'localhost:8000'"):
        ReshardWeightTransfer("localhost:8000")


def test_trls_own_trainers_and_stream_are_refused_before_anything_moves():
    """A transfer no reshard trainer holds is refused at TRL's first call (train begin,
    before the server is asked), and so is TRL's own stream of gathered tensors."""
    transfer = ReshardWeightTransfer("http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(ConfigError, match="TRL's own trainers stream full tensors.*"
                                          "ReshardAsyncGRPOTrainer"):
        transfer.init_weight_transfer()
    gathered = iter([("model.embed_tokens.weight", torch.zeros(2, 2))])
    with pytest.raises(ConfigError, match="got a list_iterator: TRL's own trainers"):
        transfer.send_weights(gathered)
    other = ReshardWeightTransfer("http://127.0.0.1:1").stream(torch.nn.Linear(2, 2), 0)
    with pytest.raises(ConfigError, match="got a ReshardStream"):
        transfer.send_weights(other)
    assert transfer.engine is None and transfer.version == NO_VERSION


class _Info(BaseHTTPRequestHandler):
    """A stand-in for a vLLM server's ``/server_info`` (isolates the check of its answer)."""

    backend: str | None = "nccl"

    def do_GET(self):  # noqa: N802 - http.server's name
        config = None if self.backend is None else {"backend": self.backend}
        body = json.dumps({"vllm_config": {"weight_transfer_config": config}}).encode()
        self.send_response(200 if self.path.startswith("/server_info") else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("backend", ["nccl", None])
def test_a_server_without_the_reshard_backend_is_refused(backend):
    _Info.backend = backend
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Info)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        transfer = ReshardWeightTransfer(f"http://127.0.0.1:{httpd.server_port}")
        transfer.bound = True  # as the reshard trainers mark it
        with pytest.raises(ConfigError, match=f"weight-transfer backend {backend!r}.*"
                                              r"--weight-transfer-config"):
            transfer.init_weight_transfer()
    finally:
        httpd.shutdown()


def test_pause_and_resume_leave_the_engine_alone():
    transfer = ReshardWeightTransfer("http://127.0.0.1:1")
    assert transfer.pause() is None and transfer.resume() is None
    assert isinstance(transfer.stream(torch.nn.Linear(2, 2), 0), ReshardStream)


def _causal(q, k, v, scale):
    """Plain causal attention of one sequence, [len, heads, dim], kv heads repeated."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (k, v))
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
        scale=scale).transpose(0, 1)


def test_the_flash_attention_stand_in_is_causal_attention_along_each_path():
    """Two samples sharing a 3-token prefix, packed as a tree: the prefix (segment 0), then
    each sample's own 2 tokens (segments 1 and 2, whose keys are the prefix and
    themselves): every query's output is that of plain attention over its own sample."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, n, 8, generator=g) for n in (4, 2, 2))
    kv_index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6])
    cu_q = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 13], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k.index_select(0, kv_index), v.index_select(0, kv_index),
                                 cu_q, cu_k, 3, 5, softmax_scale=0.3)
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2, 5, 6]):
        want = _causal(q[rows], k[rows], v[rows], 0.3)
        torch.testing.assert_close(out[rows], want)
    with pytest.raises(NotImplementedError, match="sliding window"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_q, 3, 3, window_size=(4, 0))


def test_the_examples_reward_differs_within_a_group():
    assert reward_first_half(["cat bird", "sun moon", ""]) == [1.0, 0.0, 0.0]
    assert reward_first_half([[{"role": "assistant", "content": "cat zebra"}]]) == [0.5]
