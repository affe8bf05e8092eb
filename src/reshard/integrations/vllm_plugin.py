"""reshard's vLLM plugin: after every commit of new weights, no request may read a KV
block computed with the old ones.

vLLM V1 keeps a prefix cache (on by default): the KV blocks of every full prompt block
stay cached, keyed by their tokens alone, and a later request with the same prefix reads
them instead of computing them. A refit changes the weights, not the tokens, so without
a reset the next request with a cached prefix (an RL run's shared system prompt or chat
template) is answered from KV of the previous version. The cache lives in the engine
core's scheduler, which no worker can reach; this plugin runs in the engine core.

vLLM loads it in every one of its processes (entry point ``vllm.general_plugins``,
``reshard = "reshard.integrations.vllm_plugin:load"``, installed with the package).
There it wraps ``EngineCore.collective_rpc``, the one door of every worker call (offline
``LLM``, ``LLMEngine``, ``AsyncLLM`` / ``vllm serve``, Ray actors holding an ``LLM``):
when a call committed new weights -- ``reshard_refit`` with a committed result, or
``finish_weight_update`` (vLLM's weight-transfer protocol, whatever the backend) -- the
engine core, before it schedules anything else:

* resets the prefix cache with ``reset_running_requests=True``: requests in flight are
  preempted and put back in the waiting queue; when they run again they recompute their
  whole KV (prompt and the tokens generated so far) with the new weights. The tokens they
  generated before the commit stay in their output (those came from the old version);
  every token after it comes from the new weights and KV computed with them;
* clears the encoder cache of a multimodal model (vision embeddings are weights' output);
* sets the engine's ``weight_version`` (attached to every output) to the committed
  trainer step, for ``reshard_refit`` (``finish_weight_update`` takes it from the caller).

Cost: the next requests recompute their prefixes once (a cold cache); nothing else.
The worker extension refuses to meet a trainer in an engine where this plugin is not
loaded (``VLLM_PLUGINS`` set without ``reshard``): see :func:`require_loaded`.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

__all__ = ["COMMITTING", "PLUGIN_NAME", "committed", "load", "loaded", "require_loaded"]

log = logging.getLogger("reshard.vllm")

PLUGIN_NAME = "reshard"
#: Worker calls after which the live weights may be a new version.
COMMITTING = ("reshard_refit", "finish_weight_update")
_LOADED = False


def loaded() -> bool:
    """Whether vLLM loaded this plugin in this process."""
    return _LOADED


def require_loaded() -> None:
    """Refuse to refit an engine whose engine core does not clear its prefix cache at a
    commit. vLLM loads general plugins in the engine core and in every worker alike, so
    a worker without the plugin means an engine core without it."""
    from reshard.errors import ReshardError

    if not _LOADED:
        raise ReshardError(
            "reshard's vLLM plugin is not loaded in this engine (VLLM_PLUGINS="
            f"{os.environ.get('VLLM_PLUGINS')!r}): it clears vLLM's prefix cache at every "
            "commit, without which requests after a refit read KV computed with the old "
            f"weights; add {PLUGIN_NAME!r} to VLLM_PLUGINS, or unset it")


def committed(method: Any, results: Any) -> int | bool:
    """Whether a worker call committed new weights: the committed trainer step for a
    ``reshard_refit`` that every rank committed, ``True`` for ``finish_weight_update``
    (any backend), ``False`` otherwise."""
    if method == "finish_weight_update":
        return True
    if method != "reshard_refit" or not isinstance(results, list) or not results:
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


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def collective_rpc(self: Any, method: Any, timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        results = original(self, method, timeout, args, kwargs)
        version = committed(method, results)
        if version is not False:
            _after_commit(self, version)
            for r in results if method == "reshard_refit" else ():
                if isinstance(r, dict):
                    r["prefix_cache_reset"] = True
        return results

    collective_rpc.__reshard_wrapped__ = True
    return collective_rpc


def load() -> None:
    """The plugin's entry point (vLLM calls it once per process; idempotent)."""
    global _LOADED
    from vllm.v1.engine.core import EngineCore

    if not getattr(EngineCore.collective_rpc, "__reshard_wrapped__", False):
        EngineCore.collective_rpc = _wrap(EngineCore.collective_rpc)
    _LOADED = True
