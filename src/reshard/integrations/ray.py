"""What Ray actors need from reshard to meet: addresses, ports, the gloo interface.

RL frameworks (verl, OpenRLHF, NeMo RL, SkyRL) place trainer ranks and inference
engines as Ray actors. Weights between them go through reshard's own group (gloo or
NCCL over a TCP store), never through Ray's object store; Ray only carries the store's
address from the actor that hosts it (trainer rank 0) to the others::

    # trainer rank 0 (an actor), on its node:
    addr = pick_store_address(loopback=single_node)    # -> (host, port, token)
    # the driver passes ``addr`` to every trainer actor and to the engine actor; each:
    use_gloo_interface(addr.host if single_node else node_address())
    RefitSender(params, host=addr.host, port=addr.port, token=addr.token, ...)  # trainers
    collective(llm, "reshard_init", addr.host, addr.port, n_trainer,
               token=addr.token)                                              # engine actor

Pass the host explicitly: the node address Ray reports (``ray.util.get_node_ip_address``)
is the one other nodes reach, which need not be the loopback; on one node the loopback
is the safe choice for every actor. gloo picks the interface it listens on from
``GLOO_SOCKET_IFNAME`` (else from the host name): :func:`use_gloo_interface` sets it to
the interface holding a given address, before the group forms -- in an engine actor
before the engine starts, so that its worker processes inherit it.

:func:`init_local_cluster` starts a small local Ray (no dashboard, a small object store:
weights never go through it). Only :func:`init_local_cluster` and :func:`node_address`
import ``ray`` (the ``ray`` extra: ``pip install reshard[ray]``).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, NamedTuple

from reshard.comm import free_port
from reshard.errors import ConfigError
from reshard.gate import TOKEN_ENV, new_token
from reshard.store import ipv4_of

__all__ = ["StoreAddress", "free_port", "init_local_cluster", "interface_of", "node_address",
           "pick_store_address", "use_gloo_interface"]

LOOPBACK = "127.0.0.1"
#: Ray's object store for the RL loop: it carries rollouts and small results only.
OBJECT_STORE_BYTES = 128 << 20


class StoreAddress(NamedTuple):
    """Where the weight-update group meets: trainer rank 0's TCP store, and the token
    that lets a rank in (docs/security.md; it never shows in the repr). It travels to
    the actors as their arguments do, over Ray's own connections: turn on Ray's TLS
    where those cross an untrusted network."""

    host: str
    port: int
    token: str | None = None

    def __repr__(self) -> str:
        hidden = "<hidden>" if self.token else None
        return f"StoreAddress(host={self.host!r}, port={self.port}, token={hidden})"


def node_address(*, loopback: bool = False) -> str:
    """The address other actors reach this actor's node at: the loopback when every
    actor runs on one node (``loopback=True``), else the node address Ray reports."""
    if loopback:
        return LOOPBACK
    import ray

    return ray.util.get_node_ip_address()


def pick_store_address(*, loopback: bool = False, host: str | None = None,
                       token: str | None = None) -> StoreAddress:
    """Call in the actor that will host the store (trainer rank 0): its node's address
    (``host`` if given, else :func:`node_address`), a port free there, and the token:
    ``token``, else ``$RESHARD_TOKEN``, else a fresh one."""
    host = host or node_address(loopback=loopback)
    return StoreAddress(host, free_port(host), token or os.environ.get(TOKEN_ENV) or new_token())


def interface_of(address: str) -> str:
    """The name of this node's network interface holding the IPv4 ``address`` (``lo``
    for a loopback address)."""
    ip = ipaddress.ip_address(address)
    if ip.version != 4:
        raise ConfigError(f"interface_of takes an IPv4 address, got {address!r}")
    names = [name for _, name in socket.if_nameindex()]
    if ip.is_loopback:
        loop = [n for n in names if ipv4_of(n) is not None and
                ipaddress.ip_address(ipv4_of(n)).is_loopback]
        if loop:
            return loop[0]
    for name in names:
        if ipv4_of(name) == address:
            return name
    held = {n: ipv4_of(n) for n in names}
    raise ConfigError(f"no network interface of this node holds {address}; its interfaces "
                      f"hold {held}")


def use_gloo_interface(address: str) -> str:
    """Make gloo listen on the interface holding ``address`` in this process and the
    processes it starts later (``GLOO_SOCKET_IFNAME``); returns the interface name. Call
    it before the group forms (in an engine actor: before the engine starts)."""
    name = interface_of(address)
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def init_local_cluster(*, object_store_bytes: int = OBJECT_STORE_BYTES,
                       num_cpus: int | None = None, quiet: bool = True, **kwargs: Any) -> Any:
    """``ray.init`` for the RL loop on one machine: no dashboard, a small object store
    (weights never go through it), actors placed with ``num_cpus=0`` so that ``num_cpus``
    does not limit how many run. Extra keyword arguments go to ``ray.init``."""
    import ray

    return ray.init(num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
                    object_store_memory=object_store_bytes, include_dashboard=False,
                    log_to_driver=not quiet, **kwargs)
