"""``RESHARD_PEERS`` (reshard.integrations.vllm.join) without vLLM: the peers' URLs and
the meeting's address as given, and a peer that cannot lend stopping the start before
anything is asked of any peer. The peers here are small HTTP servers answering vLLM's
dev route as a ``vllm serve`` would (its ``/collective_rpc`` replies); the fill itself,
with real servers, is ``tests/integration/test_vllm_serve.py``'s."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reshard.errors import ConfigError, ReshardError
from reshard.integrations.vllm import join


def test_peers_are_base_urls_named_once():
    assert join.peers("") == []
    assert join.peers(" http://10.0.0.5:8000/ , http://10.0.0.6:8000") == [
        "http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    with pytest.raises(ConfigError, match="'10.0.0.5:8000' is not a peer's base URL"):
        join.peers("10.0.0.5:8000")
    with pytest.raises(ConfigError, match="named twice"):
        join.peers("http://a:1,http://a:1")


def test_the_meeting_address_as_given_or_the_way_to_the_first_peer():
    assert join.meeting_address(["http://127.0.0.1:9"], "10.1.2.3:29555") == (
        "10.1.2.3", 29555)
    host, port = join.meeting_address(["http://127.0.0.1:9"], "")
    assert host == "127.0.0.1" and 0 < port < 65536
    with pytest.raises(ConfigError, match="is not host\\[:port\\]"):
        join.meeting_address(["http://127.0.0.1:9"], "10.1.2.3:x")


class Peer:
    """A fake ``vllm serve`` dev route: ``replies[method]`` per call, every call kept."""

    def __init__(self, replies: dict[str, object], code: int = 200) -> None:
        calls: list[str] = []
        self.calls = calls

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                calls.append(body["method"])
                out = json.dumps({"results": replies.get(body["method"])}).encode()
                self.send_response(code)
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _never(*args):
    raise AssertionError("the bootstrap must not start")


def test_a_peer_that_cannot_lend_stops_the_start_before_anyone_lends():
    ready = {"reshard_status": [{"rank": r, "version": 3, "stale": False, "lendable": True}
                                for r in range(2)]}
    unrefitted = {"reshard_status": [{"rank": 0, "version": -1, "stale": False,
                                      "lendable": False}]}
    no_state = {"reshard_status": [{"ok": False, "raised": "ReshardError",
                                    "error": "ReshardError: call reshard_init first"}]}
    peers = [Peer(ready), Peer(unrefitted), Peer(no_state)]
    try:
        with pytest.raises(ReshardError) as e:
            join.fill_from_peers(None, _never, [p.url for p in peers], "127.0.0.1", 1)
        msg = str(e.value)
        assert "nothing was asked of them" in msg
        assert f"peer {peers[1].url} rank 0: holds no whole committed version" in msg
        assert f"peer {peers[2].url}: ReshardError: call reshard_init first" in msg
        assert peers[0].url not in msg
        assert [p.calls for p in peers] == [["reshard_status"]] * 3  # nobody lends
    finally:
        for p in peers:
            p.close()


def test_a_peer_without_its_rl_routes_is_named_with_the_cure():
    peer = Peer({}, code=404)
    try:
        with pytest.raises(ReshardError, match="HTTP 404 .*VLLM_SERVER_DEV_MODE=1"):
            join.fill_from_peers(None, _never, [peer.url], "127.0.0.1", 1)
    finally:
        peer.close()
    with pytest.raises(ReshardError, match="reshard_status failed"):
        join.fill_from_peers(None, _never, [peer.url], "127.0.0.1", 1)  # gone


class _Config:
    """The one field of a ``VllmConfig`` the hook reads."""

    def __init__(self, dp: int) -> None:
        self.parallel_config = type("P", (), {"data_parallel_size": dp})()


def test_the_hook_does_nothing_without_peers_and_refuses_data_parallel(monkeypatch):
    """``EngineCore._initialize_kv_caches`` wrapped: without ``$RESHARD_PEERS`` the
    original's result and nothing else; with peers and two engine cores in one server, a
    refusal naming the setting before any peer is asked."""
    calls = []
    hook = join.wrap(lambda core, cfg: calls.append(cfg) or "kv caches")
    monkeypatch.delenv(join.PEERS_ENV, raising=False)
    assert hook(object(), _Config(1)) == "kv caches" and len(calls) == 1
    monkeypatch.setenv(join.PEERS_ENV, "http://127.0.0.1:9")  # nobody listens
    with pytest.raises(ConfigError, match="data_parallel_size=2 .*one server per replica"):
        hook(object(), _Config(2))
    assert hook.__reshard_wrapped__


def test_a_peer_refusing_to_lend_stops_the_start_before_the_bootstrap():
    """A peer whose status was whole but whose lend call failed (its state gone between
    the two calls) would never come to the meeting: the start stops at once, naming it."""
    status = {"reshard_status": [{"rank": 0, "version": 3, "stale": False,
                                  "lendable": True}],
              "reshard_lend": [{"ok": False, "raised": "ReshardError",
                                "error": "ReshardError: call reshard_init first"}]}
    peer = Peer(status)
    try:
        with pytest.raises(ReshardError, match="refused to lend: .*reshard_init first"):
            join.fill_from_peers(None, _never, [peer.url], "127.0.0.1", 1)
        assert peer.calls == ["reshard_status", "reshard_lend"]
    finally:
        peer.close()
