"""The doors vLLM's workers call: :class:`ReshardWorkerExtension` (mixed into every
worker by ``LLM(worker_extension_cls=...)``, its ``reshard_*`` methods reached through
``collective_rpc``) and :class:`ReshardWeightTransferEngine`, the ``"reshard"`` backend
of vLLM's weight-transfer protocol, registered in ``WeightTransferEngineFactory`` when
this module is imported. Both drive one :class:`ReshardState` per rank
(:mod:`reshard.integrations.vllm.state`). No ``reshard_*`` method raises into vLLM
(:func:`_reported`); :func:`collective` turns a failed worker's reply back into an
exception in the caller.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.defaults import (
    DEFAULT_COMMIT_HEAP_SLACK_BYTES,
    DEFAULT_REFIT_BUDGET_BYTES,
    DEFAULT_SPARSE,
    NO_VERSION,
)
from reshard.errors import ConfigError, ReshardError
from reshard.fanout import check_fanout
from reshard.integrations.vllm.state import ReshardState, check_heap_slack

__all__ = [
    "BACKEND", "ReshardInitInfo", "ReshardUpdateInfo", "ReshardWeightTransferEngine",
    "ReshardWorkerExtension", "collective", "failures", "outcome", "parse_fields", "register",
]

log = logging.getLogger("reshard.vllm")
BACKEND = "reshard"


def _load_state(path: str, model_type: str | None = None) -> dict[str, torch.Tensor]:
    from reshard.integrations.hf import checkpoint_state_dict

    return checkpoint_state_dict(torch.load(path, map_location="cpu", weights_only=True),
                                 model_type)


def _reported(fn: Any) -> Any:
    """Return an exception as ``{"ok": False, "raised": type, "error": message}``.

    vLLM 0.32's ``MultiprocExecutor.collective_rpc`` stops reading replies at the first
    failed worker: the replies of the workers after it stay queued and are taken as the
    answers of the *next* call (every later RPC is then off by one). So no method here
    raises into vLLM; :func:`collective` turns such replies back into an exception."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except Exception as e:
            log.exception("reshard: %s failed", fn.__name__)
            return {"ok": False, "rank": getattr(self, "rank", None),
                    "raised": type(e).__name__, "error": str(e)}

    return wrapper


def collective(llm: Any, method: str, *args: Any, timeout: float | None = None,
               **kwargs: Any) -> list[Any]:
    """``llm.collective_rpc(method, ...)`` that raises :class:`ReshardError` when a
    worker's ``reshard_*`` method raised (see :func:`_reported`); one result per rank."""
    results = llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)
    failed = [r for r in results if isinstance(r, dict) and r.get("raised")]
    if failed:
        ranks = [r["rank"] for r in failed]
        raise ReshardError(f"{method} failed on vLLM rank(s) {ranks}: {failed[0]['raised']}: "
                           f"{failed[0]['error']}")
    return results


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class (``LLM(worker_extension_cls=...)``); every method
    runs on every worker through ``llm.collective_rpc("reshard_...")`` -- or, raising on
    failure, :func:`collective` ``(llm, "reshard_...")``. None raises into vLLM: an
    exception comes back as ``{"ok": False, "raised": ..., "error": ...}``."""

    @_reported
    def reshard_init(self, host: str, port: int, trainer_size: int,
                     inference_size: int | None = None, staging: str = "shadow",
                     budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                     hf_tensors: Mapping[str, Sequence[int]] | None = None,
                     timeout_s: float = 120.0, unchecked_family_ok: bool = False,
                     token: str | None = None,
                     heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
                     ) -> dict[str, Any]:
        """Meet the trainer at ``host:port`` (collective with its RefitSender ranks):
        learn its tensor names and shapes there, build the mapping, the logical buffers
        and the receiver; returns sizes. ``hf_tensors`` (HF name -> global shape) is
        only needed to map before the meeting; an unknown tensor on either side is a
        ``MappingError`` on every rank of both jobs, nothing moved; so is a model family
        whose refit was never checked end to end (``vllm_mapping.CHECKED_FAMILIES``)
        unless ``unchecked_family_ok`` (or ``RESHARD_UNCHECKED_FAMILIES=1``). ``token``
        (else the workers' ``$RESHARD_TOKEN``): the trainer's token (docs/security.md).
        ``heap_slack_bytes``: the freed heap a commit keeps before handing it back to the
        system; ``None`` keeps it all, for a faster commit at more resident memory
        (:data:`reshard.defaults.DEFAULT_COMMIT_HEAP_SLACK_BYTES`). After
        :meth:`reshard_bootstrap` the filled state meets the trainer instead, keeping its
        version and weights (only ``token`` is read of the options)."""
        state = self._reshard_filled()
        if state is not None:
            return state.meet_trainer(host, port, trainer_size, token)
        self._reshard_drop()
        size = inference_size or self.vllm_config.parallel_config.world_size
        self._reshard = ReshardState(
            self.model_runner.get_model(), self.vllm_config, rank=self.rank,
            inference_size=size, host=host, port=port, trainer_size=trainer_size,
            staging=staging, budget_bytes=budget_bytes, hf_tensors=hf_tensors,
            timeout_s=timeout_s, unchecked_family_ok=unchecked_family_ok, token=token,
            heap_slack_bytes=heap_slack_bytes)
        return self._reshard.info()

    @_reported
    def reshard_join(self, host: str, port: int, replica: str, fanout: str = "auto",
                     budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES, timeout_s: float = 120.0,
                     unchecked_family_ok: bool = False, token: str | None = None,
                     heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
                     ) -> dict[str, Any]:
        """Ask to join the trainer's fleet at ``host:port`` (its ``ElasticSender``
        ranks; ``reshard.refit.elastic``) as replica ``replica`` (an id unique per
        incarnation, the same on every rank of this engine): the mapping is made from the
        trainer's tensors (published in its store), then this engine takes part in every
        refit from the next one on, :meth:`reshard_refit` on every engine of the fleet at
        once (each blocks until the trainer's refit ran). Replicas on other fast domains
        are fed through each other where ``fanout`` (the same on every rank of the
        fleet) says so (``docs/fleets.md``). The other options are as for
        :meth:`reshard_init`; returns sizes. After :meth:`reshard_bootstrap` the filled
        state joins instead, keeping its version and weights (only ``fanout`` and
        ``token`` are read of the options)."""
        state = self._reshard_filled()
        if state is not None:
            return state.join_fleet(host, port, str(replica), fanout, token)
        self._reshard_drop()
        self._reshard = ReshardState(
            self.model_runner.get_model(), self.vllm_config, rank=self.rank,
            inference_size=self.vllm_config.parallel_config.world_size, host=host,
            port=port, trainer_size=0, budget_bytes=budget_bytes, timeout_s=timeout_s,
            unchecked_family_ok=unchecked_family_ok, token=token,
            heap_slack_bytes=heap_slack_bytes, replica=str(replica), fanout=fanout)
        return self._reshard.info()

    @_reported
    def reshard_leave(self) -> dict[str, Any]:
        """Ask to leave the trainer's fleet (after :meth:`reshard_join`): this engine
        still takes part in a refit already announced; the next :meth:`reshard_refit`
        finds it out (``ok: False``). Its weights and version stay."""
        state = self._reshard_state()
        if not state.in_fleet:
            raise ConfigError("reshard_leave: this engine is not a replica of a fleet "
                              "(reshard_join)")
        state.receiver.leave()
        return {"rank": self.rank, "version": state.version}

    @_reported
    def reshard_bootstrap(self, host: str, port: int, num_peers: int,
                          budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                          timeout_s: float = 120.0, token: str | None = None,
                          heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
                          ) -> dict[str, Any]:
        """Fill this engine from ``num_peers`` live engines' committed weights, without
        the trainer (collective with their :meth:`reshard_lend`; this engine's rank 0
        hosts the meeting at ``host:port``): the peers' tensor names and shapes make the
        mapping, each region comes from one peer, and the version goes live only once
        every rank of every engine confirmed. Returns the outcome as
        :meth:`reshard_refit` does (``ok: False`` and ``error`` when it failed: nothing
        of it live, try again). Then :meth:`reshard_init` meets the trainer."""
        self._reshard_drop()
        self._reshard = ReshardState(
            self.model_runner.get_model(), self.vllm_config, rank=self.rank,
            inference_size=self.vllm_config.parallel_config.world_size, host=host,
            port=port, trainer_size=0, budget_bytes=budget_bytes, timeout_s=timeout_s,
            token=token, heap_slack_bytes=heap_slack_bytes, bootstrap=num_peers)
        result = self._reshard.refit()
        _filled.state = self._reshard if result.get("committed") else None
        return result

    @_reported
    def reshard_lend(self, host: str, port: int, peer: int) -> dict[str, Any]:
        """Lend this engine's committed weights to a new engine bootstrapping at
        ``host:port`` (its :meth:`reshard_bootstrap`), as peer number ``peer``: a thread
        on every worker sends while the engine goes on serving; returns at once.
        :meth:`reshard_lent` gives the outcome; a refit waits for it."""
        return self._reshard_state().lend(host, port, peer)

    @_reported
    def reshard_lent(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait for the last lending to end: {ok, version, bytes_sent, rounds, seconds,
        forwards_during (this rank's forward passes meanwhile), error?}."""
        return self._reshard_state().wait_lent(timeout_s)

    @_reported
    def reshard_refit(self) -> dict[str, Any]:
        """Receive the next version and make it live: {ok, version, seconds,
        bytes_received, expected_bytes, receive_seconds, commit_seconds, error?}."""
        return self._reshard_state().refit()

    @_reported
    def reshard_version(self) -> int:
        return self._reshard_state().version

    @_reported
    def reshard_status(self) -> dict[str, Any]:
        """{rank, version, stale, lendable}: ``stale`` while the live weights may be torn
        (a refit with ``staging="none"`` failed midway), until a complete refit lands;
        ``lendable`` once a refit (or bootstrap) committed, until the next one begins."""
        return self._reshard_state().status()

    @_reported
    def reshard_info(self) -> dict[str, Any]:
        return self._reshard_state().info()

    @_reported
    def reshard_last(self) -> dict[str, Any]:
        """The outcome of the last refit on this rank (as :meth:`reshard_refit` returns)."""
        return self._reshard_state().last

    @_reported
    def reshard_dump(self, names: Sequence[str] | None = None) -> dict[str, list]:
        """This rank's logical tensors as of the last refit, vLLM name -> nested lists
        (what ``collective_rpc`` carries; ``torch.tensor(x, dtype=...)`` restores them
        exactly)."""
        buffers = self._reshard_state().buffers
        return {n: buffers[n].tolist() for n in (names or buffers)}

    @_reported
    def reshard_verify(self, path: str) -> dict[str, Any]:
        """Check the last refit against vLLM's own loaders fed the full state dict saved
        at ``path`` (``torch.save`` of HF name -> tensor)."""
        state = self._reshard_state()
        model_type = getattr(state.vllm_config.model_config.hf_config, "model_type", None)
        return state.verify(_load_state(path, model_type))

    @_reported
    def reshard_reconnect(self, host: str, port: int, timeout_s: float = 120.0
                          ) -> dict[str, Any]:
        """After a refit failed because a trainer rank was lost (``reshard_last`` says
        ``ok: False``; the previous version stays live): meet the trainer again at a new
        ``host:port``, keeping the live weights and the version; returns sizes."""
        return self._reshard_state().reconnect(host, port, timeout_s)

    @_reported
    def reshard_close(self) -> None:
        """Leave the weight-update group (the engine keeps serving)."""
        self._reshard_drop()

    def _reshard_drop(self) -> None:
        state = getattr(self, "_reshard", None)
        if state is not None:
            state.close()
            self._reshard = None

    def _reshard_filled(self) -> ReshardState | None:
        """This rank's state if a bootstrap filled it (a version, no trainer met yet):
        taken from the protocol's holder, for the trainer or the fleet to meet."""
        state = getattr(self, "_reshard", None)
        if state is None or not state.bootstrapped or state.version == NO_VERSION:
            return None
        _filled.state = None
        return state

    def _reshard_state(self) -> ReshardState:
        """The newest of the extension's own state and the ``reshard`` backend's."""
        states = [getattr(self, "_reshard", None),
                  getattr(getattr(self, "weight_transfer_engine", None), "state", None)]
        state = max((s for s in states if isinstance(s, ReshardState)),
                    key=lambda s: s.created, default=None)
        if state is None:
            raise ReshardError("call reshard_init (or init_weight_transfer_engine with the "
                               "reshard backend) first")
        return state


# -------------------------------------------------------------- weight-transfer backend

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class ReshardInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    #: the trainer's ranks (not for a fleet replica: ``replica``)
    trainer_size: int | None = None
    staging: str = "shadow"
    budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES
    hf_tensors: dict[str, list[int]] | None = None
    timeout_s: float = 120.0
    #: refit a model family whose refit was never checked end to end (see
    #: ``reshard.integrations.vllm.mapping.check_family``)
    unchecked_family_ok: bool = False
    #: the meeting's token (else the workers' ``$RESHARD_TOKEN``); never in the repr
    token: str | None = field(default=None, repr=False)
    #: the freed heap a commit keeps resident before handing it back (None: all of it)
    heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
    #: the trainer's sparse mode (docs/sparse.md): the engine needs nothing for it (its
    #: staging holds the last version whole) and reports it in ``reshard_info``
    sparse: str = DEFAULT_SPARSE
    #: join the trainer's fleet at master_address:master_port (its ``ElasticSender``
    #: ranks) as the replica of this id, unique per incarnation (docs/fleets.md) ...
    replica: str | None = None
    #: ... fed as this says, the same on every rank of the fleet
    fanout: str = "auto"

    def __post_init__(self) -> None:  # refused by the engine core, before any worker
        check_heap_slack(self.heap_slack_bytes)
        if self.trainer_size is None and self.replica is None:
            raise ConfigError("trainer_size is missing: the trainer's number of ranks (or "
                              "replica, to join the trainer's fleet)")
        check_fanout(self.fanout)
        if self.sparse not in ("auto", "on", "off"):
            raise ConfigError(f"sparse must be one of ('auto', 'on', 'off'), got "
                              f"{self.sparse!r}")


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Per round, only how the version is received (the plan was agreed at init, the
    version comes from the trainer): ``background=True`` returns at once and receives in
    a thread of each worker while the engine goes on generating (overlapped refit; needs
    ``staging="shadow"``); ``False`` receives before returning (the engine core, and with
    it generation, waits). Either way nothing reaches the live weights before
    ``finish_weight_update``, which swaps the whole version in on every rank between the
    same two forward passes."""

    background: bool = False


def parse_fields(cls: type, info: Any, method: str) -> Any:
    """``cls(**info)``, or a ``ConfigError`` naming the fields ``cls`` does not know."""
    import dataclasses

    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        raise ConfigError(f"{method}: expected a JSON object of fields, got "
                         f"{type(info).__name__} (nothing was changed)")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(info) - set(known))
    if unknown:
        raise ConfigError(f"{method}: unknown field(s) {unknown} for the reshard backend; "
                         f"it knows {known} (nothing was changed)")
    try:
        return cls(**info)
    except (TypeError, ConfigError) as e:  # a required field missing, a bad value
        raise ConfigError(f"{method}: {e} (nothing was changed)") from None


class _Filled:
    """On this worker: the state a bootstrap filled, not yet met by a trainer (the
    extension's, which the backend's init adopts)."""

    state: ReshardState | None = None


_filled = _Filled()


def adopt_filled(init_info: ReshardInitInfo) -> ReshardState | None:
    """The state a bootstrap filled on this rank, met with the trainer of ``init_info``
    (its version and weights kept; its staging, budget, deadlines and heap slack now
    ``init_info``'s: the receiver it meets the trainer with is made from them), or None
    when none was filled."""
    state, _filled.state = _filled.state, None
    if state is None or not state.bootstrapped or state.version == NO_VERSION:
        return None
    state.staging = init_info.staging
    state.budget_bytes, state.timeout_s = init_info.budget_bytes, init_info.timeout_s
    state.heap_slack_bytes = check_heap_slack(init_info.heap_slack_bytes)
    if init_info.replica is not None:
        state.join_fleet(init_info.master_address, init_info.master_port,
                         init_info.replica, init_info.fanout, init_info.token)
    else:
        state.meet_trainer(init_info.master_address, init_info.master_port,
                           init_info.trainer_size, init_info.token)
    return state


def outcome(worker: Any) -> dict[str, Any] | None:
    """Run on every worker by the engine core (the plugin) after a protocol call: how
    this rank's reshard backend fared (``None`` where another backend is configured)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine.report() if isinstance(engine, ReshardWeightTransferEngine) else None


def failures(reports: Sequence[Any]) -> list[dict[str, Any]]:
    """The reports of :func:`outcome` that say a rank failed."""
    return [r for r in reports if isinstance(r, dict) and not r.get("ok", True)]


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """``weight_transfer_config={"backend": "reshard"}``: init meets the trainer,
    ``update_weights`` receives (in the background with ``background=True``),
    ``finish_weight_update`` swaps the version in and commits.

    No method raises into vLLM (a worker that raised would desynchronize vLLM 0.32's RPC
    replies): each records its outcome (:meth:`report`), which the reshard vLLM plugin
    reads in the engine core after the call and turns into the call's error there. A
    refit that failed commits nothing: the previous version stays live, and serving."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.state: ReshardState | None = None
        self.received: dict[str, Any] | None = None
        self.thread: threading.Thread | None = None
        self.outcome: dict[str, Any] = {"ok": True, "rank": self.parallel_config.rank}

    def _failed(self, what: str, e: BaseException) -> None:
        log.error("reshard: %s failed on rank %s: %s: %s", what, self.parallel_config.rank,
                  type(e).__name__, e)
        self.outcome = {"ok": False, "rank": self.parallel_config.rank,
                        "raised": type(e).__name__, "error": f"{type(e).__name__}: {e}"}

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        self._drop()
        pc = self.parallel_config
        self.outcome = {"ok": True, "rank": pc.rank}
        try:
            self.state = adopt_filled(init_info) or ReshardState(
                self.model, self.vllm_config, rank=pc.rank, inference_size=pc.world_size,
                host=init_info.master_address, port=init_info.master_port,
                trainer_size=init_info.trainer_size or 0, staging=init_info.staging,
                budget_bytes=init_info.budget_bytes, hf_tensors=init_info.hf_tensors,
                timeout_s=init_info.timeout_s,
                unchecked_family_ok=init_info.unchecked_family_ok, token=init_info.token,
                heap_slack_bytes=init_info.heap_slack_bytes, replica=init_info.replica,
                fanout=init_info.fanout)
            self.state.sparse = init_info.sparse
            self.outcome.update(self.state.info())
        except Exception as e:
            self._failed("init_weight_transfer_engine", e)

    def start_weight_update(self) -> None:
        self.received, self.thread = None, None
        self.outcome = {"ok": True, "rank": self.parallel_config.rank}

    def update_weights(self, update_info: Any) -> None:
        # the base class synchronizes the accelerator, which raises on CPU-only torch
        self.receive_weights(self.parse_update_info(update_info or {}))

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        """Receive the next version into staging (the logical buffers and the shadow of
        the in-place parameters): at once, or in a thread with ``background``."""
        if self.state is None:
            self._failed("update_weights", ReshardError("init_weight_transfer_engine first"))
            return
        if update_info.background:
            self.thread = threading.Thread(target=self._receive, name="reshard-receive",
                                           daemon=True)
            self.thread.start()
        else:
            self._receive()

    def _receive(self) -> None:
        """Receive, then prepare the packed GEMMs beside the engine
        (:meth:`ReshardState.prepare`), so that the swap is short."""
        try:
            self.received = self.state.receive(go_live=False, prepare=True)
        except Exception as e:
            self.received = None
            self.state.prepared = {}
            self._failed("the refit's receive", e)

    def finish_weight_update(self) -> None:
        """Swap the version received whole into the live model (between two forward
        passes: this is a worker RPC, in the worker's own thread) and commit it."""
        t0 = time.perf_counter()
        try:
            self._finish()
        finally:  # how long this rank kept the engine from its next step
            seconds = time.perf_counter() - t0
            self.outcome["finish_seconds"] = seconds
            if self.state is not None:  # and in reshard_last
                self.state.last["finish_seconds"] = seconds

    def _finish(self) -> None:
        if self.thread is not None:  # the trainer's send returned: this ends at once
            self.thread.join(timeout=self.state.timeout_s)
            if self.thread.is_alive():
                self._failed("finish_weight_update", ReshardError(
                    "the background receive is still running; call finish_weight_update "
                    "after every trainer rank's send returned"))
                return
            self.thread = None
        if self.state is not None and self.received is not None and self.outcome["ok"]:
            try:
                self.state.swap()
                self.outcome = {"ok": True, **self.state.last}
            except Exception as e:
                self._failed("the swap", e)
        self.received = None

    def report(self) -> dict[str, Any]:
        """The outcome of the last protocol call on this rank (:func:`outcome`)."""
        version = self.state.version if self.state is not None else None
        return {**self.outcome, "live_version": version}

    def _drop(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.state.timeout_s)
            self.thread = None
        if self.state is not None:
            self.state.close()
            self.state = None

    def shutdown(self) -> None:
        self._drop()


def register() -> None:
    """Register the ``reshard`` backend in vLLM's weight-transfer engine registry."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)


register()
