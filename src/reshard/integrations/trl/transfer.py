"""One object that TRL drives on every trainer rank: :class:`ReshardWeightTransfer`, TRL's
``WeightTransferProtocol`` (``init_weight_transfer``, ``pause``, ``send_weights``,
``resume``, ``destroy``) over reshard's backend of vLLM's weight-sync protocol
(:class:`reshard.integrations.vllm.trainer.ReshardTrainerEngine`).

TRL reads the policy as a stream of ``(name, full tensor)`` pairs, gathered on every rank
(``DTensor.full_tensor()``), and hands it to one object on its main process. Here every
rank sends its own shards instead: the stream TRL iterates is :meth:`stream`, a
:class:`ReshardStream` that yields nothing and whose iteration *is* that rank's part of the
refit (the main process's ``send_weights(stream)`` iterates it too, driving the server
around it). No tensor is gathered, none crosses TRL.

The engine's weight version is the trainer's step (TRL's ``state.global_step`` at the
sync, which the trainers hand the stream): 0 for the weights TRL syncs at the start,
``k`` after ``k`` optimizer steps (AsyncGRPO's own ``model_version`` counts syncs:
``k + 1``). An engine met anew holds no version (a fresh server's weights are its
checkpoint's, an earlier job's no step of this one), so step 0 goes in; within the job a
version not newer than the engine's is refused before a byte moves.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from reshard.defaults import NO_VERSION
from reshard.errors import ConfigError

__all__ = ["ReshardStream", "ReshardWeightTransfer"]


class ReshardStream:
    """What TRL iterates on every rank for a weight sync: iterating it sends this rank's
    own shards of ``model`` as weight version ``step`` (a collective with the other
    trainer ranks and the engine's ranks) and yields no tensor."""

    def __init__(self, transfer: ReshardWeightTransfer, model: Any, step: int) -> None:
        self.transfer, self.model, self.step = transfer, model, step

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.transfer.refit(self.model, self.step)
        return iter(())


class ReshardWeightTransfer:
    """TRL's weight-transfer object over reshard, made on every trainer rank alike.

    ``server_url``: the ``vllm serve`` started with ``--weight-transfer-config
    '{"backend": "reshard"}'`` and ``VLLM_SERVER_DEV_MODE=1``. ``master_address``: where
    trainer rank 0 hosts the meeting, reachable from the engine's ranks; ``master_port``:
    its port (``None``: rank 0 picks a free one and tells the other trainer ranks over
    their process group). ``inference_size``: the engine's ranks (``None``: asked of the
    server). ``overlap`` (default): the engine keeps generating while it receives and stops
    only to swap; ``False``: stop-the-world (``/pause?mode=keep`` around the whole refit).
    Other keywords go to :class:`~reshard.integrations.vllm.trainer.ReshardTrainerInitInfo`
    (``token``, ``timeout_s``, ``budget_bytes``, ``in_flight``, ...).

    ``pause`` and ``resume`` do nothing: :meth:`send_weights` pauses the engine itself for
    exactly as long as the refit needs (the swap alone when overlapped). ``refits`` keeps
    each refit's figures (``version``, ``seconds``, ``transfer_seconds``, and on rank 0
    ``pause_seconds``: how long the engine stopped, measured by the trainer)."""

    def __init__(self, server_url: str, *, master_address: str = "127.0.0.1",
                 master_port: int | None = None, inference_size: int | None = None,
                 overlap: bool = True, **info: Any) -> None:
        if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
            raise ConfigError(f"server_url must be an http(s) URL of the vLLM server, got "
                              f"{server_url!r}")
        self.server_url = server_url.rstrip("/")
        self.master_address, self.master_port = master_address, master_port
        self.inference_size, self.overlap, self.info = inference_size, overlap, info
        self.engine: Any = None
        self.version = NO_VERSION  # the last step sent
        #: set by the trainers of :mod:`~reshard.integrations.trl.trainers`, whose stream
        #: is this transfer's (TRL's own trainers would hand it gathered tensors)
        self.bound = False
        self.refits: list[dict[str, Any]] = []

    # -- TRL's WeightTransferProtocol (the main process) ---------------------------------
    def init_weight_transfer(self) -> None:
        """Check, before anything moves, that a reshard trainer holds this transfer and
        that the server is up and uses the ``reshard`` backend; the trainer ranks meet the
        engine at the first refit (every rank is there then)."""
        if not self.bound:
            raise ConfigError(_UNBOUND)
        backend = (self._server_info().get("weight_transfer_config") or {}).get("backend")
        if backend != "reshard":
            raise ConfigError(
                f"the vLLM server at {self.server_url} has weight-transfer backend "
                f"{backend!r}; start it with --weight-transfer-config '{{\"backend\": "
                "\"reshard\"}' (reshard's vLLM plugin registers it)")

    def pause(self) -> None:
        """Nothing: :meth:`send_weights` pauses the engine only as long as it must."""

    def resume(self) -> None:
        """Nothing: the engine was resumed when the refit committed."""

    def send_weights(self, iterator: Any) -> None:
        """Send the policy (rank 0's part; the other ranks iterate the same stream). Only
        a :class:`ReshardStream` is accepted: TRL's own stream gathers every tensor."""
        if not isinstance(iterator, ReshardStream) or iterator.transfer is not self:
            raise ConfigError(f"send_weights got a {type(iterator).__name__}: {_UNBOUND}")
        for _ in iterator:
            pass

    def destroy(self) -> None:
        """Leave the meeting (the server keeps serving its live version)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    # -- every rank ------------------------------------------------------------------------
    def stream(self, model: Any, step: int) -> ReshardStream:
        """The stream TRL iterates for a sync of ``model`` (the unwrapped policy) after
        ``step`` optimizer steps."""
        return ReshardStream(self, model, step)

    def refit(self, model: Any, step: int) -> dict[str, Any]:
        """Every trainer rank: meet the engine on the first call, then send ``model``'s
        current parameters (each rank its own shards) as weight version ``step``."""
        if self.engine is None:
            self.engine = self._meet(model)
        figures = self.engine.send_weights(step, overlap=self.overlap)
        self.version = figures["version"]
        self.refits.append(figures)
        return figures

    def _meet(self, model: Any) -> Any:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        from reshard.integrations.vllm.trainer import (
            ReshardTrainerEngine,
            ReshardTrainerInitInfo,
        )

        rank, size = _rank_and_size()
        info = ReshardTrainerInitInfo(
            self.master_address, self._port(rank, size), trainer_size=size,
            inference_size=self.inference_size or self._world_size(), rank=rank,
            overlap=self.overlap, **self.info)
        return ReshardTrainerEngine.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(self.server_url), source=model)

    def _port(self, rank: int, size: int) -> int:
        """The meeting's port: given, or picked by rank 0 and told to the others."""
        if self.master_port is not None:
            return self.master_port
        from reshard.comm import free_port

        port = [free_port(self.master_address) if rank == 0 else None]
        if size > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(port, src=0)
        return port[0]

    def _get(self, path: str, **params: Any) -> dict[str, Any]:
        import requests

        deadline = time.monotonic() + 60
        while True:
            try:
                r = requests.get(f"{self.server_url}/{path}", params=params, timeout=30)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        if r.status_code == 404:
            raise ConfigError(f"the vLLM server at {self.server_url} has no /{path}: start "
                              "it with VLLM_SERVER_DEV_MODE=1 (vLLM's RL routes)")
        r.raise_for_status()
        return r.json()

    def _server_info(self) -> dict[str, Any]:
        return self._get("server_info", config_format="json")["vllm_config"]

    def _world_size(self) -> int:
        return int(self._get("get_world_size")["world_size"])


_UNBOUND = ("TRL's own trainers stream full tensors gathered on every rank; build the trainer "
            "with reshard.integrations.trl.ReshardAsyncGRPOTrainer (or ReshardGRPOTrainer), "
            "whose stream sends each rank's own shards")


def _rank_and_size() -> tuple[int, int]:
    """This trainer process's rank and the trainer's size (1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
