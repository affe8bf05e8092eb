"""The gate and the relay on loopback, in one process with a real TCPStore: who gets in,
what a process without the token sees, replays, garbage, stalls, floods, one deadline
for a whole handshake, and the clear errors (and notices) when only one side holds a
token, whichever comes first (see docs/security.md)."""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import suppress
from datetime import timedelta

import pytest
import torch.distributed as dist

import reshard as R
from reshard import gate
from reshard.comm import free_port
from reshard.gate import MAGIC, NONCE, NOTICE, Key, authenticate, resolve_key
from reshard.store import open_store, refusals, token_notice

TOKEN = "unit-test-token-0123456789"
T = timedelta(seconds=10)


@pytest.fixture
def gated():
    """A gated store hosted here (short handshake timeout, small pending cap)."""
    port = free_port()
    host = open_store("127.0.0.1", port, None, is_server=True, timeout=T, token=TOKEN)
    host.door.handshake_timeout, host.door.max_pending = 1.0, 8
    host.set("reshard/layouts/trainer", b"secret layouts: embed.weight (151936, 896)")
    yield host, port
    host.door.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.settimeout(5)
    return sock


def _drain(sock: socket.socket) -> bytes:
    """Everything the gate sends until it closes the connection (a reset is a close)."""
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def _eventually(condition, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_rank_with_the_token_reads_and_writes_through_its_relay(gated):
    host, port = gated
    client = open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=TOKEN)
    assert client.get("reshard/layouts/trainer").startswith(b"secret layouts")
    client.set("from-client", b"1")
    assert host.get("from-client") == b"1"
    assert host.door.accepted == 1 and host.door.refused == 0


def test_a_wrong_token_is_refused_and_learns_only_a_nonce(gated):
    host, port = gated
    with pytest.raises(R.AuthError, match="refused this rank's token: the two jobs hold "
                                          "different tokens"):
        open_store("127.0.0.1", port, None, is_server=False, timeout=T,
                   token="another-token-0123456789")
    sock = _connect(port)
    with pytest.raises(R.AuthError, match="refused"):
        authenticate(sock, Key("another-token-0123456789"), "here")
    # the gate counts (then into the store) on its own thread, after its verdict; the
    # refused rank said why on a second connection (a notice the host's ranks watch for)
    assert _eventually(lambda: "refused 3" in refusals(host))
    assert host.door.refused == 3 and host.door.accepted == 0
    # the last of them is the raw handshake's or the notice's: the gate takes connections
    # on threads of its own, and the refused rank's notice may be counted after the
    # handshake that followed it (seen on a loaded host)
    assert re.search(r"refused 3 connection\(s\), the last: (a wrong token|a rank that said "
                     r"it holds a different token) from 127\.0\.0\.1:", refusals(host))
    assert token_notice(host) == "other"


def test_a_replayed_handshake_is_refused(gated):
    host, port = gated
    key = resolve_key(TOKEN)
    recorded = _connect(port)  # a legitimate handshake, as a listener on the wire sees it
    banner = recorded.recv(len(MAGIC) + NONCE, socket.MSG_WAITALL)
    nonce = os.urandom(NONCE)
    hello = MAGIC + nonce + key.mac(b"client", banner[len(MAGIC):], nonce)
    recorded.sendall(hello)
    assert recorded.recv(33, socket.MSG_WAITALL)[:1] == b"\x01"
    assert host.door.accepted == 1
    replay = _connect(port)
    fresh = replay.recv(len(MAGIC) + NONCE, socket.MSG_WAITALL)
    assert fresh[len(MAGIC):] != banner[len(MAGIC):]  # the gate's nonce is new
    replay.sendall(hello)
    assert _drain(replay) == b"\x00"  # refused, then closed
    assert host.door.accepted == 1 and host.door.refused == 1
    recorded.close()


def test_garbage_and_a_plain_store_client_get_nothing(gated):
    host, port = gated
    sock = _connect(port)
    sock.sendall(os.urandom(4096))
    got = _drain(sock)
    assert got[:len(MAGIC)] == MAGIC and len(got) == len(MAGIC) + NONCE  # banner, nonce
    with pytest.raises(RuntimeError):
        plain = dist.TCPStore("127.0.0.1", port, None, is_master=False,
                              timeout=timedelta(seconds=2), wait_for_workers=False)
        plain.get("reshard/layouts/trainer")
    assert host.door.accepted == 0 and host.door.refused >= 2


def test_a_rank_without_a_token_is_told_the_other_job_set_one(gated):
    host, port = gated
    assert token_notice(host) is None
    with pytest.raises(R.AuthError, match=r"takes only ranks holding a token: the other job "
                                          r"set one, this rank has none \(\$RESHARD_TOKEN"):
        open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=None)
    assert _eventually(lambda: token_notice(host) == "none")  # for the host's ranks


def test_a_rank_without_a_token_that_came_before_the_gate_is_told_when_it_comes():
    port, hosts = free_port(), []
    later = threading.Timer(0.5, lambda: hosts.append(
        open_store("127.0.0.1", port, None, is_server=True, timeout=T, token=TOKEN)))
    later.start()
    start = time.monotonic()
    with pytest.raises(R.AuthError, match="takes only ranks holding a token"):
        open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=None)
    later.join()
    assert time.monotonic() - start < 5  # not at the 10 s timeout: when the gate came
    assert _eventually(lambda: token_notice(hosts[0]) == "none")
    hosts[0].door.close()


class _SlowGate:
    """Speaks like a gate, ``delay`` seconds after each connection, its banner one byte
    every ``gap`` seconds (a busy host); keeps what each peer sent."""

    def __init__(self, delay: float, gap: float = 0.0) -> None:
        self.delay, self.gap, self.heard = delay, gap, []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with suppress(OSError):
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, suppress(OSError):
            time.sleep(self.delay)
            for byte in MAGIC + os.urandom(NONCE):
                conn.sendall(bytes([byte]))
                time.sleep(self.gap)
            conn.settimeout(3)
            self.heard.append(conn.recv(len(NOTICE) + 1, socket.MSG_WAITALL))


def test_a_rank_without_a_token_is_told_even_when_the_gate_answers_slowly():
    slow = _SlowGate(delay=0.4)  # past the 0.1 s first look for a banner
    with pytest.raises(R.AuthError, match="takes only ranks holding a token"):
        open_store("127.0.0.1", slow.port, None, is_server=False, timeout=T, token=None)
    assert NOTICE + b"N" in slow.heard  # and it told the gate why it left
    slow.listener.close()


def test_a_token_against_a_store_without_one_fails_at_once_and_says_so_there():
    port = free_port()
    plain = open_store("127.0.0.1", port, None, is_server=True, timeout=T, token=None)
    with pytest.raises(R.AuthError, match=r"has no gate: this rank holds a token "
                                          r"\(\$RESHARD_TOKEN or token=\) and the other job "
                                          "none"):
        open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=TOKEN)
    assert token_notice(plain) == "extra"  # for the store's own ranks
    del plain


def test_a_handshake_has_one_deadline_at_the_gate_however_slowly_it_trickles(gated):
    host, port = gated  # handshake timeout 1 s
    sock = _connect(port)
    start = time.monotonic()
    banner = sock.recv(len(MAGIC) + NONCE, socket.MSG_WAITALL)
    nonce = os.urandom(NONCE)  # a correct hello, one byte every 0.3 s (72 bytes: 21 s)
    hello = MAGIC + nonce + resolve_key(TOKEN).mac(b"client", banner[len(MAGIC):], nonce)
    closed_at = None
    sock.settimeout(0.3)
    for byte in hello:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(64) == b"":
                closed_at = time.monotonic() - start
                break
        except TimeoutError:
            continue
        except OSError:  # reset
            closed_at = time.monotonic() - start
            break
    assert closed_at is not None and 0.9 < closed_at < 4, closed_at  # not after 21 s
    assert _eventually(lambda: "stalled past the handshake timeout" in refusals(host))
    assert host.door.refused == 1 and host.door.accepted == 0


def test_a_handshake_has_one_deadline_at_the_client_too():
    slow = _SlowGate(delay=0.0, gap=0.3)  # a banner of 40 bytes over 12 s
    sock = socket.create_connection(("127.0.0.1", slow.port), timeout=5)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        authenticate(sock, Key(TOKEN), "here", wait=1.0)
    assert time.monotonic() - start < 4  # not after the 12 s the banner takes
    sock.close()
    slow.listener.close()


def test_stalled_connections_are_dropped_and_do_not_block_others(gated):
    host, port = gated
    stalled = [_connect(port) for _ in range(3)]
    stalled[0].sendall(MAGIC[:3])  # a partial hello, then nothing
    client = open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=TOKEN)
    assert client.get("reshard/layouts/trainer").startswith(b"secret")
    for sock in stalled:  # each closed by the gate at its handshake timeout
        assert _drain(sock)[:len(MAGIC)] == MAGIC
    assert host.door.refused == 3


def test_a_flood_of_connections_evicts_the_oldest_and_a_rank_still_gets_in(gated):
    host, port = gated
    flood = [_connect(port) for _ in range(40)]  # five times the pending cap of 8
    client = open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=TOKEN)
    assert client.get("reshard/layouts/trainer").startswith(b"secret")
    # evicted past the cap of 8 pending handshakes, the rest at their timeout
    assert _eventually(lambda: host.door.refused >= 32)
    assert len(host.door._pending) <= 8
    for sock in flood:
        sock.close()


def test_a_relay_carries_only_its_own_process_connections(gated):
    _, port = gated
    client = open_store("127.0.0.1", port, None, is_server=False, timeout=T, token=TOKEN)
    relay_port = client.door.port
    code = ("import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {relay_port}), timeout=10)\n"
            "s.sendall(b'x' * 16); s.settimeout(10)\n"
            "try:\n    print(repr(s.recv(64)))\nexcept ConnectionResetError:\n"
            "    print(repr(b''))\n")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60)
    assert other.stdout.strip() == "b''", other  # closed at once, nothing relayed
    assert client.get("reshard/layouts/trainer").startswith(b"secret")
    assert gated[0].door.accepted == 1  # no second tunnel was dialled for it


def test_the_token_comes_from_the_environment_and_never_shows(monkeypatch):
    monkeypatch.setenv(gate.TOKEN_ENV, TOKEN)
    key = resolve_key(None)
    assert key is not None and TOKEN not in repr(key) and TOKEN not in str(key)
    assert key.mac(b"x") == Key(TOKEN).mac(b"x") != Key(TOKEN + "!").mac(b"x")
    with pytest.raises(R.ConfigError, match="not picklable"):
        pickle.dumps(key)
    monkeypatch.delenv(gate.TOKEN_ENV)
    assert resolve_key(None) is None
    with pytest.raises(R.ConfigError, match="at least 16 characters .*got 5"):
        resolve_key("short")
    assert len(R.new_token()) >= 32 and R.new_token() != R.new_token()


def test_the_store_listens_only_where_it_is_told():
    port = free_port()
    store = open_store("127.0.0.1", port, None, is_server=True, timeout=T, token=None)
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                               text=True).stdout
    assert "127.0.0.1:" in listening and "*:" not in listening, listening
    with pytest.raises(R.ConfigError, match="cannot listen at 127.0.0.1"):
        open_store("127.0.0.1", port, None, is_server=True, timeout=T, token=None)
    del store
