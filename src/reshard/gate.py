"""The authenticated meeting: a shared token, a gate in front of the store, a relay per rank.

torch's TCP store authenticates nobody and listens on every interface. With a token,
the store's host (trainer rank 0) binds the real store to a loopback port that only it
dials, and puts a :class:`Gate` on the address the caller names; every other rank's
store client talks to its own :class:`Relay` on ``127.0.0.1``, which dials the gate.
Gate and relay run a challenge and response over fresh nonces from both sides before
one byte of the store passes (the client proves first, so a process without the token
learns nothing but the gate's banner and a random nonce)::

    gate  -> relay  MAGIC, gate nonce Ns (32 bytes)
    relay -> gate   MAGIC, client nonce Nc (32 bytes), HMAC(key, "client" | Ns | Nc)
    gate  -> relay  1, HMAC(key, "gate" | Nc | Ns)    (or 0 and close: refused)

A recorded handshake cannot be replayed: the other side's nonce is new every time. The
token itself never leaves the process; the key is an HMAC of it. Garbage, a stalled
peer and floods cost the gate one thread per pending connection, each bounded by a
handshake timeout, the oldest evicted past a cap; none blocks the accept loop.
See ``docs/security.md``.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress

from reshard.errors import AuthError, ConfigError

__all__ = ["TOKEN_ENV", "AuthError", "Gate", "Key", "Relay", "is_gate", "new_token",
           "resolve_key"]

#: The environment variable a job's token comes from when none is passed.
TOKEN_ENV = "RESHARD_TOKEN"
MIN_TOKEN_CHARS = 16
MAGIC = b"RSHDGT1\x00"
NONCE = 32
HANDSHAKE_TIMEOUT_S = 5.0
MAX_PENDING = 64  # handshakes in progress at the gate; past it the oldest is dropped
_EOF_RETRIES = 5  # a gate under a flood may drop a pending handshake: dial again
BANNER_WAIT_S = 2.0  # a client's wait for the gate's answers (a plain store never answers)
PROBE_S = 0.1  # a rank without a token looks this long for a gate's banner


class Key:
    """A meeting's secret, derived from the token; its text never shows it."""

    __slots__ = ("_bytes",)

    def __init__(self, token: str | bytes) -> None:
        raw = token.encode() if isinstance(token, str) else bytes(token)
        self._bytes = hmac.digest(raw, b"reshard meeting key v1", "sha256")

    def mac(self, *parts: bytes) -> bytes:
        return hmac.digest(self._bytes, b"|".join(parts), "sha256")

    def derive(self, label: bytes) -> bytes:
        """A key for one purpose (the transfer's digests), independent of the others."""
        return self.mac(b"derive", label)

    def __repr__(self) -> str:
        return "Key(<hidden>)"

    __str__ = __repr__

    def __reduce__(self):  # never pickled into a store, a log or a Ray message by mistake
        raise ConfigError("a reshard Key is not picklable; pass the token to each process")


def new_token() -> str:
    """A fresh random token (256 bits), for a launcher to give both jobs."""
    return secrets.token_urlsafe(32)


def resolve_key(token: str | bytes | Key | None) -> Key | None:
    """The meeting key for ``token``, else for ``$RESHARD_TOKEN``, else None (no token)."""
    if isinstance(token, Key):
        return token
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
        if token is None:
            return None
    if not isinstance(token, (str, bytes)):
        raise ConfigError(f"token must be a str or bytes, got {type(token).__name__}")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"token must be at least {MIN_TOKEN_CHARS} characters (for example "
                          f"reshard.new_token()), got {len(token)}")
    return Key(token)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(buf)} of "
                                  f"{n} bytes")
        buf += chunk
    return bytes(buf)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either closes; then close both."""
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _join(a: socket.socket, b: socket.socket) -> None:
    """Relay bytes both ways between ``a`` and ``b`` (two daemon threads)."""
    for x, y in ((a, b), (b, a)):
        threading.Thread(target=_pump, args=(x, y), daemon=True,
                         name="reshard-relay").start()


class _Door:
    """A listening socket served by one accept loop on a daemon thread."""

    listener: socket.socket
    _closed = False

    def _open(self, name: str) -> None:
        self.listener.settimeout(0.2)
        threading.Thread(target=self._accept_loop, daemon=True, name=name).start()

    def close(self) -> None:
        self._closed = True
        with suppress(OSError):
            self.listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(conn, peer)

    def _take(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError


class Gate(_Door):
    """The public face of a store: authenticates each connection, then relays it to the
    real store at ``inner`` (a loopback address only the host dials)."""

    def __init__(self, listener: socket.socket, inner: tuple[str, int], key: Key, *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.listener, self.inner, self.key = listener, inner, key
        self.handshake_timeout, self.max_pending = handshake_timeout, max_pending
        self.on_refused = on_refused
        self.refused = 0
        self.accepted = 0
        self._pending: deque[socket.socket] = deque()
        self._lock = threading.Lock()
        self._open("reshard-gate")

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.getsockname()[:2]

    def _take(self, conn: socket.socket, peer: tuple) -> None:
        self._admit(conn)
        threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                         name="reshard-gate-handshake").start()

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            self._pending.append(conn)
            while len(self._pending) > self.max_pending:
                oldest = self._pending.popleft()
                with suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)

    def _settle(self, conn: socket.socket) -> bool:
        """Take ``conn`` off the pending list; False if it was evicted meanwhile."""
        with self._lock:
            if conn not in self._pending:
                return False
            self._pending.remove(conn)
            return True

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(self.handshake_timeout)
            verdict = self._handshake(conn)
        except TimeoutError:
            verdict = "a connection that stalled past the handshake timeout"
        except OSError:  # ConnectionError too
            verdict = "a connection closed before the handshake ended"
        if verdict is not None:
            self._settle(conn)
            self._refuse(conn, f"{verdict} from {peer[0]}:{peer[1]}")
            return
        try:
            conn.settimeout(None)
            inner = socket.create_connection(self.inner)
        except OSError:
            conn.close()
            return
        _join(conn, inner)

    def _handshake(self, conn: socket.socket) -> str | None:
        """None if the peer proved it holds the key, else why not."""
        mine = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + mine)
        if _recv_exact(conn, len(MAGIC)) != MAGIC:
            return "a connection without the reshard handshake (no token?)"
        theirs = _recv_exact(conn, NONCE)
        proof = _recv_exact(conn, 32)
        if not hmac.compare_digest(proof, self.key.mac(b"client", mine, theirs)):
            conn.sendall(b"\x00")
            return "a wrong token"
        if not self._settle(conn):  # evicted by a flood: the client dials again
            return "a connection evicted from the pending handshakes"
        self.accepted += 1
        conn.sendall(b"\x01" + self.key.mac(b"gate", theirs, mine))
        return None

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.refused += 1
        with suppress(OSError):
            conn.close()
        if self.on_refused is not None and not self._closed:
            with suppress(Exception):
                self.on_refused(why)


def authenticate(sock: socket.socket, key: Key, where: str) -> None:
    """The client's half of the handshake on a connected socket; raises ``AuthError`` if
    the gate refuses this key or does not prove it holds it, ``ConnectionError`` if the
    peer closes first, ``TimeoutError`` if it stalls."""
    if _recv_exact(sock, len(MAGIC)) != MAGIC:
        raise AuthError(f"the store at {where} is not a reshard gate; nothing was moved")
    theirs, mine = _recv_exact(sock, NONCE), secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + mine + key.mac(b"client", theirs, mine))
    verdict = _recv_exact(sock, 1)
    if verdict != b"\x01":
        raise AuthError(f"the store at {where} refused this rank's token: the two jobs hold "
                        f"different tokens (${TOKEN_ENV} or token=); nothing was moved")
    if not hmac.compare_digest(_recv_exact(sock, 32), key.mac(b"gate", mine, theirs)):
        raise AuthError(f"the store at {where} did not prove it holds the token: not this "
                        "job's trainer; nothing was moved")


def is_gate(host: str, port: int, wait: float = PROBE_S) -> bool:
    """Whether ``host:port`` answers with a gate's banner within ``wait`` seconds (a rank
    without a token asks, to say at once that the other job set one)."""
    try:
        with socket.create_connection((host, port), timeout=wait) as sock:
            sock.settimeout(wait)
            return _recv_exact(sock, len(MAGIC)) == MAGIC
    except OSError:
        return False


class Relay(_Door):
    """A rank's local door to a gated store: its store client connects to
    ``127.0.0.1:port``; each connection (from this process only, on Linux) is carried
    over a fresh authenticated connection to the gate."""

    def __init__(self, host: str, port: int, key: Key, *, timeout: float) -> None:
        self.where, self.key, self.timeout = f"{host}:{port}", key, timeout
        self.gate = (host, port)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self._ready = [self._dial()]  # authenticate now: a refused token fails here
        self._open("reshard-relay")

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def _dial(self) -> socket.socket:
        """A connection to the gate that passed the handshake. A gate not up yet is
        retried until ``timeout``; a refused token raises at once."""
        deadline, eofs = time.monotonic() + self.timeout, 0
        while True:
            left = deadline - time.monotonic()
            try:
                sock = socket.create_connection(self.gate, timeout=max(left, 0.1))
            except OSError as e:
                if left <= 0:
                    raise AuthError(f"no store answered at {self.where} within "
                                    f"{self.timeout:.0f} s ({e})") from e
                time.sleep(min(0.05, max(left, 0)))
                continue
            try:
                sock.settimeout(BANNER_WAIT_S)
                authenticate(sock, self.key, self.where)
                sock.settimeout(None)
                return sock
            except (ConnectionError, TimeoutError) as e:  # evicted, or not a gate at all
                sock.close()
                eofs += 1
                if isinstance(e, TimeoutError) or eofs >= _EOF_RETRIES or left <= 0:
                    raise AuthError(
                        f"the store at {self.where} does not answer the reshard handshake "
                        f"({e}): the trainer job has no token (${TOKEN_ENV} unset there) "
                        "or this is not a reshard store; nothing was moved") from e
                time.sleep(0.05 * eofs)
            except BaseException:
                sock.close()
                raise

    def _take(self, conn: socket.socket, peer: tuple) -> None:
        if not _from_this_process(peer, self.listener.getsockname()):
            conn.close()
            return
        try:
            tunnel = self._ready.pop() if self._ready else self._dial()
        except Exception:
            conn.close()
            return
        _join(conn, tunnel)


def _from_this_process(peer: tuple, local: tuple) -> bool:
    """Whether the loopback connection from ``peer`` to ``local`` was opened by this
    process (its socket's inode among our file descriptors; torch's clients use IPv6
    sockets with IPv4-mapped addresses). True where /proc is absent."""
    rows = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            with open(table) as f:
                rows += [(width, r.split()) for r in f.read().splitlines()[1:]]
        except OSError:
            if width == 4:
                return True
    wants = {w: (_hex_address(peer, w), _hex_address(local, w)) for w in (4, 16)}
    inode = next((r[9] for w, r in rows if tuple(r[1:3]) == wants[w]), None)
    if inode is None:
        return False
    with suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == f"socket:[{inode}]":
                    return True
    return False


def _hex_address(addr: tuple, width: int) -> str:
    """An IPv4 address and port as /proc/net/tcp (``width`` 4) or, IPv4-mapped, as
    /proc/net/tcp6 (16) writes them: 32-bit words in host order."""
    packed = socket.inet_aton(addr[0])
    if width == 16:
        packed = b"\0" * 10 + b"\xff\xff" + packed
    words = "".join(f"{int.from_bytes(packed[i:i + 4], 'little'):08X}"
                    for i in range(0, width, 4))
    return f"{words}:{addr[1]:04X}"
