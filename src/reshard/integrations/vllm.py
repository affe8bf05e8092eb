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
  ``WeightTransferEngineFactory`` when this module is imported -- which vLLM does in
  every worker when it is the ``worker_extension_cls``, before the engine is created::

      llm = LLM(..., worker_extension_cls="reshard.integrations.vllm.ReshardWorkerExtension",
                weight_transfer_config={"backend": "reshard"})
      llm.init_weight_transfer_engine({"init_info": {"master_address": host,
                                                     "master_port": port, "trainer_size": 2}})
      llm.start_weight_update(); llm.update_weights({"update_info": {}})
      llm.finish_weight_update(weight_version=...)

  ``update_weights`` receives (RefitReceiver.refit) and ``finish_weight_update`` commits.
  A failed refit does not raise (see :func:`vllm_worker._reported`): ``collective(llm,
  "reshard_last")`` reports it and ``finish_weight_update`` then commits nothing.

vLLM 0.32 caveat: when a ``collective_rpc`` method raises on a worker, the executor stops
reading replies there and the later workers' replies are taken as the answers of the
next call, so no ``reshard_*`` method raises into vLLM; use :func:`collective` to get an
exception back in the caller.

Where it lives: :mod:`reshard.integrations.vllm_worker` holds the worker extension, the
weight-transfer backend and :func:`collective`; :mod:`reshard.integrations.vllm_state`
one rank's side of a refit (mapping, buffers, receive, commit, memory, verify: how a
refit lands on a rank is told there); :mod:`reshard.integrations.vllm_internals` the
helpers that reach into vLLM's internals (layerwise-reload metadata, loaders, CPU
kernels). This module is the door: the names users pass to vLLM
(``"reshard.integrations.vllm.ReshardWorkerExtension"``) and import, and importing it
registers the ``"reshard"`` backend.

Limits: tensor parallelism only (no pipeline or expert parallelism on the vLLM side);
vLLM 0.32's layerwise-reload internals are used, so the vLLM version is pinned.
"""

from __future__ import annotations

from reshard.integrations.vllm_internals import (
    has_own_lm_head,
    kept_live,
    logical_params,
    packed_gemm_mismatches,
    refuse_unreloadable,
    tied_aliases,
)
from reshard.integrations.vllm_state import ReshardState, map_or_explain
from reshard.integrations.vllm_worker import (
    BACKEND,  # noqa: F401 (the backend's name in vLLM's registry, as before the split)
    ReshardInitInfo,
    ReshardUpdateInfo,
    ReshardWeightTransferEngine,
    ReshardWorkerExtension,
    collective,
    register,
)

__all__ = [
    "ReshardInitInfo", "ReshardState", "ReshardUpdateInfo", "ReshardWeightTransferEngine",
    "ReshardWorkerExtension", "collective", "has_own_lm_head", "kept_live", "logical_params",
    "map_or_explain", "packed_gemm_mismatches",
    "refuse_unreloadable", "register", "tied_aliases",
]
