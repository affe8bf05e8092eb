"""One vLLM rank's side of a refit (:class:`ReshardState`): the mapping of the
trainer's tensors, where each parameter is written, the logical buffers, the receiver,
the commit, what it costs in memory, and the check against vLLM's own loaders. The
worker extension and the weight-transfer backend
(:mod:`reshard.integrations.vllm.worker`) both drive it.

How a refit lands on one rank:

1. At init, vLLM's per-rank *logical* (checkpoint-format) parameter shapes are read from
   the metadata vLLM records for layerwise reloading (``LAYERWISE_INFO``), and
   :func:`reshard.integrations.vllm.mapping.hf_to_vllm` maps every Hugging Face tensor
   to a slot of a logical tensor and a layout. Then, per parameter, the cheapest way in
   (:func:`kept_live`, from what vLLM holds now; ``reshard_info`` lists both kinds):

   * **in place**: where the live parameter *is* its logical tensor and its module
     reads it as loaded (norms, embeddings; on GPUs unquantized weights generally), the
     receiver's targets are views into the live parameter itself; no buffer exists;
   * **logical buffer**: where vLLM repacks or pads after loading (CPU GEMM packing of
     linear layers and the LM head, MoE experts padded and prepacked), one logical
     buffer per parameter, committed through vLLM's layerwise reload; except an LM
     head of its own on vLLM CPU, received into its weight, which vLLM keeps after
     packing and never reads (``own_storage`` in ``reshard_info``; see
     :func:`~reshard.integrations.vllm.kernels.unread_lm_head_weight`).
2. ``RefitReceiver.refit()`` writes the buffers directly (they are the staging of what
   they hold: nothing reaches the live model before the commit) and the in-place
   targets through a shadow of just those targets with ``staging="shadow"``, straight
   into the live weights with ``staging="none"``; it returns only once every rank of
   both jobs has its part, and then copies the shadow over the live weights.
3. The commit of the buffered parameters (:mod:`reshard.integrations.vllm.commit`):
   vLLM CPU's packed GEMMs processed in place, its MoE experts prepacked in place, the
   rest through vLLM's layerwise reload; with ``receive(go_live=False)`` the packed GEMMs
   may be processed beside the serving engine and only handed over at the swap.

Memory per rank beyond the weights: the buffers of repacked parameters, plus with
``staging="shadow"`` a copy of what is written in place -- together what the rank
receives (plus vocabulary padding rows, less an LM head received into its own unread
weight), the transfer's staging arena (its budget), and
during a commit one reloaded layer at a time. ``reshard_info`` gives each figure;
``benchmarks/engine_memory.py`` measures them against resident memory.

Never torn with ``staging="shadow"``: nothing reaches the live model before
``RefitReceiver.refit()`` returned on every rank; a refit that fails (a trainer rank
raising, a peer lost) leaves the live model and the version as they were (the buffers,
being staging, may hold part of the failed version; the next refit rewrites them
whole). With ``staging="none"`` a failed refit may leave the in-place weights torn:
every rank then reports itself ``stale`` (``reshard_status``, ``reshard_last``) at the
previous version until a complete refit lands. vLLM 0.32 offers no clean way for a
worker to refuse generation (an exception in the model's forward kills the engine
core), so a stale engine still serves: the caller must check ``reshard_status``.

Checks (tests, demo): :mod:`reshard.integrations.vllm.verify`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from reshard.defaults import (
    DEFAULT_COMMIT_HEAP_SLACK_BYTES,
    DEFAULT_REFIT_BUDGET_BYTES,
    NO_VERSION,
)
from reshard.errors import ConfigError, ReshardError
from reshard.integrations.vllm.commit import Commit
from reshard.integrations.vllm.internals import (
    derived_buffers,
    kept_live,
    logical_params,
    refuse_unreloadable,
    tied_aliases,
)
from reshard.integrations.vllm.kernels import (
    direct_experts,
    direct_modules,
    params_held,
    unread_lm_head_weight,
)
from reshard.integrations.vllm.mapping import (
    MappingError,
    VllmMapping,
    check_family,
    map_whole,
    quant_format,
)
from reshard.integrations.vllm.memory import HeapBound, reset_peak_rss, rss_bytes
from reshard.integrations.vllm.peers import Peers
from reshard.integrations.vllm.verify import Checks
from reshard.refit.elastic import ElasticReceiver
from reshard.refit.sparse import sparse_summary

__all__ = ["ReshardState", "check_heap_slack", "map_or_explain", "require_plugin"]

PLUGIN_MODULE = "reshard.integrations.vllm.plugin"


def require_plugin() -> None:
    """Refuse to refit an engine whose engine core does not clear its prefix cache at a
    commit. vLLM loads general plugins in the engine core and in every worker alike, so
    a worker without the plugin means an engine core without it. (Read through
    ``sys.modules``: vLLM imported the plugin's module if it loaded it, and this module
    sits below it.)"""
    import os
    import sys

    if not getattr(sys.modules.get(PLUGIN_MODULE), "_LOADED", False):
        raise ReshardError(
            "reshard's vLLM plugin is not loaded in this engine (VLLM_PLUGINS="
            f"{os.environ.get('VLLM_PLUGINS')!r}): it clears vLLM's prefix cache at every "
            "commit, without which requests after a refit read KV computed with the old "
            "weights; add 'reshard' to VLLM_PLUGINS, or unset it")


def map_or_explain(hf_config: Any, tp: int, logical_shapes: Mapping[str, Any],
                   hf_tensors: Mapping[str, Sequence[int]], dtype: Any,
                   unchecked_family_ok: bool = False) -> VllmMapping:
    """:func:`hf_to_vllm` of the trainer's tensors, every vLLM parameter filled; or a
    :class:`MappingError` naming the first unmapped tensor on each side, or the family
    when its refit was never checked end to end and the caller did not opt in
    (:func:`reshard.integrations.vllm.mapping.check_family`)."""
    check_family(hf_config, unchecked_family_ok)
    return map_whole(hf_config, tp, logical_shapes, hf_tensors, dtype)


def check_heap_slack(value: Any) -> int | None:
    """``heap_slack_bytes`` as given, or a ``ConfigError`` naming it: bytes (an int of 0
    or more), or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ConfigError(f"heap_slack_bytes={value!r}: bytes (an int of 0 or more), or "
                          "None to keep every freed page resident")
    return value


class ReshardState(Commit, Checks, Peers):
    """One vLLM rank's side of the refit: mapping, where each parameter is written,
    logical buffers for the repacked ones, receiver; the commit (:class:`Commit`), the
    checks (:class:`Checks`) and peer bootstrap (:class:`Peers`) are mixed in.
    ``bootstrap``: the number of live engines to fill this one from, at ``host:port``
    (this engine's rank 0 hosts the meeting; ``trainer_size`` unused): the receiver
    then meets them, and :meth:`meet_trainer` the trainer later. ``replica``: join the
    trainer's fleet at ``host:port`` (its ``ElasticSender`` ranks; ``trainer_size``
    unused) as the replica of that id, fed with the others by ``fanout``
    (:mod:`reshard.refit.elastic`, :mod:`reshard.fanout`)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, rank: int,
                 inference_size: int, host: str, port: int, trainer_size: int,
                 staging: str = "shadow", budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 hf_tensors: Mapping[str, Sequence[int]] | None = None,
                 timeout_s: float = 120.0, unchecked_family_ok: bool = False,
                 token: str | None = None,
                 heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES,
                 bootstrap: int | None = None, replica: str | None = None,
                 fanout: str = "auto") -> None:
        from reshard.refit.receiver import RefitReceiver

        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ReshardError("the reshard vLLM integration covers tensor parallelism only "
                               f"(pipeline_parallel_size={pc.pipeline_parallel_size})")
        self.heap_slack_bytes = check_heap_slack(heap_slack_bytes)
        self._heap: HeapBound | None = None  # the commit's, while it runs
        self.model, self.vllm_config, self.rank = model, vllm_config, rank
        self.inference_size, self.timeout_s = inference_size, timeout_s
        self.where = logical_params(model)
        self.aliases = tied_aliases(model, self.where)
        self.derived = derived_buffers(model, self.where)
        self.staging = staging
        self.unchecked_family_ok = unchecked_family_ok
        self.sparse = "off"  # what the trainer said it sends (its init info), reported
        self.stale = False  # a refit with staging="none" failed midway: weights may be torn
        self.last: dict[str, Any] = {}
        self._version = NO_VERSION  # the checkpoint's weights: no refit's
        self.measured_peak = reset_peak_rss()
        self.rss_at_init = rss_bytes()
        self.budget_bytes, self.token = budget_bytes, token
        self._init_peers()
        common = self._receiver_options(host, port, trainer_size)
        if bootstrap is not None:  # learnt from the live engines it is filled from
            self.receiver = self._bootstrap_receiver(host, port, bootstrap)
        elif replica is not None:  # one replica of the trainer's fleet
            self.receiver = self._replica_receiver(host, port, replica, fanout)
        elif hf_tensors is not None:  # told by the caller
            targets, layouts, direct = self._prepare(hf_tensors)
            self.receiver = RefitReceiver(targets, layouts, direct=direct, **common)
        else:  # learnt from the trainer at the meeting
            self.receiver = RefitReceiver(prepare=self._prepare_from, **common)
        self.created = time.monotonic()
        # forward passes of this rank's model: a swap records the count it happened at,
        # so every TP rank can be shown to swap between the same two forward passes
        self.forwards = 0
        self._counting = model.register_forward_pre_hook(self._count_forward)
        self.prepared: dict[str, torch.nn.Module] = {}  # module -> its stand-in (prepare)
        self.prepare_seconds = 0.0

    def _receiver_options(self, host: str, port: int, trainer_size: int) -> dict[str, Any]:
        """What the receiver meeting the trainer is given, but its tensors."""
        return dict(host=host, port=port, rank=self.rank, trainer_size=trainer_size,
                    inference_size=self.inference_size, staging=self.staging,
                    budget_bytes=self.budget_bytes, timeout=timedelta(seconds=self.timeout_s),
                    token=self.token,
                    quant=quant_format(self.vllm_config.model_config.hf_config))

    def _replica_receiver(self, host: str, port: int, replica: str, fanout: str,
                          **tensors: Any) -> Any:
        """This rank's :class:`~reshard.refit.elastic.ElasticReceiver` in the trainer's
        fleet: the mapping made from the trainer's layouts (read from its store before
        the replica asks to join), the logical buffers its own staging; or ``tensors``
        (targets, layouts, direct) already made (a bootstrapped engine's)."""
        if self.staging != "shadow":
            raise ConfigError("a replica of an elastic fleet stages in a shadow: "
                              f"staging={self.staging!r} is not offered there")
        if quant_format(self.vllm_config.model_config.hf_config) is not None:
            raise ConfigError("a quantized (FP8) engine cannot join an elastic fleet yet: "
                              "meet the trainer with reshard_init")
        return ElasticReceiver(host=host, port=port, replica_id=replica, rank=self.rank,
                               tp_size=self.inference_size, budget_bytes=self.budget_bytes,
                               timeout=timedelta(seconds=self.timeout_s), token=self.token,
                               fanout=fanout, **(tensors or {"prepare": self._prepare_from}))

    @property
    def in_fleet(self) -> bool:
        """Whether this engine is a replica of the trainer's fleet (an elastic group)."""
        return isinstance(self.receiver, ElasticReceiver)

    def _count_forward(self, module: Any, args: Any) -> None:
        self.forwards += 1

    def _prepare_from(self, trainer: Mapping[str, Any]) -> tuple[dict, dict, list[str]]:
        return self._prepare({name: layout.shape for name, layout in trainer.items()})

    def _prepare(self, hf_tensors: Mapping[str, Sequence[int]]) -> tuple[dict, dict, list[str]]:
        """The mapping of the trainer's tensors, where each vLLM parameter is written,
        the logical buffers: the receiver's (targets, layouts, direct names)."""
        model_config = self.vllm_config.model_config
        dtype = model_config.dtype
        require_plugin()  # the engine core clears its prefix cache at every commit
        refuse_unreloadable(self.model)
        shapes = {n: s for n, (_, _, s, _) in self.where.items()}
        self.mapping = map_or_explain(model_config.hf_config, self.inference_size, shapes,
                                      hf_tensors, dtype, self.unchecked_family_ok)
        odd = [n for n, d in self.mapping.param_dtypes.items() if n not in
               self.mapping.converts and self.where[n][3] != getattr(torch, d)]
        if odd:
            raise MappingError(f"vLLM parameters not in the dtype the mapping gives them "
                               f"(model dtype {dtype}): {odd[:8]}")
        # a converted parameter (Mamba's A = -exp(A_log)) goes through its commit
        converted = {self.where[n][0] for n in self.mapping.converts}
        self.live_names = {n for n in kept_live(self.model, {n: self.where[n] for n in
                                                             self.mapping.param_shapes},
                                                self.aliases)
                           if self.where[n][0] not in converted}
        self.live = {n: self._param(n).data for n in sorted(self.live_names)}
        buffered = [n for n in self.mapping.param_shapes if n not in self.live_names]
        self.own_storage = self._unread_storage(buffered)
        made = self.mapping.allocate(self.rank, [n for n in buffered
                                                 if n not in self.own_storage])
        self.buffers = {n: made[n] if n in made else self.own_storage[n] for n in buffered}
        self.direct = self._direct_modules()
        # MoE experts prepacked in place (vLLM CPU's unquantized experts, no biases)
        self.experts = direct_experts(self.model, self.where, list(self.buffers),
                                      set(self.mapping.converts), self.aliases)
        self.expected_bytes = self.mapping.shard_bytes(self.rank)
        slots = self.mapping.slots(self.rank)
        targets = self.mapping.targets(self.rank, {**self.buffers, **self.live})
        return targets, self.mapping.layouts, [h for h, s in slots.items()
                                                if s.param in self.buffers]

    def _unread_storage(self, buffered: Sequence[str]) -> dict[str, torch.Tensor]:
        """The buffered parameters received into their own storage, which the engine
        holds and never reads (``kernels.unread_lm_head_weight``: an LM head of
        its own on vLLM CPU, whose logits come from its packed GEMM copy): no buffer is
        made for them. Each is zeroed whole at init, so that its padding rows, which no
        refit writes, are 0 as a new buffer's are."""
        out = {}
        storages: dict[int, int] = {}  # storage -> parameters on it (a tied one: several)
        for _, p in self.model.named_parameters(remove_duplicate=False):
            key = p.untyped_storage().data_ptr()
            storages[key] = storages.get(key, 0) + 1
        for name in buffered:
            mname, attr, _, dtype = self.where[name]
            held = unread_lm_head_weight(self.model.get_submodule(mname) if mname
                                         else self.model)
            if (held is None or attr != "weight" or name in self.aliases
                    or name in self.mapping.converts or not held.is_contiguous()
                    or tuple(held.shape) != tuple(self.mapping.param_shapes[name])
                    or held.dtype != dtype
                    or storages.get(held.untyped_storage().data_ptr(), 0) != 1):
                continue
            held.zero_()
            out[name] = held
        return out

    def _direct_modules(self) -> dict[str, list[str]]:
        """Module -> its buffered parameters, for the modules a commit processes in place
        (``kernels.direct_modules``: vLLM CPU's packed GEMMs); a tied tensor only
        where every module holding it keeps it whole (an embedding and its LM head)."""
        derived = {n for _, n in self.derived}
        tied_packed = {n for n in self.aliases if any(
            getattr(self.model.get_submodule(m) if m else self.model, a).numel() == 0
            for m, a in [self.where[n][:2], *self.aliases[n]])}
        excluded = set(self.mapping.converts) | derived | tied_packed
        out = direct_modules(self.model, self.where, list(self.buffers), excluded)
        for name, holders in self.aliases.items():  # the other holders go with the owner
            mname = self.where[name][0]
            if mname in out and not all(self._packs_only(m, a) for m, a in holders):
                del out[mname]
        return out

    def _packs_only(self, mname: str, attr: str) -> bool:
        module = self.model.get_submodule(mname) if mname else self.model
        shape = tuple(getattr(module, attr).shape)
        return attr == "weight" and params_held(module) == {"weight"} and bool(
            direct_modules(self.model, {f"{mname}.{attr}": (mname, attr, shape, None)},
                           [f"{mname}.{attr}"]))

    def _param(self, name: str) -> torch.Tensor:
        mname, attr, _, _ = self.where[name]
        return getattr(self.model.get_submodule(mname) if mname else self.model, attr)

    @property
    def version(self) -> int:
        """The weight version live in the model: the trainer's step of the last commit,
        ``NO_VERSION`` (-1) before the first (the weights the engine loaded)."""
        return self._version

    def info(self) -> dict[str, Any]:
        """Sizes: HF tensors, vLLM parameters (written in place or through a logical
        buffer), bytes a refit brings, the memory it costs beyond the weights."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        own = nbytes(self.own_storage.values())
        buffer_bytes = nbytes(self.buffers.values()) - own
        shadow_bytes = self.receiver.shadow_bytes
        return {"rank": self.rank, "version": self.version, "stale": self.stale,
                "staging": self.staging, "tensors": len(self.mapping.tensors),
                "params": len(self.mapping.param_shapes),
                "in_place": sorted(self.live_names), "buffered": sorted(self.buffers),
                "own_storage": sorted(self.own_storage), "own_storage_bytes": own,
                "packed_in_place": sorted(self.direct),
                "heap_slack_bytes": self.heap_slack_bytes,
                "prepacked_experts": sorted(self.experts),
                "weight_bytes": nbytes(self.live.values()) + buffer_bytes + own,
                "in_place_bytes": nbytes(self.live.values()),
                "expected_bytes": self.expected_bytes, "buffer_bytes": buffer_bytes,
                "shadow_bytes": shadow_bytes, "extra_bytes": buffer_bytes + shadow_bytes,
                "commit_transient_bytes": self._commit_transient(),
                "rss_extra": rss_bytes() - self.rss_at_init,
                "checksum": sorted({str(ex.checksum) for ex in self.receiver.executors}),
                "sparse": self.sparse}

    def _commit_transient(self) -> int:
        """Bytes a commit holds beyond the buffers, at its peak, as vLLM 0.32 CPU's
        layerwise reload behaves (traced per reloaded parameter with ``VmRSS``, see
        ``benchmarks/engine_memory.py``):

        * a repacked linear (GEMM) committed through layerwise reload keeps its old
          packed kernel until the reload ends, so every such buffer is held twice; one
          processed in place (:attr:`direct`) frees it before the new one is made;
        * MoE experts prepacked in place (:attr:`experts`) hold nothing more (a padded
          copy of one weight where the kernel pads); those reloaded lose their old
          prepacked copy when the commit resets the expert kernel
          (:func:`reset_moe_kernels`), and each such module, when reloaded, holds its
          materialized weights and the new prepacked copy at once;
        * layers are reloaded one at a time: on top of the kept kernels, the largest
          layer's materialized weights (times two for experts)."""
        kept, per_module = 0, {}
        for name, buf in self.buffers.items():
            mname, n = self.where[name][0], buf.numel() * buf.element_size()
            module = self.model.get_submodule(mname) if mname else self.model
            experts = hasattr(getattr(module, "quant_method", None), "moe_kernel")
            if mname in self.direct or mname in self.experts:
                continue
            kept += 0 if experts else n
            per_module[mname] = per_module.get(mname, 0) + (2 * n if experts else n)
        return kept + max(per_module.values(), default=0)

    def status(self) -> dict[str, Any]:
        """The live version, whether the weights may be torn (``stale``: a refit with
        ``staging="none"`` failed midway; the next complete refit clears it) and whether
        this rank can lend them to a new engine (``lendable``: its last refit committed)."""
        return {"rank": self.rank, "version": self.version, "stale": self.stale,
                "lendable": self.whole}

    def receive(self, go_live: bool = True, prepare: bool = False) -> dict[str, Any]:
        """RefitReceiver.refit() into the logical buffers; raises on failure (nothing
        committed, ``last`` says why). With ``go_live=False`` nothing of the live model
        is written (the in-place parameters wait in the shadow): the engine may go on
        generating while this runs in a background thread; :meth:`swap` makes it live.
        ``prepare``: :meth:`prepare` too, before this rank confirms its part (so the
        trainer's send returns when the version is ready to swap)."""
        t0 = time.perf_counter()
        self.measured_peak = reset_peak_rss()  # this refit's own peak
        rss_start = rss_bytes() - self.rss_at_init
        forward_at_start = self.forwards
        self.prepared = {}  # made for a version that never went live: gone
        try:
            self._stop_lending()  # this refit writes what a lending reads
            self.prepare_seconds = 0.0
            stats = self.receiver.refit(go_live=go_live,
                                        ready=self.prepare if prepare else None)
            if stats is None:  # an elastic replica that left, or was dropped
                raise ReshardError("this engine is no longer a replica of the trainer's "
                                   "fleet (it left, or was dropped after a failure)")
        except Exception as e:
            # with staging="none" the live in-place weights may hold part of the new version
            self.stale = self.stale or (self.staging == "none" and bool(self.live))
            self.last = {"ok": False, "rank": self.rank, "version": self.version,
                         "stale": self.stale, "error": f"{type(e).__name__}: {e}",
                         "seconds": time.perf_counter() - t0}
            raise
        self.last = {"ok": True, "rank": self.rank, "version": stats.version,
                     "receive_seconds": stats.seconds, "bytes_received": stats.bytes_received,
                     "bytes_sent": stats.bytes_sent, "rounds": stats.rounds,
                     "expected_bytes": self.expected_bytes, "committed": False,
                     "staging_bytes": stats.peak_staging_bytes, "rss_extra_start": rss_start,
                     "peak_rss_extra_receive": self._peak_extra(),
                     "forwards_during_receive": self.forwards - forward_at_start,
                     "prepare_seconds": self.prepare_seconds,
                     "sparse": sparse_summary(stats.sparse)}
        return self.last

    def _peak_extra(self) -> int | None:
        """Peak resident memory since the refit state began, beyond what it was then."""
        return rss_bytes("VmHWM") - self.rss_at_init if self.measured_peak else None

    def refit(self) -> dict[str, Any]:
        """Receive, then commit: {ok, version, seconds, bytes_received, expected_bytes,
        receive_seconds, commit_seconds}; ``ok: False`` and ``error`` when the refit
        failed (the live model and the version are then those of the previous refit)."""
        t0 = time.perf_counter()
        try:
            self.receive()
        except ReshardError:  # TransferError: aborted on every rank of both jobs
            return self.last
        self.commit()
        self.last["seconds"] = time.perf_counter() - t0
        return self.last

    def reconnect(self, host: str, port: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """Meet the trainer again at a new ``host:port`` after a lost worker (collective
        with the trainer ranks' ``RefitSender.reconnect`` or fresh senders): the live
        weights and the version are kept; the mapping and the buffers are remade."""
        if self.in_fleet:
            raise ConfigError("a replica of an elastic fleet does not reconnect: the fleet "
                              "drops a replica it lost; join again under a new id")
        self.receiver.reconnect(host, port, timeout=timedelta(seconds=timeout_s))
        return self.info()

    def close(self) -> None:
        self._counting.remove()
        if self.in_fleet:  # its epoch's group, if it formed one
            self.receiver.close()
        else:
            self.receiver.comm.close()


