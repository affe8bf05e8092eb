"""TRL's GRPO trainers refitting a live ``vllm serve`` through reshard, every trainer rank
sending its own shards (FSDP2 or TP DTensors read in place; no rank gathers a tensor).

AsyncGRPO, through TRL's own hook (``weight_transfer=``), kept on every rank::

    from reshard.integrations.trl import ReshardAsyncGRPOTrainer, ReshardWeightTransfer

    transfer = ReshardWeightTransfer(url, master_address=trainer0_address)  # every rank
    trainer = ReshardAsyncGRPOTrainer(model=..., args=AsyncGRPOConfig(
        vllm_server_base_url=url, ...), weight_transfer=transfer, ...)
    trainer.train()

GRPOTrainer in server mode (``GRPOConfig(use_vllm=True, vllm_mode="server")``)::

    trainer = ReshardGRPOTrainer(model=..., args=config, transfer=transfer, ...)

The server: ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
'{"backend": "reshard"}'`` (docs/trl.md). Where it lives: :mod:`~.transfer` the weight
transfer itself (TRL's ``WeightTransferProtocol`` on every rank, the stream each rank
sends through), :mod:`~.trainers` the two trainers, ``ReshardVLLMClient`` and
``ReshardVLLMGeneration`` (the one place TRL is replaced, for GRPOTrainer). Importing
this package imports TRL.
"""

from __future__ import annotations

from reshard.integrations.trl.trainers import (
    ReshardAsyncGRPOTrainer,
    ReshardGRPOTrainer,
    ReshardVLLMClient,
    ReshardVLLMGeneration,
)
from reshard.integrations.trl.transfer import ReshardStream, ReshardWeightTransfer

__all__ = ["ReshardAsyncGRPOTrainer", "ReshardGRPOTrainer", "ReshardStream",
           "ReshardVLLMClient", "ReshardVLLMGeneration", "ReshardWeightTransfer"]
