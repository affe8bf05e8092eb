"""Refit a running vLLM engine from a reshard trainer: every vLLM rank receives only its
own bytes, fused parameters (``qkv_proj``, ``gate_up_proj``, MoE ``w13``/``w2``) and the
padded vocabulary included; no rank ever receives a full sharded tensor.

Two ways in, one mechanism (:class:`ReshardState`):

* **Worker extension** (the path the tests and ``reshard.tools.demo_rl`` use)::

      llm = LLM(model=path, tensor_parallel_size=2,
                worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension")
      collective(llm, "reshard_init", host, port, trainer_size)  # while the trainer
      #   ranks build RefitSender(params, host=host, port=port, ...)
      collective(llm, "reshard_refit")  # while the trainer ranks call sender.refit(step)

* **Weight-transfer backend** ``"reshard"``, registered in vLLM's
  ``WeightTransferEngineFactory`` when the worker module loads -- which happens in every
  worker when vLLM resolves the ``worker_extension_cls``, before the engine is created::

      llm = LLM(..., worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension",
                weight_transfer_config={"backend": "reshard"})
      llm.init_weight_transfer_engine({"init_info": {"master_address": host,
                                                     "master_port": port, "trainer_size": 2}})
      llm.start_weight_update(); llm.update_weights({"update_info": {}})
      llm.finish_weight_update(weight_version=...)

  ``update_weights`` receives (RefitReceiver.refit) and ``finish_weight_update`` commits.
  A failed refit does not raise (see :func:`worker._reported`): ``collective(llm,
  "reshard_last")`` reports it and ``finish_weight_update`` then commits nothing.

vLLM 0.32 caveat: when a ``collective_rpc`` method raises on a worker, the executor stops
reading replies there and the later workers' replies are taken as the answers of the
next call, so no ``reshard_*`` method raises into vLLM; use :func:`collective` to get an
exception back in the caller.

Where it lives (each module readable alone, the door first):
:mod:`~reshard.integrations.vllm.worker` the worker extension, the weight-transfer backend
and :func:`collective`; :mod:`~reshard.integrations.vllm.state` one rank's side of a
refit (mapping, buffers, receive: how a refit lands on a rank is told there),
:mod:`~reshard.integrations.vllm.commit` its commit and swap,
:mod:`~reshard.integrations.vllm.verify` its check against vLLM's own loaders;
:mod:`~reshard.integrations.vllm.internals` the helpers that reach into vLLM's internals
(layerwise-reload metadata, loaders, reply queues), :mod:`~reshard.integrations.vllm.kernels`
its CPU kernels (packed GEMMs, MoE prepacking), :mod:`~reshard.integrations.vllm.memory`
the process's resident memory; :mod:`~reshard.integrations.vllm.mapping` (with its table,
:mod:`~reshard.integrations.vllm.rules`, and :mod:`~reshard.integrations.vllm.fp8`) the
HF -> vLLM mapping, pure Python; :mod:`~reshard.integrations.vllm.plugin` the engine
core's side; :mod:`~reshard.integrations.vllm.trainer` the trainer side of vLLM's
weight-sync protocol. This package is the door: the names users pass to vLLM
(``"reshard.integrations.vllm.ReshardWorkerExtension"``) and import, each loaded on first
use, so that the pure-Python modules beneath it load no vLLM; resolving
``ReshardWorkerExtension`` (as vLLM does in every worker) loads the worker module, which
registers the ``"reshard"`` backend, as the plugin does in every process.

Limits: tensor parallelism only (no pipeline or expert parallelism on the vLLM side);
vLLM 0.32's layerwise-reload internals are used, so the vLLM version is pinned.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reshard.integrations.vllm.internals import (
        has_own_lm_head,
        kept_live,
        logical_params,
        refuse_unreloadable,
        tied_aliases,
    )
    from reshard.integrations.vllm.kernels import packed_gemm_mismatches
    from reshard.integrations.vllm.state import ReshardState, map_or_explain
    from reshard.integrations.vllm.worker import (
        BACKEND,  # noqa: F401 (the backend's name in vLLM's registry)
        ReshardInitInfo,
        ReshardUpdateInfo,
        ReshardWeightTransferEngine,
        ReshardWorkerExtension,
        collective,
        register,
    )

#: The door's names, loaded on first use: name -> module.
_LAZY = {
    **dict.fromkeys(("has_own_lm_head", "kept_live", "logical_params",
                     "refuse_unreloadable", "tied_aliases"),
                    "reshard.integrations.vllm.internals"),
    "packed_gemm_mismatches": "reshard.integrations.vllm.kernels",
    "ReshardState": "reshard.integrations.vllm.state",
    "map_or_explain": "reshard.integrations.vllm.state",
    **dict.fromkeys(("BACKEND", "ReshardInitInfo", "ReshardUpdateInfo",
                     "ReshardWeightTransferEngine", "ReshardWorkerExtension", "collective",
                     "register"), "reshard.integrations.vllm.worker"),
}

__all__ = [
    "ReshardInitInfo", "ReshardState", "ReshardUpdateInfo", "ReshardWeightTransferEngine",
    "ReshardWorkerExtension", "collective", "has_own_lm_head", "kept_live", "logical_params",
    "map_or_explain", "packed_gemm_mismatches",
    "refuse_unreloadable", "register", "tied_aliases",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
