"""A vLLM engine that fills itself from live peers as it starts, before it serves.

A new or restarted ``vllm serve`` replica of an RL fleet names the live servers it is
to be filled from; at start, once its model is loaded and compiled and before it tells
its front end it is ready (so ``/health`` and every request wait for it), its engine core
asks each peer to lend its committed weights and bootstraps from them
(:meth:`~reshard.integrations.vllm.worker.ReshardWorkerExtension.reshard_bootstrap`):
the engine comes up at the fleet's current version, labelled with it, without the
trainer and without a checkpoint of that version::

    RESHARD_PEERS=http://10.0.0.5:8000,http://10.0.0.6:8000 RESHARD_TOKEN=... \\
    vllm serve MODEL --tensor-parallel-size 2 \\
        --weight-transfer-config '{"backend": "reshard"}' \\
        --worker-extension-cls reshard.integrations.vllm.ReshardWorkerExtension

* ``RESHARD_PEERS``: the peers' base URLs, comma-separated. Each is a ``vllm serve`` of
  the same model with the reshard worker extension, refitted at least once, and its RL
  routes on (``VLLM_SERVER_DEV_MODE=1``: the new engine asks through its
  ``/collective_rpc``). Any TP size on either side.
* ``RESHARD_PEERS_MEET`` (optional): ``host[:port]`` at which the peers reach this
  engine's rank 0, which hosts the meeting; by default the address this host reaches the
  first peer from, and a free port.
* ``RESHARD_TOKEN``: the peers' meeting token (their trainer's), as for a refit.

Before any peer is asked to lend, every peer is asked for its status: a peer that cannot
be reached, has no reshard state, or holds no whole committed version stops the start
with an error naming it, nothing asked of the others. A bootstrap that fails (a peer lost
midway, peers at different versions) stops the start too, the engine never serving: an
engine that came up on its checkpoint's weights while its operator expected the fleet's
version would serve stale rollouts unnoticed. Then the trainer meets it as any other
engine (``init_weight_transfer_engine``); the version it was filled with is kept and the
next refit is dense (a new meeting has no sparse base).

The hook: :func:`wrap` wraps ``EngineCore._initialize_kv_caches`` (the plugin does it in
every process), the last step of an engine core's start that touches the workers: the
model is loaded, compiled and warmed up, as it is before any refit, and no request has
been scheduled (the prefix cache is empty, so nothing needs resetting).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from reshard.errors import ConfigError, ReshardError

__all__ = ["ADDRESS_ENV", "PEERS_ENV", "ask", "fill_from_peers", "meeting_address", "peers",
           "wrap"]

#: under vLLM's own logger: the engine core's log shows the fill beside vLLM's start
log = logging.getLogger("vllm.reshard.join")

PEERS_ENV = "RESHARD_PEERS"
ADDRESS_ENV = "RESHARD_PEERS_MEET"
#: Seconds an HTTP call to a peer may take (lending returns at once; ``reshard_lent``
#: waits for the lending, itself bounded by the meeting's deadlines).
HTTP_TIMEOUT_S = 300.0


def peers(value: str | None = None) -> list[str]:
    """The peers' base URLs from ``value`` (else ``$RESHARD_PEERS``); [] when unset."""
    raw = os.environ.get(PEERS_ENV, "") if value is None else value
    urls = [u.strip().rstrip("/") for u in raw.split(",") if u.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{PEERS_ENV}: {url!r} is not a peer's base URL "
                              "(http://host:port, comma-separated)")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{PEERS_ENV}: a peer is named twice in {raw!r}")
    return urls


def meeting_address(urls: list[str], value: str | None = None) -> tuple[str, int]:
    """Where the peers meet this engine's rank 0: ``value`` (else ``$RESHARD_PEERS_MEET``)
    as ``host[:port]``, else the local address this host reaches the first peer from and
    a free port."""
    from reshard.comm import free_port

    raw = os.environ.get(ADDRESS_ENV, "") if value is None else value
    if raw:
        host, _, port = raw.rpartition(":") if ":" in raw else (raw, "", "")
        try:
            return host, int(port) if port else free_port(host)
        except ValueError:
            raise ConfigError(f"{ADDRESS_ENV}: {raw!r} is not host[:port]") from None
    first = urlsplit(urls[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((first.hostname, first.port or 80))
        host = s.getsockname()[0]
    return host, free_port(host)


def ask(url: str, method: str, *args: Any) -> list[Any]:
    """``collective_rpc`` ``method`` on every rank of the peer at ``url`` (its dev route):
    one reply per rank, or ``ReshardError`` naming the peer and why."""
    body = json.dumps({"method": method, "args": list(args)}).encode()
    req = urllib.request.Request(f"{url}/collective_rpc", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())["results"]
    except urllib.error.HTTPError as e:
        hint = (" (its RL routes are off: start it with VLLM_SERVER_DEV_MODE=1)"
                if e.code == 404 else "")
        raise ReshardError(f"peer {url}: {method} answered HTTP {e.code}{hint}: "
                           f"{e.read()[:500].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        raise ReshardError(f"peer {url}: {method} failed: {e}") from None


def _problems(url: str, replies: list[Any]) -> list[str]:
    """Why the peer at ``url`` cannot lend, per rank (none: it can)."""
    out = []
    for r in replies:
        if not isinstance(r, dict) or not r.get("ok", True):
            error = r.get("error") if isinstance(r, dict) else r
            out.append(f"peer {url}: {error}")
        elif not r.get("lendable", False):
            out.append(f"peer {url} rank {r.get('rank')}: holds no whole committed version "
                       f"(version {r.get('version')}): refit it first")
    return out


def fill_from_peers(core: Any, rpc: Any, urls: list[str], host: str, port: int
                    ) -> dict[str, Any]:
    """Fill the engine of ``core`` (an ``EngineCore`` starting up) from the peers at
    ``urls``, its rank 0 hosting the meeting at ``host:port``; ``rpc`` is the engine
    core's own ``collective_rpc`` (unwrapped: no scheduler exists yet). Returns what was
    done; raises ``ReshardError`` when it was not."""
    t0 = time.perf_counter()
    problems = [p for url in urls for p in _problems(url, ask(url, "reshard_status"))]
    if problems:
        raise ReshardError("cannot fill this engine from its peers (nothing was asked of "
                           "them): " + "; ".join(problems))
    log.info("reshard: filling this engine from %d peer(s) %s, meeting at %s:%d",
             len(urls), urls, host, port)
    for i, url in enumerate(urls):
        refused = [r for r in ask(url, "reshard_lend", host, port, i)
                   if not (isinstance(r, dict) and r.get("ok", True))]
        if refused:  # it would never come to the meeting: say so now, not at its deadline
            raise ReshardError(f"peer {url} refused to lend: {refused[0]}; the peers asked "
                               "before it give up at their meeting's deadline")
    results = rpc(core, "reshard_bootstrap", None, (host, port, len(urls)), {})
    lent = {url: ask(url, "reshard_lent") for url in urls}
    failed = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
    if failed or not all(r.get("committed") for r in results):
        error = failed[0].get("error") if failed and isinstance(failed[0], dict) else results
        raise ReshardError(f"filling this engine from its peers {urls} failed: {error}; "
                           f"what the peers said: {lent}")
    version = results[0]["version"]
    core.set_weight_version(str(version))
    done = {"version": version, "peers": urls, "seconds": time.perf_counter() - t0,
            "bytes_received": sum(r.get("bytes_received", 0) for r in results),
            "bytes_lent": {url: sum(r.get("bytes_sent", 0) for r in rs)
                           for url, rs in lent.items()}}
    log.info("reshard: filled from %d peer(s) at version %s: %d bytes in %.2f s (%s)",
             len(urls), version, done["bytes_received"], done["seconds"], done["bytes_lent"])
    return done


def wrap(original: Any) -> Any:
    """``EngineCore._initialize_kv_caches``, then the fill when ``$RESHARD_PEERS`` names
    peers."""

    @functools.wraps(original)
    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        out = original(self, vllm_config)
        urls = peers()
        if urls:
            if vllm_config.parallel_config.data_parallel_size > 1:
                raise ConfigError(
                    f"{PEERS_ENV}: a server with data_parallel_size="
                    f"{vllm_config.parallel_config.data_parallel_size} would ask its peers "
                    "to lend once per engine core, and a peer lends to one engine at a "
                    "time; start one server per replica (data_parallel_size=1)")
            from reshard.integrations.vllm.internals import replies_asleep

            rpc = getattr(type(self).collective_rpc, "__wrapped__", type(self).collective_rpc)
            host, port = meeting_address(urls)
            with replies_asleep(getattr(self, "model_executor", None)):
                fill_from_peers(self, rpc, urls, host, port)
        return out

    _initialize_kv_caches.__reshard_wrapped__ = True
    return _initialize_kv_caches
