"""TRL's two GRPO trainers with every rank sending its own shards through
:class:`~reshard.integrations.trl.transfer.ReshardWeightTransfer`.

* :class:`ReshardAsyncGRPOTrainer`: ``AsyncGRPOTrainer(weight_transfer=...)``, TRL's own
  hook, which TRL keeps on its main process only; the subclass keeps the transfer on every
  rank and makes the stream TRL iterates for a sync (``_streaming_iter``, a full gather of
  every tensor on every rank) the transfer's own.
* :class:`ReshardGRPOTrainer`: ``GRPOTrainer`` in server mode, whose weight sync has no
  hook: while the trainer is built, its ``VLLMGeneration`` is
  :class:`ReshardVLLMGeneration` (the one place TRL is replaced), which gives the main
  process :class:`ReshardVLLMClient` (TRL's ``VLLMClient``: ``init_communicator`` and
  ``update_named_params`` through reshard) and every rank the transfer's stream;
  TRL's own ``sync_weights`` runs unchanged around them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.generation.vllm_client import VLLMClient
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer import grpo_trainer
from trl.trainer.grpo_trainer import GRPOTrainer

from reshard.errors import ConfigError
from reshard.integrations.trl.transfer import ReshardStream, ReshardWeightTransfer

__all__ = ["ReshardAsyncGRPOTrainer", "ReshardGRPOTrainer", "ReshardVLLMClient",
           "ReshardVLLMGeneration"]


def _bound(transfer: Any) -> ReshardWeightTransfer:
    """``transfer``, checked and marked as held by a trainer whose stream is its own."""
    if not isinstance(transfer, ReshardWeightTransfer):
        raise ConfigError("expected a reshard.integrations.trl.ReshardWeightTransfer (made "
                          f"on every trainer rank), got {type(transfer).__name__}")
    transfer.bound = True
    return transfer


class ReshardAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` whose ``weight_transfer`` (a :class:`ReshardWeightTransfer`,
    made on every rank) sends each rank's own shards; everything else is TRL's."""

    def __init__(self, *args: Any, weight_transfer: ReshardWeightTransfer, **kwargs: Any
                 ) -> None:
        self.reshard = _bound(weight_transfer)
        super().__init__(*args, weight_transfer=weight_transfer, **kwargs)

    def _streaming_iter(self) -> ReshardStream:
        return self.reshard.stream(self.accelerator.unwrap_model(self.model),
                                   self.state.global_step)


class ReshardVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` (generation over HTTP, unchanged) whose weight sync goes
    through ``transfer`` instead of an NCCL group with the server."""

    def __init__(self, transfer: ReshardWeightTransfer, **kwargs: Any) -> None:
        self.transfer = _bound(transfer)
        super().__init__(**kwargs)

    def init_communicator(self, device: Any = 0) -> None:
        """No group with the server yet (the trainer ranks meet it at the first refit, all
        together); check that it uses the ``reshard`` backend."""
        self.transfer.init_weight_transfer()

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, Any]]) -> None:
        """The main process's part of a sync: ``named_params`` is the transfer's stream
        (``metadata`` is TRL's list of names, unused: the layouts are read in place)."""
        self.transfer.send_weights(named_params)

    def close_communicator(self) -> None:
        self.transfer.destroy()


class ReshardVLLMGeneration(VLLMGeneration):
    """TRL's ``VLLMGeneration``; in server mode the main process talks to the server
    through :class:`ReshardVLLMClient` and every rank streams through the transfer, each
    sync as weight version ``step()`` (the trainer's optimizer steps so far)."""

    def __init__(self, *args: Any, transfer: ReshardWeightTransfer,
                 step: Callable[[], int], **kwargs: Any) -> None:
        self.transfer, self.step = _bound(transfer), step
        super().__init__(*args, **kwargs)
        if self.mode == "server":  # TRL walks the stream once for names: nothing to walk
            self._weight_metadata = []

    def _init_vllm(self) -> None:
        if self.mode != "server":
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            self.vllm_client = ReshardVLLMClient(
                self.transfer, base_url=base_url, group_port=self.group_port,
                connection_timeout=self.server_timeout)
            self.vllm_client.init_communicator(device=self.accelerator.device)
        self.accelerator.wait_for_everyone()
        return None

    def _iter_named_params(self) -> Any:
        if self.mode != "server":
            return super()._iter_named_params()
        return self.transfer.stream(self.accelerator.unwrap_model(self.model), self.step())


class ReshardGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` (``vllm_mode="server"``) syncing through ``transfer`` (a
    :class:`ReshardWeightTransfer`, made on every rank); everything else is TRL's."""

    def __init__(self, *args: Any, transfer: ReshardWeightTransfer, **kwargs: Any) -> None:
        _bound(transfer)

        def generation(*a: Any, **kw: Any) -> ReshardVLLMGeneration:
            return ReshardVLLMGeneration(*a, transfer=transfer,
                                         step=lambda: self.state.global_step, **kw)

        # the one place TRL is replaced: the name GRPOTrainer builds its vLLM side from
        with _replaced(grpo_trainer, "VLLMGeneration", generation):
            super().__init__(*args, **kwargs)
        self.reshard = transfer


@contextlib.contextmanager
def _replaced(module: Any, name: str, value: Any) -> Iterator[None]:
    """``module.name`` is ``value`` inside the block, its own value again after."""
    own = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, own)
