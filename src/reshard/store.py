"""Where a meeting's TCP store listens, and who may talk to it.

torch's ``TCPStore`` server listens on every interface of its host, whatever host name
it is given, and answers anyone. Here the host binds the socket itself (torch's
``master_listen_fd``) at the address the caller names: ``listen`` (an IPv4 address or
an interface name), else the ``host`` the others dial (``127.0.0.1`` when every rank is
on one machine). With a token (``token=`` or ``$RESHARD_TOKEN``), that address holds a
:class:`reshard.gate.Gate` instead and the real store listens on a loopback port only
the gate dials; every other rank reaches it through its own
:class:`reshard.gate.Relay`. See ``docs/security.md``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from reshard.errors import AuthError, ConfigError
from reshard.gate import TOKEN_ENV, Gate, Key, Relay, is_gate, resolve_key

__all__ = ["REFUSED_KEY", "ipv4_of", "listen_address", "open_store"]

#: Where the host counts connections its gate refused (read when a meeting times out).
REFUSED_KEY = "reshard/gate/refused"
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
        public = _bound_socket(where, port, "listen" if listen else "host")
        if key is None:
            return _Store(where, port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=public.detach())
        return _gated_store(public, world_size, key, timeout)
    if key is None:
        if is_gate(host, port):
            raise AuthError(f"the store at {host}:{port} takes only ranks holding a token "
                            f"(the other job set one): give this job the same token "
                            f"(${TOKEN_ENV} or token=); nothing was moved")
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout,
                             wait_for_workers=False)
    relay = Relay(host, port, key, timeout=timeout.total_seconds())
    store = _Store("127.0.0.1", relay.port, world_size, is_master=False, timeout=timeout,
                   wait_for_workers=False)
    store.door = relay
    return store


def _gated_store(public: socket.socket, world_size: int | None, key: Key,
                 timeout: timedelta) -> Any:
    inner = _bound_socket("127.0.0.1", 0, "the inner store")
    inner_port = inner.getsockname()[1]
    store = _Store("127.0.0.1", inner_port, world_size, is_master=True, timeout=timeout,
                   wait_for_workers=False, master_listen_fd=inner.detach())
    store.door = Gate(public, ("127.0.0.1", inner_port), key,
                      on_refused=_refusal_counter(inner_port, timeout))
    return store


def _refusal_counter(inner_port: int, timeout: timedelta):
    """Counts refused connections in the store (its own client, made on first use), so
    that a rank whose meeting times out can say why."""
    lock, client = threading.Lock(), []

    def note(why: str) -> None:
        with lock:
            if not client:
                client.append(dist.TCPStore("127.0.0.1", inner_port, None, is_master=False,
                                            timeout=timeout))
            client[0].add(REFUSED_KEY, 1)
            client[0].set(REFUSED_KEY + "/last", why)

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


def _bound_socket(address: str, port: int, what: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen at {address}:{port} ({what}): {e}") from e
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
