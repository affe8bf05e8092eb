"""reshard's vLLM plugin: after every commit of new weights, no request may read a KV
block computed with the old ones.

vLLM V1 keeps a prefix cache (on by default): the KV blocks of every full prompt block
stay cached, keyed by their tokens alone, and a later request with the same prefix reads
them instead of computing them. A refit changes the weights, not the tokens, so without
a reset the next request with a cached prefix (an RL run's shared system prompt or chat
template) is answered from KV of the previous version. The cache lives in the engine
core's scheduler, which no worker can reach; this plugin runs in the engine core.

vLLM loads it in every one of its processes (entry point ``vllm.general_plugins``,
``reshard = "reshard.integrations.vllm.plugin:load"``, installed with the package).
There it wraps ``EngineCore.collective_rpc``, the one door of every worker call (offline
``LLM``, ``LLMEngine``, ``AsyncLLM`` / ``vllm serve``, Ray actors holding an ``LLM``):
when a call committed new weights -- ``reshard_refit`` or ``reshard_bootstrap`` (a new
engine filled from its peers) with a committed result, or ``finish_weight_update``
(vLLM's weight-transfer protocol, whatever the backend) -- the engine core, before it
schedules anything else:

* resets the prefix cache with ``reset_running_requests=True``: requests in flight are
  preempted and put back in the waiting queue; when they run again they recompute their
  whole KV (prompt and the tokens generated so far) with the new weights. The tokens they
  generated before the commit stay in their output (those came from the old version);
  every token after it comes from the new weights and KV computed with them;
* clears the encoder cache of a multimodal model (vision embeddings are weights' output);
* sets the engine's ``weight_version`` (attached to every output) to the committed
  trainer step, for ``reshard_refit`` (``finish_weight_update`` takes it from the caller).

While any worker call runs, the engine core waits for the workers' replies asleep instead
of spinning (:func:`reshard.integrations.vllm.internals.replies_asleep`): vLLM's reader
spins for its first second, a busy process beside the workers and the trainer ranks a
refit needs (measured with a 3 s worker call on an idle host: 0.99 s of the engine
core's CPU without, none with it). It looks at the reply queues every 10 ms all the
same: vLLM's writer drops the notification of a reply that follows the previous one
within about a millisecond, which a reader that does not spin would otherwise find only
at vLLM's 5 s recheck (every served refit's finish stalled 5 s that way).

Cost: the next requests recompute their prefixes once (a cold cache); nothing else.
The worker extension refuses to meet a trainer in an engine where this plugin is not
loaded (``VLLM_PLUGINS`` set without ``reshard``): see
:func:`reshard.integrations.vllm.state.require_plugin`.

It also keeps vLLM's weight-transfer protocol (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``: the HTTP routes
of ``vllm serve``, ``LLM``'s methods, the Ray actors) safe to call in any order: the
engine core checks each call against the protocol before any worker sees it
(:class:`ProtocolGuard`) and refuses, with a clear error, a call out of order (finish
before start, two starts), an unknown field or a background update where the staging
cannot overlap. A worker that raised would leave vLLM 0.32's executor reading the next
call's replies as this one's; a refused call reaches no worker, and the engine goes on
serving as it was. With the ``reshard`` backend the workers never raise: the engine core
asks them how the call went (:func:`reshard.integrations.vllm.worker.outcome`) and
raises there, naming the ranks and the cause. And it registers the ``reshard`` backend
in vLLM's weight-transfer registries (worker and trainer side) in every process.

Last, an engine started with ``$RESHARD_PEERS`` fills itself from those live peers as it
starts, before it serves (:mod:`reshard.integrations.vllm.join`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["COMMITTING", "PLUGIN_NAME", "ProtocolGuard", "committed", "load", "loaded"]

log = logging.getLogger("reshard.vllm")

PLUGIN_NAME = "reshard"
#: Worker calls after which the live weights may be a new version.
COMMITTING = ("reshard_refit", "reshard_bootstrap", "finish_weight_update")
#: Those of them whose replies say, per rank, whether it committed, and the version.
_REPORTING = COMMITTING[:2]
_LOADED = False


def loaded() -> bool:
    """Whether vLLM loaded this plugin in this process."""
    return _LOADED


def committed(method: Any, results: Any) -> int | bool:
    """Whether a worker call committed new weights: the committed trainer step for a
    ``reshard_refit`` (or ``reshard_bootstrap``) that every rank committed, ``True`` for
    ``finish_weight_update`` (any backend), ``False`` otherwise."""
    if method == "finish_weight_update":
        return True
    if method not in _REPORTING or not isinstance(results, list) or not results:
        return False
    done = [r for r in results if isinstance(r, dict) and r.get("committed")]
    if not done:
        return False
    return done[0].get("version", True)


def _after_commit(core: Any, version: Any) -> None:
    """In the engine core, between two scheduler steps: no KV of an older version left."""
    if not core.reset_prefix_cache(reset_running_requests=True, reset_connector=True):
        raise RuntimeError("vLLM could not reset its prefix cache after a weight commit")
    if getattr(core.vllm_config.model_config, "is_multimodal_model", False):
        core.reset_encoder_cache()
    if version is not True:
        core.set_weight_version(str(version))
    log.debug("reshard: prefix cache reset after a commit (version %s)", version)


#: The weight-transfer protocol's calls, as the engine core's ``collective_rpc`` sees them.
PROTOCOL = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
            "finish_weight_update", "shutdown_weight_transfer_engine")


class ProtocolGuard:
    """The weight-transfer protocol's state in one engine core: which calls may come
    next. ``check`` raises ``ConfigError`` (before any worker is called) for a call out of
    order or with fields the ``reshard`` backend does not know; ``done`` records a call
    that went through."""

    def __init__(self, backend: str | None) -> None:
        self.backend = backend
        self.initialized = False  # a reshard init that every rank completed
        self.active = False  # between start_weight_update and finish_weight_update
        self.staging = "shadow"

    @property
    def reshard(self) -> bool:
        return self.backend == "reshard"

    def check(self, method: str, kwargs: dict[str, Any]) -> None:
        from reshard.errors import ConfigError
        from reshard.integrations.vllm import worker as w

        if method == "init_weight_transfer_engine" or method == "shutdown_weight_transfer_engine":
            if self.active:
                raise ConfigError(f"{method}: a weight update is in progress; call "
                                 "finish_weight_update first (nothing was changed)")
            if self.reshard and method == "init_weight_transfer_engine":
                info = w.parse_fields(w.ReshardInitInfo, kwargs.get("init_info"), method)
                self.staging = info.staging
        elif method == "start_weight_update":
            if self.active:
                raise ConfigError("start_weight_update: a weight update is already in "
                                 "progress (two starts); call finish_weight_update first "
                                 "(nothing was changed)")
            if self.reshard and not self.initialized:
                raise ConfigError("start_weight_update: call init_weight_transfer_engine "
                                 "first, so the engine meets the trainer (nothing was changed)")
        elif method in ("update_weights", "finish_weight_update"):
            if not self.active:
                raise ConfigError(f"{method} before start_weight_update: call "
                                 "start_weight_update first (nothing was changed)")
            if self.reshard and method == "update_weights":
                infos = kwargs.get("update_info")
                for info in infos if isinstance(infos, list) else [infos]:
                    parsed = w.parse_fields(w.ReshardUpdateInfo, info, method)
                    if parsed.background and self.staging != "shadow":
                        raise ConfigError(
                            "update_weights: background=True cannot overlap generation "
                            f"with staging={self.staging!r} (the transfer would write the "
                            "live weights while they serve); init with staging='shadow' "
                            "or update with background=False (nothing was changed)")

    def done(self, method: str) -> None:
        if method == "start_weight_update":
            self.active = True
        elif method == "finish_weight_update":
            self.active = False
        elif method == "init_weight_transfer_engine":
            self.initialized = True
        elif method == "shutdown_weight_transfer_engine":
            self.initialized = False


def _guard(core: Any) -> ProtocolGuard:
    guard = getattr(core, "_reshard_guard", None)
    if guard is None:
        config = getattr(core.vllm_config, "weight_transfer_config", None)
        guard = core._reshard_guard = ProtocolGuard(getattr(config, "backend", None))
    return guard


def _reshard_call(core: Any, original: Any, method: str, timeout: float | None,
                  args: tuple, kwargs: dict[str, Any]) -> Any:
    """A protocol call to the ``reshard`` backend: the workers never raise; their
    outcome decides, here, whether the call failed."""
    from reshard.errors import TransferError
    from reshard.integrations.vllm.worker import failures, outcome

    results = original(core, method, timeout, args, kwargs)
    if method not in ("init_weight_transfer_engine", "finish_weight_update"):
        return results
    reports = original(core, outcome, timeout, (), {})
    failed = failures(reports)
    if method == "finish_weight_update":
        committed_ = [r for r in reports if r and r.get("committed")]
        if committed_ and not failed:
            _after_commit(core, committed_[0]["version"])
    if failed:
        raise TransferError(f"{method} failed on vLLM rank(s) {[r['rank'] for r in failed]}: "
                         f"{failed[0]['error']}; the engine serves weight version "
                         f"{core.get_weight_version()!r} as before")
    return results


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        from reshard.integrations.vllm.internals import replies_asleep

        with replies_asleep(getattr(self, "model_executor", None)):
            return _call(self, method, timeout, args, kwargs)

    def _call(self: Any, method: Any, timeout: float | None, args: tuple,
              kwargs: dict[str, Any] | None) -> Any:
        if method in PROTOCOL:
            guard = _guard(self)
            guard.check(method, kwargs or {})
            if guard.reshard:
                try:
                    results = _reshard_call(self, original, method, timeout, args,
                                            kwargs or {})
                finally:  # the workers ended the session either way
                    if method == "finish_weight_update":
                        guard.active = False
                guard.done(method)
                return results
            results = original(self, method, timeout, args, kwargs)
            guard.done(method)
        else:
            results = original(self, method, timeout, args, kwargs)
        version = committed(method, results)
        if version is not False:
            _after_commit(self, version)
            for r in results if method in _REPORTING else ():
                if isinstance(r, dict):
                    r["prefix_cache_reset"] = True
        return results

    collective_rpc.__reshard_wrapped__ = True
    return collective_rpc


def _register_backends() -> None:
    """The ``reshard`` backend in vLLM's weight-transfer registries, loaded lazily."""
    import contextlib

    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
            (WeightTransferEngineFactory, "reshard.integrations.vllm.worker",
             "ReshardWeightTransferEngine"),
            (WeightTransferTrainerFactory, "reshard.integrations.vllm.trainer",
             "ReshardTrainerEngine")):
        with contextlib.suppress(ValueError):  # already registered in this process
            factory.register_engine(PLUGIN_NAME, module, cls)


def load() -> None:
    """The plugin's entry point (vLLM calls it once per process; idempotent)."""
    global _LOADED
    from vllm.v1.engine.core import EngineCore

    if not getattr(EngineCore.collective_rpc, "__reshard_wrapped__", False):
        EngineCore.collective_rpc = _wrap(EngineCore.collective_rpc)
    if not getattr(EngineCore._initialize_kv_caches, "__reshard_wrapped__", False):
        from reshard.integrations.vllm.join import wrap

        EngineCore._initialize_kv_caches = wrap(EngineCore._initialize_kv_caches)
    _register_backends()
    _LOADED = True
