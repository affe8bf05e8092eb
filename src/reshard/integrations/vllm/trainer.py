"""The trainer side of vLLM's weight-sync protocol, for the ``reshard`` backend:
:class:`ReshardTrainerEngine`, a ``TrainerWeightTransferEngine`` that drives a running
vLLM (``vllm serve`` through ``HTTPVLLMWeightSyncClient``, Ray actors through
``RayVLLMWeightSyncClient``, or any object with the protocol's four methods) while every
trainer rank sends its own shards::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(      # on every trainer rank
        ReshardTrainerInitInfo("10.0.0.1", 29600, trainer_size=2, inference_size=2,
                               rank=rank),
        client=HTTPVLLMWeightSyncClient("http://10.0.0.2:8000"), source=ModuleSource(model))
    for step in ...:
        ...  # a training step
        engine.send_weights(step)                            # on every trainer rank

Importing this module registers the backend in ``WeightTransferTrainerFactory`` (vLLM's
processes get it from reshard's vLLM plugin). Trainer rank 0 drives the server (the
sender, in vLLM's words); every rank meets the engine's ranks and sends its own bytes:
no rank gathers a full tensor (``ModuleSource``'s iteration, which would, is never
used: the engine reads the module's parameters -- DTensors under FSDP2 or TP -- in
place).

Two ways a version goes in (``overlap``):

* **overlapped** (default): ``start_weight_update``, ``update_weights({"background":
  true})`` -- which returns at once: every engine rank receives in a background thread
  while the engine goes on scheduling and generating -- the transfer, then
  ``finish_weight_update``: every rank swaps the version in between the same two
  forward passes, the only time the engine stops. What happens to requests in flight at
  the swap is ``in_flight``: ``"keep"`` (they go on with the new weights, their KV
  recomputed with them; each response's ``weight_versions`` says which tokens came from
  which version), ``"wait"`` (the swap waits until they finished on the old weights,
  new requests queue meanwhile) or ``"abort"``. ``"wait"`` and ``"abort"`` pause the
  engine around the swap (``/pause?mode=wait|abort`` ... ``/resume``), so they need a
  client that can pause: the HTTP client, the Ray client, or one with
  ``pause_generation`` / ``resume_generation`` methods.
* **stop-the-world** (``overlap=False``): ``/pause?mode=keep``, start, a blocking
  ``update_weights`` while the trainer sends, finish, ``/resume`` -- as the frameworks
  refit today.

The weight version is the trainer's step (``send_weights(step)``; 0 for the weights
before the first optimizer step, which an engine fresh from its checkpoint takes: it holds
no version yet, nor does an engine met anew), sent to the engine as its ``weight_version``
string; a version not newer than the engine's is refused on every rank before a byte
moves, the round closed and the engine serving on. A refit that fails (a trainer or
engine rank lost) raises :class:`reshard.TransferError` on every trainer rank; the
engine goes on serving the previous version; ``trainer_init`` again (a new port: the old
group may hold dead peers) meets it anew and the next refit lands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
)

from reshard.defaults import (
    DEFAULT_COMMIT_HEAP_SLACK_BYTES,
    DEFAULT_REFIT_BUDGET_BYTES,
    DEFAULT_SPARSE,
    NO_VERSION,
)
from reshard.errors import ConfigError, ReshardError, TransferError
from reshard.integrations.vllm.state import check_heap_slack

__all__ = ["IN_FLIGHT", "ReshardTrainerEngine", "ReshardTrainerInitInfo", "register"]

#: What becomes of requests in flight at an overlapped swap (see the module's docs).
IN_FLIGHT = ("keep", "wait", "abort")


@dataclass
class ReshardTrainerInitInfo(TrainerInitInfo):
    """Where the trainer's rank 0 hosts the meeting, the two jobs' sizes, and how each
    version goes in. ``rank`` (keyword) is this trainer process's rank."""

    backend: ClassVar[str] = "reshard"

    master_address: str
    master_port: int
    trainer_size: int
    inference_size: int
    overlap: bool = True
    in_flight: str = "keep"
    staging: str = "shadow"
    budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES
    timeout_s: float = 120.0
    unchecked_family_ok: bool = False
    #: the meeting's shared secret (else ``$RESHARD_TOKEN`` on each side; see
    #: docs/security.md); sent to the engine with ``init_weight_transfer_engine``
    token: str | None = field(default=None, repr=False)
    #: the freed heap the engine's commit keeps before handing it back (None: all of
    #: it, a faster commit at more resident memory; docs/vllm.md, engine-side memory)
    heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
    #: after the first refit, send only the changed engine-dtype values ("on", "auto",
    #: "off"; docs/sparse.md); the engine's init info says which
    sparse: str = DEFAULT_SPARSE

    def worker_init_info(self) -> dict[str, Any]:
        """What the engine's ranks are given (``init_weight_transfer_engine``; over HTTP
        the token travels in that request's body: serve behind TLS, or give the engine
        ``RESHARD_TOKEN`` itself and leave ``token`` unset)."""
        info = {"master_address": self.master_address, "master_port": self.master_port,
                "trainer_size": self.trainer_size, "staging": self.staging,
                "budget_bytes": self.budget_bytes, "timeout_s": self.timeout_s,
                "unchecked_family_ok": self.unchecked_family_ok, "sparse": self.sparse}
        if self.heap_slack_bytes != DEFAULT_COMMIT_HEAP_SLACK_BYTES:  # else the engine's
            info["heap_slack_bytes"] = self.heap_slack_bytes
        return info if self.token is None else {**info, "token": self.token}

    def check(self) -> None:
        """Refuse, before anything moves, what cannot work."""
        if self.in_flight not in IN_FLIGHT:
            raise ConfigError(f"in_flight must be one of {IN_FLIGHT}, got {self.in_flight!r}")
        if self.overlap and self.staging != "shadow":
            raise ConfigError(
                f"overlap=True cannot run with staging={self.staging!r}: the transfer would "
                "write the live weights while the engine serves them; use staging='shadow' "
                "(its cost: a copy of what each engine rank receives) or overlap=False")
        if self.sparse not in ("auto", "on", "off"):
            raise ConfigError(f"sparse must be one of ('auto', 'on', 'off'), got "
                              f"{self.sparse!r}")
        if not 0 <= self.rank < self.trainer_size:
            raise ConfigError(f"rank must be in [0, {self.trainer_size}), got {self.rank}")
        check_heap_slack(self.heap_slack_bytes)


def _sparse_summary(stats: Any) -> dict[str, Any] | None:
    from reshard.refit.sparse import sparse_summary

    return sparse_summary(stats)


def _params_of(source: Any, trainer_size: int) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """The trainer's parameters (HF names) and layouts, read in place: a vLLM
    ``ModuleSource`` or a module (through :func:`reshard.integrations.hf.refit_params`),
    or a mapping name -> DTensor (its own layout) or tensor (replicated on every rank)."""
    from reshard.integrations import hf
    from reshard.layout import Layout
    from reshard.mesh import Mesh
    from reshard.placement import Replicate

    module = getattr(source, "_module", source)
    if hasattr(module, "named_parameters"):
        return hf.refit_params(module, range(trainer_size))
    if isinstance(source, Mapping):
        world = Mesh(list(range(trainer_size)))
        return source, {n: Layout.from_dtensor(p) if hasattr(p, "placements") else
                        Layout(tuple(p.shape), world, [Replicate()], p.dtype)
                        for n, p in source.items()}
    raise ConfigError("source must be a vLLM ModuleSource, a torch module or a mapping "
                      f"name -> tensor, got {type(source).__name__}")


def _pausing(client: Any) -> tuple[Callable[[str], None], Callable[[], None]] | None:
    """``(pause(mode), resume())`` for a client that can pause the engine, else None."""
    base_url = getattr(client, "base_url", None)
    if base_url is not None:  # HTTPVLLMWeightSyncClient: the RL routes of vllm serve
        import requests

        timeout = getattr(client, "timeout", 300)

        def post(path: str, **params: Any) -> None:
            r = requests.post(f"{base_url}/{path}", params=params, timeout=timeout)
            r.raise_for_status()

        return (lambda mode: post("pause", mode=mode)), (lambda: post("resume"))
    handles = getattr(client, "handles", None)
    if handles is not None:  # RayVLLMWeightSyncClient
        import ray

        return ((lambda mode: ray.get([h.pause_generation.remote(mode=mode) for h in handles])),
                (lambda: ray.get([h.resume_generation.remote() for h in handles])))
    if callable(getattr(client, "pause_generation", None)):
        return (lambda mode: client.pause_generation(mode=mode)), client.resume_generation
    return None


class ReshardTrainerEngine(TrainerWeightTransferEngine[ReshardTrainerInitInfo]):
    """One trainer rank's side of vLLM's weight-sync protocol with the ``reshard``
    backend (see the module's docs). ``last`` holds the last refit's figures: version,
    ``transfer_seconds`` (this rank's send), and on rank 0 ``pause_seconds`` (how long
    the engine stopped: the swap, or the whole stop-the-world round)."""

    init_info_cls = ReshardTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 init_info: ReshardTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = init_info
        self.sender: Any = None
        self.version = NO_VERSION  # the last version sent
        self.last: dict[str, Any] = {}
        self.pausing = _pausing(client) if is_sender else None

    def _can_pause(self, info: ReshardTrainerInitInfo) -> None:
        """Refuse, on rank 0 before anything moves, a refit that pauses the engine
        through a client that cannot."""
        if self.is_sender and (not info.overlap or info.in_flight != "keep") and (
                self.pausing is None):
            what = f"in_flight={info.in_flight!r}" if info.overlap else "overlap=False"
            raise ConfigError(f"{what} pauses the engine, which this client "
                              f"({type(self.client).__name__}) cannot: use vLLM's HTTP or "
                              "Ray client, or one with pause_generation / resume_generation")

    @classmethod
    def trainer_init(cls, init_info: ReshardTrainerInitInfo, *, client: Any,
                     source: Any = None) -> ReshardTrainerEngine:
        """Meet the engine: on every trainer rank (collective with the engine's ranks,
        whose ``init_weight_transfer_engine`` trainer rank 0 calls meanwhile)."""
        from reshard.refit import RefitSender

        init_info.check()
        if source is None:
            raise ConfigError("the reshard trainer engine needs source= (a ModuleSource, a "
                              "module or a mapping of the trainer's parameters)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     init_info=init_info)
        engine._can_pause(init_info)
        params, layouts = _params_of(source, init_info.trainer_size)
        with ThreadPoolExecutor(max_workers=1) as pool:
            told = (pool.submit(client.init_weight_transfer_engine,
                                init_info.worker_init_info())
                    if init_info.is_sender else None)
            try:
                engine.sender = RefitSender(
                    params, layouts=layouts, host=init_info.master_address,
                    port=init_info.master_port, rank=init_info.rank,
                    trainer_size=init_info.trainer_size,
                    inference_size=init_info.inference_size,
                    budget_bytes=init_info.budget_bytes, token=init_info.token,
                    timeout=timedelta(seconds=init_info.timeout_s), sparse=init_info.sparse)
            finally:
                if told is not None:
                    told.result()  # the engine's own error, if it refused
        return engine

    def send_weights(self, version: int | None = None, *, overlap: bool | None = None
                     ) -> dict[str, Any]:
        """Send the current parameters as weight version ``version`` (the trainer's step;
        by default the one after the last sent, 0 first) and make it live on the engine;
        on every trainer rank alike. A version not newer than the engine's is refused
        (``ReshardError``) before a byte moves. ``overlap`` overrides the init info's for
        this refit. Returns (and keeps in ``last``) the refit's figures."""
        info = self.info
        if overlap is not None and overlap != info.overlap:
            info = dataclasses.replace(info, overlap=overlap)
            info.check()
            self._can_pause(info)
        version = self.version + 1 if version is None else version
        rank0 = self.is_sender
        t0 = time.perf_counter()
        figures: dict[str, Any] = {"version": version, "overlap": info.overlap,
                                   "started": time.monotonic()}
        error: BaseException | None = None
        with ThreadPoolExecutor(max_workers=1) as pool:
            receiving = None
            if rank0:
                try:
                    receiving = self._begin(info, pool)
                except Exception as e:  # the engine refused: no rank waits on it
                    self.sender._break()  # the other trainer ranks' refit fails at once
                    raise TransferError(f"the engine refused to begin refit {version}: {e}; "
                                        "it serves the previous version; meet again "
                                        "(trainer_init with a new port)") from e
            try:
                stats = self.sender.refit(version)
                figures.update(transfer_seconds=stats.seconds, bytes_sent=stats.bytes_sent,
                               sparse=_sparse_summary(stats.sparse))
            except ReshardError as e:  # lost midway, or refused before a byte moved
                error = e
            if rank0:
                error = self._finish(info, receiving, version, figures, error, t0)
        figures.update(seconds=time.perf_counter() - t0, ended=time.monotonic())
        self.last = figures
        if error is not None:
            raise error if isinstance(error, ReshardError) else TransferError(
                f"refit to version {version} failed on the engine: {error}; it serves the "
                "previous version") from error
        self.version = version
        return figures

    def _begin(self, info: ReshardTrainerInitInfo, pool: ThreadPoolExecutor) -> Any:
        """Rank 0: open the update round on the engine; stop-the-world, the blocking
        ``update_weights`` runs in ``pool`` while this rank sends (its future)."""
        if not info.overlap:
            self.pausing[0]("keep")
        started = False
        try:
            self.client.start_weight_update()
            started = True
            update = {"background": info.overlap}
            if info.overlap:
                self.client.update_weights(update)
                return None
            return pool.submit(self.client.update_weights, update)  # returns once received
        except Exception:
            if started:  # close the round: nothing was received, nothing commits
                with contextlib.suppress(Exception):
                    self.client.finish_weight_update()
            if not info.overlap:  # never leave the engine paused
                with contextlib.suppress(Exception):
                    self.pausing[1]()
            raise

    def _finish(self, info: ReshardTrainerInitInfo, receiving: Any, version: int,
                figures: dict[str, Any], error: BaseException | None, t0: float
                ) -> BaseException | None:
        """Rank 0: end the update round on the engine (whatever happened: a failed refit
        commits nothing there) and resume it; the first error, if any."""
        paused, t_swap = not info.overlap, time.perf_counter()
        try:
            if receiving is not None:
                receiving.result()
                t_swap = time.perf_counter()
            if info.overlap and info.in_flight != "keep":
                self.pausing[0](info.in_flight)
                paused = True
            self.client.finish_weight_update(weight_version=str(version))
        except Exception as e:  # the engine said the refit failed: keep the first cause
            error = error or e
        finally:
            if paused:
                with contextlib.suppress(Exception) if error else contextlib.nullcontext():
                    self.pausing[1]()
        figures["pause_seconds"] = time.perf_counter() - (t0 if not info.overlap else t_swap)
        return error

    def shutdown(self) -> None:
        """Leave the meeting's group (the engine keeps serving its live version)."""
        if self.sender is not None:
            with contextlib.suppress(Exception):
                self.sender.comm.close()
            self.sender = None


def register() -> None:
    """Register this engine in vLLM's ``WeightTransferTrainerFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferTrainerFactory.register_engine("reshard", ReshardTrainerEngine)


register()
