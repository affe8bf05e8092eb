"""Where a meeting's TCP store listens, and who may talk to it.

torch's ``TCPStore`` server listens on every interface of its host, whatever host name
it is given, and answers anyone. Here the host binds the socket itself (torch's
``master_listen_fd``) at the address the caller names: ``listen`` (an IPv4 address or
an interface name), else the ``host`` the others dial (``127.0.0.1`` when every rank is
on one machine). With a token (``token=`` or ``$RESHARD_TOKEN``), that address holds a
:class:`reshard.gate.Gate` instead and the real store listens on a loopback port only
the gate dials; every other rank reaches it through its own
:class:`reshard.gate.Relay`.

Whichever job starts first, a rank whose token is missing, extra or different is
refused by name, and leaves a notice (:data:`TOKEN_NOTICE_KEY`) where the other job's
ranks, waiting in the store, read it at once: through the gate (which writes it into
the store it guards), or, holding a token itself, straight into a store without a gate.
See ``docs/security.md``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from reshard.errors import AuthError, ConfigError
from reshard.gate import (
    BANNER_WAIT_S,
    NOTICES,
    TOKEN_ENV,
    Gate,
    Key,
    Relay,
    TokenRefused,
    is_gate,
    resolve_key,
    tell,
)

__all__ = ["REFUSED_KEY", "TOKEN_NOTICE_KEY", "ipv4_of", "listen_address", "open_store",
           "refusals", "token_notice", "token_notices"]

#: Where the host counts connections its gate refused (read when a meeting times out).
REFUSED_KEY = "reshard/gate/refused"
#: What a rank of the other job said of its token when it was refused or left: "none"
#: (it holds none), "other" (a different one) or "extra" (one, and this store has no gate).
TOKEN_NOTICE_KEY = "reshard/token/notice"
TRY_S = 0.5  # torch's client retries against a gate until its timeout: this long a try
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class _Store(dist.TCPStore):
    """A ``TCPStore`` that keeps its gate or relay alive as long as itself."""

    door: Gate | Relay | None = None

    def __del__(self) -> None:
        if self.door is not None:
            self.door.close()


def open_store(host: str, port: int, world_size: int | None, *, is_server: bool,
               timeout: timedelta, token: str | bytes | Key | None = None,
               listen: str | None = None) -> Any:
    """The store of a meeting at ``host:port``, hosted here if ``is_server``."""
    key = resolve_key(token)
    if is_server:
        where = listen_address(listen or host)
        public = _bound_socket(where, port, "listen" if listen else "host",
                               listening=key is None)  # a gate listens once it can answer
        if key is None:
            return _Store(where, port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=public.detach())
        return _gated_store(public, world_size, key, timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    if key is None:
        return _client_without_token(host, port, world_size, timeout, deadline)
    return _client_with_token(host, port, world_size, key, timeout, deadline)


def _client_without_token(host: str, port: int, world_size: int | None,
                          timeout: timedelta, deadline: float) -> Any:
    """torch's client, once something listens at ``host:port``; ``AuthError`` naming the
    token if a gate answers, however late (its banner comes first; a plain store never
    speaks first, and torch's client never gets into a gate). Each try of torch's
    client is twice as long as the last, for a store far away."""
    try_s = TRY_S
    while True:
        if is_gate(host, port, until=deadline):
            raise _token_missing(host, port)
        try:
            store = _plain_client(host, port, world_size, deadline, try_s)
        except Exception as e:  # a gate slower than the probe, or nothing there yet
            if is_gate(host, port, BANNER_WAIT_S):
                raise _token_missing(host, port) from e
            if time.monotonic() >= deadline:
                raise
            try_s *= 2
            continue
        store.set_timeout(timeout)
        return store


def _token_missing(host: str, port: int) -> AuthError:
    tell(host, port, "none")  # the gate's host hears it and tells its ranks
    return AuthError(f"the store at {host}:{port} takes only ranks holding a token: the other "
                     f"job set one, this rank has none (${TOKEN_ENV} unset, no token=); give "
                     "this job the same token; nothing was moved")


def _client_with_token(host: str, port: int, world_size: int | None, key: Key,
                       timeout: timedelta, deadline: float) -> Any:
    """A client through a :class:`Relay` of its own, once a gate answers at ``host:port``;
    ``AuthError`` naming the token if the gate refuses this one or if torch's own client
    gets in there (a store without a gate)."""
    try:
        relay = Relay(host, port, key, timeout=max(deadline - time.monotonic(), 0.0),
                      on_silence=lambda: _refuse_plain_store(host, port, deadline))
    except TokenRefused as e:
        tell(host, port, "other")
        raise AuthError(str(e)) from None
    store = _Store("127.0.0.1", relay.port, world_size, is_master=False, timeout=timeout,
                   wait_for_workers=False)
    store.door = relay
    return store


def _refuse_plain_store(host: str, port: int, deadline: float) -> None:
    """``AuthError`` naming the token if torch's own client gets into the store at
    ``host:port``: one without a gate, which a rank holding a token does not join. It
    leaves a notice there first (that store is open to all anyway), so that the other
    job's ranks learn why at once. A gate slower than the probe refuses the client: then
    nothing is said and the relay goes on."""
    try:
        plain = _plain_client(host, port, None, deadline)
    except Exception:
        return
    with suppress(Exception):
        _leave_notice(plain, "extra")
    raise AuthError(f"the store at {host}:{port} has no gate: this rank holds a token "
                    f"(${TOKEN_ENV} or token=) and the other job none; give both jobs the "
                    "same token (or neither); nothing was moved")


def _plain_client(host: str, port: int, world_size: int | None, deadline: float,
                  try_s: float = TRY_S) -> Any:
    """torch's own store client, trying for at most ``try_s`` (torch retries its
    connection, and its handshake with a gate, until its timeout)."""
    left = min(try_s, deadline - time.monotonic())
    return dist.TCPStore(host, port, world_size, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=max(left, 0.01)))


def _gated_store(public: socket.socket, world_size: int | None, key: Key,
                 timeout: timedelta) -> Any:
    inner = _bound_socket("127.0.0.1", 0, "the inner store")
    inner_port = inner.getsockname()[1]
    store = _Store("127.0.0.1", inner_port, world_size, is_master=True, timeout=timeout,
                   wait_for_workers=False, master_listen_fd=inner.detach())
    public.listen(512)  # not before: a rank without a token dials until it hears a banner
    store.door = Gate(public, ("127.0.0.1", inner_port), key,
                      on_refused=_refusal_counter(inner_port, timeout))
    return store


def _refusal_counter(inner_port: int, timeout: timedelta):
    """Counts refused connections in the store (its own client, made on first use), so
    that a rank whose meeting times out can say why, and writes what a refused rank said
    of its token (:data:`TOKEN_NOTICE_KEY`), which the host's ranks watch for."""
    lock, client = threading.Lock(), []

    def note(why: str, notice: str | None) -> None:
        with lock:
            if not client:
                client.append(dist.TCPStore("127.0.0.1", inner_port, None, is_master=False,
                                            timeout=timeout))
            client[0].add(REFUSED_KEY, 1)
            client[0].set(REFUSED_KEY + "/last", why)
            if notice is not None:
                _leave_notice(client[0], notice)

    return note


def refusals(store: Any) -> str:
    """A sentence on the connections the gate refused, or "" (none, or no gate)."""
    try:
        if not store.check([REFUSED_KEY]):
            return ""
        n = store.add(REFUSED_KEY, 0)
        last = store.get(REFUSED_KEY + "/last").decode()
    except Exception:
        return ""
    return (f"; the store's gate refused {n} connection(s), the last: {last} (check that "
            "both jobs hold the same token)")


def _leave_notice(store: Any, notice: str) -> None:
    store.set(TOKEN_NOTICE_KEY, notice)
    store.add(TOKEN_NOTICE_KEY + "/count", 1)


def token_notices(store: Any) -> int:
    """How many ranks of the other job left a token notice."""
    return store.add(TOKEN_NOTICE_KEY + "/count", 0)


def token_notice(store: Any) -> str | None:
    """What a rank of the other job said of its token ("none", "other", "extra"; see
    :data:`TOKEN_NOTICE_KEY`), or None."""
    try:
        if not store.check([TOKEN_NOTICE_KEY]):
            return None
        said = store.get(TOKEN_NOTICE_KEY).decode()
    except Exception:
        return None
    return said if said in (*NOTICES, "extra") else None


def listen_address(where: str) -> str:
    """An IPv4 address to bind: ``where`` itself, or the address of the interface it
    names (``eth0``); host names resolve."""
    try:
        return str(ipaddress.ip_address(where))
    except ValueError:
        pass
    found = ipv4_of(where)
    if found is not None:
        return found
    try:
        return socket.gethostbyname(where)
    except OSError as e:
        raise ConfigError(f"listen / host must be an IPv4 address, an interface or a host "
                          f"name of this machine, got {where!r} ({e})") from e


def _bound_socket(address: str, port: int, what: str, listening: bool = True) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen at {address}:{port} ({what}): {e}") from e
    if listening:
        sock.listen(512)
    return sock


def ipv4_of(name: str) -> str | None:
    """The IPv4 address of this machine's interface ``name``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s",
                                                                       name.encode()[:15]))
        except OSError:  # no such interface, or no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])
