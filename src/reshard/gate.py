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
peer and floods cost the gate one thread per pending connection, each bounded by one
deadline for the whole handshake, the oldest evicted past a cap; none blocks the accept
loop. A rank the gate refused (or, without a token, would refuse) says why on a fresh
connection, ``NOTICE`` and one byte in place of the hello (:func:`tell`), so that the
host's ranks learn it at once. See ``docs/security.md``.
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

from reshard.errors import AuthError, ConfigError, TokenRefused

__all__ = ["TOKEN_ENV", "AuthError", "Gate", "Key", "Relay", "TokenRefused", "is_gate",
           "new_token", "resolve_key", "tell"]

#: The environment variable a job's token comes from when none is passed.
TOKEN_ENV = "RESHARD_TOKEN"
MIN_TOKEN_CHARS = 16
MAGIC = b"RSHDGT1\x00"
NOTICE = b"RSHDNT1\x00"  # in place of MAGIC: a refused rank says why, in one byte
#: What a refused rank may say of itself: it holds no token, or another one.
NOTICES = {"none": b"N", "other": b"D"}
NONCE = 32
HANDSHAKE_TIMEOUT_S = 5.0  # the gate's deadline for a whole handshake
MAX_PENDING = 64  # handshakes in progress at the gate; past it the oldest is dropped
_EOF_RETRIES = 5  # a gate under a flood may drop a pending handshake: dial again
BANNER_WAIT_S = 2.0  # a client's deadline for its whole handshake (a plain store never answers)
PROBE_S = 0.1  # a rank without a token looks this long for a gate's banner
SILENCE_S = 1.0  # a rank with one waits this long for it before asking who else listens


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


def _left(deadline: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic()``); TimeoutError if none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the handshake's deadline passed")
    return left


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_left(deadline))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all by ``deadline``: one deadline however the peer spaces them."""
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_left(deadline))
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
    real store at ``inner`` (a loopback address only the host dials).

    ``on_refused(why, notice)`` hears of each refused connection: ``notice`` is what a
    refused rank said of itself (a key of ``NOTICES``), else None."""

    def __init__(self, listener: socket.socket, inner: tuple[str, int], key: Key, *,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 max_pending: int = MAX_PENDING,
                 on_refused: Callable[[str, str | None], None] | None = None) -> None:
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
        deadline = time.monotonic() + self.handshake_timeout  # for the whole handshake
        try:
            verdict = self._handshake(conn, deadline)
        except TimeoutError:
            verdict = "a connection that stalled past the handshake timeout", None
        except OSError:  # ConnectionError too
            verdict = "a connection closed before the handshake ended", None
        if verdict is not None:
            self._settle(conn)
            self._refuse(conn, f"{verdict[0]} from {peer[0]}:{peer[1]}", verdict[1])
            return
        try:
            conn.settimeout(None)
            inner = socket.create_connection(self.inner)
        except OSError:
            conn.close()
            return
        _join(conn, inner)

    def _handshake(self, conn: socket.socket, deadline: float) -> tuple[str, str | None] | None:
        """None if the peer proved it holds the key, else why not and what the peer said
        of itself (a notice), if anything."""
        mine = secrets.token_bytes(NONCE)
        _send(conn, MAGIC + mine, deadline)
        hello = _recv_exact(conn, len(MAGIC), deadline)
        if hello == NOTICE:
            said = _recv_exact(conn, 1, deadline)
            notice = next((k for k, code in NOTICES.items() if code == said), None)
            return f"a rank that said it holds {_HOLDS.get(notice, 'something unknown')}", notice
        if hello != MAGIC:
            return "a connection without the reshard handshake (no token?)", None
        theirs = _recv_exact(conn, NONCE, deadline)
        proof = _recv_exact(conn, 32, deadline)
        if not hmac.compare_digest(proof, self.key.mac(b"client", mine, theirs)):
            _send(conn, b"\x00", deadline)
            return "a wrong token", None
        if not self._settle(conn):  # evicted by a flood: the client dials again
            return "a connection evicted from the pending handshakes", None
        self.accepted += 1
        _send(conn, b"\x01" + self.key.mac(b"gate", theirs, mine), deadline)
        return None

    def _refuse(self, conn: socket.socket, why: str, notice: str | None) -> None:
        self.refused += 1
        with suppress(OSError):
            conn.close()
        if self.on_refused is not None and not self._closed:
            with suppress(Exception):
                self.on_refused(why, notice)


_HOLDS = {"none": "no token", "other": "a different token"}


def authenticate(sock: socket.socket, key: Key, where: str,
                 wait: float | None = None) -> None:
    """The client's half of the handshake on a connected socket, all of it within
    ``wait`` seconds (else the socket's timeout, else ``BANNER_WAIT_S``); raises
    ``TokenRefused`` if the gate refuses this key, ``AuthError`` if it does not prove it
    holds it, ``ConnectionError`` if the peer closes first, ``TimeoutError`` if it
    stalls."""
    deadline = time.monotonic() + (wait or sock.gettimeout() or BANNER_WAIT_S)
    if _recv_exact(sock, len(MAGIC), deadline) != MAGIC:
        raise AuthError(f"the store at {where} is not a reshard gate; nothing was moved")
    theirs, mine = _recv_exact(sock, NONCE, deadline), secrets.token_bytes(NONCE)
    _send(sock, MAGIC + mine + key.mac(b"client", theirs, mine), deadline)
    verdict = _recv_exact(sock, 1, deadline)
    if verdict != b"\x01":
        raise TokenRefused(f"the store at {where} refused this rank's token: the two jobs "
                           f"hold different tokens (${TOKEN_ENV} or token=); nothing was "
                           "moved")
    if not hmac.compare_digest(_recv_exact(sock, 32, deadline),
                               key.mac(b"gate", mine, theirs)):
        raise AuthError(f"the store at {where} did not prove it holds the token: not this "
                        "job's trainer; nothing was moved")


def is_gate(host: str, port: int, wait: float = PROBE_S, until: float | None = None) -> bool:
    """Whether ``host:port`` answers with a gate's banner within ``wait`` seconds of a
    connection, plus two connection times (a far host's round trips; a rank without a
    token asks, to say at once that the other job set one). With ``until`` (a
    ``time.monotonic()`` deadline), dials again while nothing listens there, until then,
    so that the answer does not depend on which job started first."""
    while True:
        start = time.monotonic()
        with suppress(OSError), socket.create_connection((host, port), max(wait, 1.0)) as sock:
            if sock.getsockname() != sock.getpeername():  # else a dial met itself: no one
                deadline = time.monotonic() + wait + 2 * (time.monotonic() - start)
                try:
                    return _recv_exact(sock, len(MAGIC), deadline) == MAGIC
                except OSError:  # silence, or closed: not a gate
                    return False
        if until is None or time.monotonic() >= until:
            return False
        time.sleep(0.05)


def tell(host: str, port: int, notice: str, wait: float = BANNER_WAIT_S) -> None:
    """Tell the gate at ``host:port`` why this rank leaves (``notice``: a key of
    ``NOTICES``), so that the ranks of the job behind it learn it at once rather than at
    their timeout. Best effort, within ``wait`` seconds; returns once the gate closed."""
    deadline = time.monotonic() + wait
    with suppress(OSError), socket.create_connection((host, port), timeout=wait) as sock:
        _recv_exact(sock, len(MAGIC) + NONCE, deadline)  # all it sends: then a clean close
        _send(sock, NOTICE + NOTICES[notice], deadline)
        while sock.recv(64):  # nothing comes: the gate reads the notice, then closes
            sock.settimeout(_left(deadline))


class Relay(_Door):
    """A rank's local door to a gated store: its store client connects to
    ``127.0.0.1:port``; each connection (from this process only, on Linux) is carried
    over a fresh authenticated connection to the gate.

    ``on_silence()`` runs if the first connection hears nothing for ``SILENCE_S`` plus
    two connection times (a gate speaks first, a plain store never does): it may raise
    to say what answers instead.
    """

    def __init__(self, host: str, port: int, key: Key, *, timeout: float,
                 on_silence: Callable[[], None] | None = None) -> None:
        self.where, self.key, self.timeout = f"{host}:{port}", key, timeout
        self.gate, self._on_silence = (host, port), on_silence
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        try:
            self._ready = [self._dial()]  # authenticate now: a refused token fails here
        except BaseException:
            self.listener.close()
            raise
        self._open("reshard-relay")

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def _dial(self) -> socket.socket:
        """A connection to the gate that passed the handshake. A gate not up yet is
        retried until ``timeout``; a refused token raises at once."""
        deadline, eofs = time.monotonic() + self.timeout, 0
        while True:
            left, start = deadline - time.monotonic(), time.monotonic()
            try:
                sock = socket.create_connection(self.gate, timeout=max(left, 0.1))
            except OSError as e:
                if left <= 0:
                    raise AuthError(f"no store answered at {self.where} within "
                                    f"{self.timeout:.0f} s ({e})") from e
                time.sleep(min(0.05, max(left, 0)))
                continue
            if sock.getsockname() == sock.getpeername():  # a dial that met itself: no one
                sock.close()
                if left <= 0:
                    raise AuthError(f"no store answered at {self.where} within "
                                    f"{self.timeout:.0f} s; nothing was moved")
                time.sleep(min(0.05, left))
                continue
            try:
                self._heard(sock, SILENCE_S + 2 * (time.monotonic() - start))
                authenticate(sock, self.key, self.where, BANNER_WAIT_S)
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

    def _heard(self, sock: socket.socket, wait: float) -> None:
        """Run ``on_silence`` (once) if ``sock`` hears nothing within ``wait`` seconds."""
        if self._on_silence is None:
            return
        sock.settimeout(wait)
        try:
            sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            self._on_silence()
        self._on_silence = None

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
