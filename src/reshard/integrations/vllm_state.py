"""One vLLM rank's side of a refit (:class:`ReshardState`): the mapping of the
trainer's tensors, where each parameter is written, the logical buffers, the receiver,
the commit, what it costs in memory, and the check against vLLM's own loaders. The
worker extension and the weight-transfer backend
(:mod:`reshard.integrations.vllm_worker`) both drive it.

How a refit lands on one rank:

1. At init, vLLM's per-rank *logical* (checkpoint-format) parameter shapes are read from
   the metadata vLLM records for layerwise reloading (``LAYERWISE_INFO``), and
   :func:`reshard.integrations.vllm_mapping.hf_to_vllm` maps every Hugging Face tensor
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
     :func:`~reshard.integrations.vllm_internals.unread_lm_head_weight`).
2. ``RefitReceiver.refit()`` writes the buffers directly (they are the staging of what
   they hold: nothing reaches the live model before the commit) and the in-place
   targets through a shadow of just those targets with ``staging="shadow"``, straight
   into the live weights with ``staging="none"``; it returns only once every rank of
   both jobs has its part, and then copies the shadow over the live weights.
3. Commit of the buffered parameters. vLLM CPU's packed GEMMs (unquantized linear
   layers and LM heads: most of the bytes) are processed in place: each module is lent
   its buffer and reruns vLLM's own ``process_weights_after_loading`` (the GEMM
   packing; the old packed copy is dropped first), then gets its own parameters back,
   one module at a time (``vllm_internals.process_in_place``); an embedding beside an
   LM head of its own is written in place and its packed GEMM copy, which nothing
   reads, is not remade. vLLM CPU's unquantized MoE experts are prepacked by vLLM's own
   kernel straight from their buffers into the live expert weights (padded first where
   the kernel pads; ``vllm_internals.prepack_experts``): nothing of the layer is
   replaced, and no second copy of the experts exists. The rest goes through vLLM's
   layerwise reload:
   ``initialize_layerwise_reload`` puts each layer back in checkpoint format (on the
   meta device); each logical buffer is copied whole into its parameter through the
   layer's deferred loader; when a layer is complete vLLM materializes it, reruns
   ``process_weights_after_loading`` (CPU GEMM packing, MoE pad + prepack) and copies
   the result into the original kernel tensors; layers written in place are put back as
   they are; ``finalize_layerwise_reload`` finishes. CPU MoE work-around, for the
   experts that go this way (zentorch's, or with biases): vLLM 0.32 reruns the CPU
   experts' pad + prepack only on a first load (``quant_method.moe_kernel is None``), so
   that attribute is reset, on the modules reloaded, before every commit.

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

Checks (tests, demo): ``reshard_verify(path)`` compares this rank's logical tensors with
what vLLM's own ``model.load_weights`` makes of the full state dict saved at ``path`` (a
dry run of layerwise reload that captures each layer before processing and puts the
live kernel tensors back), bit for bit, plus the parameters vLLM keeps unpacked live.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES, DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import ConfigError, ReshardError
from reshard.integrations.vllm_internals import (
    HeapBound,
    derived_buffers,
    direct_experts,
    direct_modules,
    has_own_lm_head,
    kept_live,
    logical_params,
    packed_expert_mismatches,
    packed_gemm_mismatches,
    params_held,
    prepack_experts,
    process_in_place,
    quiet_reload,
    refuse_unreloadable,
    reset_moe_kernels,
    reset_peak_rss,
    restore_loaders,
    return_freed_memory,
    rss_bytes,
    snapshot_loaders,
    stand_in,
    take_over,
    tied_aliases,
    unread_lm_head_weight,
)
from reshard.integrations.vllm_mapping import (
    MappingError,
    VllmMapping,
    check_family,
    hf_to_vllm,
    quant_format,
    unmapped_sides,
)

__all__ = ["ReshardState", "check_heap_slack", "map_or_explain", "require_plugin"]

PLUGIN_MODULE = "reshard.integrations.vllm_plugin"


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
    (:func:`reshard.integrations.vllm_mapping.check_family`)."""
    check_family(hf_config, unchecked_family_ok)
    try:
        mapping = hf_to_vllm(hf_config, tp, logical_shapes, hf_tensors=hf_tensors,
                             dtype=dtype)
    except MappingError as e:
        raise MappingError(f"{e}{unmapped_sides(hf_config, tp, logical_shapes, hf_tensors)}"
                           ) from None
    uncovered = mapping.uncovered(logical_shapes)
    if uncovered:
        raise MappingError(f"vLLM parameters that no trainer tensor fills: {uncovered[:8]} "
                           f"(first: {uncovered[0]!r}); a refit would leave them unset"
                           f"{unmapped_sides(hf_config, tp, logical_shapes, hf_tensors)}")
    return mapping


def _copy_into(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """The loader a commit uses: the buffer already is this rank's logical tensor."""
    param.data.copy_(loaded_weight)


def _converted(how: str, logical: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader computes from a checkpoint tensor (see ``CONVERSIONS``)."""
    if how == "neg_exp":  # Mamba: A = -exp(A_log), in float32
        return -torch.exp(logical.float())
    raise MappingError(f"unknown conversion {how!r}")


def _converting_loader(how: str) -> Any:
    """The commit's loader for a converted parameter."""
    def copy_converted(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(_converted(how, loaded_weight))
    return copy_converted


def check_heap_slack(value: Any) -> int | None:
    """``heap_slack_bytes`` as given, or a ``ConfigError`` naming it: bytes (an int of 0
    or more), or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
        raise ConfigError(f"heap_slack_bytes={value!r}: bytes (an int of 0 or more), or "
                          "None to keep every freed page resident")
    return value


class ReshardState:
    """One vLLM rank's side of the refit: mapping, where each parameter is written,
    logical buffers for the repacked ones, receiver, commit."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, rank: int,
                 inference_size: int, host: str, port: int, trainer_size: int,
                 staging: str = "shadow", budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 hf_tensors: Mapping[str, Sequence[int]] | None = None,
                 timeout_s: float = 120.0, unchecked_family_ok: bool = False,
                 token: str | None = None,
                 heap_slack_bytes: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES) -> None:
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
        self.stale = False  # a refit with staging="none" failed midway: weights may be torn
        self.last: dict[str, Any] = {}
        self._version = 0
        self.measured_peak = reset_peak_rss()
        self.rss_at_init = rss_bytes()
        common = dict(host=host, port=port, rank=rank, trainer_size=trainer_size,
                      inference_size=inference_size, staging=staging,
                      budget_bytes=budget_bytes, timeout=timedelta(seconds=timeout_s),
                      token=token,
                      quant=quant_format(vllm_config.model_config.hf_config))
        if hf_tensors is not None:  # told by the caller
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
        holds and never reads (``vllm_internals.unread_lm_head_weight``: an LM head of
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
        (``vllm_internals.direct_modules``: vLLM CPU's packed GEMMs); a tied tensor only
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
        """The weight version live in the model (the trainer's step of the last commit)."""
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
                "checksum": sorted({str(ex.checksum) for ex in self.receiver.executors})}

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
        """The live version and whether the weights may be torn (``stale``: a refit with
        ``staging="none"`` failed midway; the next complete refit clears it)."""
        return {"rank": self.rank, "version": self.version, "stale": self.stale}

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
            self.prepare_seconds = 0.0
            stats = self.receiver.refit(go_live=go_live,
                                        ready=self.prepare if prepare else None)
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
                     "prepare_seconds": self.prepare_seconds}
        return self.last

    @torch.no_grad()
    def prepare(self) -> float:
        """After ``receive(go_live=False)``, beside the serving engine (the background
        thread of an overlapped refit): run vLLM's processing of the packed GEMMs
        (:attr:`direct`) on stand-ins of their modules -- copies that share nothing
        the engine reads -- so that :meth:`swap` only hands each module its new packed
        copy. Costs, until the swap, one more packed copy of those modules (about what
        the rank received of them). Returns the seconds it took."""
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        self.prepared = {}
        unread = ("VocabParallelEmbedding",) if has_own_lm_head(self.model) else ()
        with set_current_vllm_config(self.vllm_config):
            for mname, names in self.direct.items():
                module = self.model.get_submodule(mname) if mname else self.model
                if type(module).__name__ in unread:
                    continue  # written in place at the swap
                standin = stand_in(module, list(self.own_storage.values()))
                process_in_place(standin, {self.where[n][1]: self.buffers[n] for n in names})
                self.prepared[mname] = standin
                for name in names:  # a tied tensor's other holders pack the new weight too
                    for alias, attr in self.aliases.get(name, []):
                        holder = self.model.get_submodule(alias)
                        if type(holder).__name__ in unread:
                            continue
                        other = stand_in(holder)
                        other._parameters[attr] = standin._parameters[self.where[name][1]]
                        process_in_place(other, {})
                        self.prepared[alias] = other
        self.prepare_seconds = time.perf_counter() - t0
        return self.prepare_seconds

    def swap(self) -> float:
        """Make the version received with ``receive(go_live=False)`` live: the shadow of
        the in-place parameters over them, then :meth:`commit` (with the modules
        :meth:`prepare` made, only their new packed copies handed over). Runs in the
        worker's own thread between two forward passes (a worker RPC), never beside one."""
        t0 = time.perf_counter()
        self.receiver.go_live()
        shadow = time.perf_counter() - t0
        seconds = self.commit()
        self.last.update(shadow_seconds=shadow, swap_seconds=time.perf_counter() - t0)
        return seconds

    @torch.no_grad()
    def commit(self) -> float:
        """Make the logical buffers live: vLLM CPU's packed GEMMs (linear layers, LM
        heads) processed in place (:meth:`_commit_direct`), everything else through
        vLLM's layerwise reload (:meth:`_commit_reload`)."""
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self._commit_direct()
            self._commit_reload({n: b for n, b in self.buffers.items()
                                 if self.where[n][0] not in self.direct
                                 and self.where[n][0] not in self.experts})
        return self._committed(t0)

    def _commit_direct(self) -> None:
        """Each module of :attr:`direct` gets its buffers and reruns vLLM's processing
        after loading (``vllm_internals.process_in_place``); the other holders of a tied
        tensor are processed with it, except an embedding beside an LM head of its own,
        whose packed GEMM copy nothing reads (the embedding lookup reads its weight)."""
        unread = ("VocabParallelEmbedding",) if has_own_lm_head(self.model) else ()
        prepared, self.prepared = self.prepared, {}
        written: set[int] = set()  # storages a hand-over wrote (a tied weight: once)
        heap = self._heap = HeapBound(self.heap_slack_bytes)
        for mname, names in self.direct.items():
            heap.check()
            module = self.model.get_submodule(mname) if mname else self.model
            logical = {self.where[n][1]: self.buffers[n] for n in names}
            if mname in prepared:  # processed beside the engine: hand it over
                take_over(module, prepared[mname], written)
            elif type(module).__name__ in unread:
                for attr, tensor in logical.items():  # read as loaded: in place is all
                    getattr(module, attr).data.copy_(tensor)
            else:
                process_in_place(module, logical, heap)
            for name in names:
                for alias, _ in self.aliases.get(name, []):
                    holder = self.model.get_submodule(alias)
                    if alias in prepared:
                        take_over(holder, prepared[alias], written)
                    elif type(holder).__name__ not in unread:
                        process_in_place(holder, {})  # its weight is the one just written
        for mname, names in self.experts.items():
            heap.check()
            prepack_experts(self.model.get_submodule(mname),
                            {self.where[n][1]: self.buffers[n] for n in names})

    def _commit_reload(self, buffers: dict[str, torch.Tensor]) -> None:
        """Copy ``buffers`` into the live model through vLLM's layerwise reload."""
        import vllm.model_executor.model_loader.reload.layerwise as lw

        if not buffers:
            return
        model = self.model
        saved = snapshot_loaders(model.parameters())
        kept = self.live_names | {n for n in self.buffers if n not in buffers}
        with quiet_reload(model, kept):
            # the modules this reload loads: each buffer's and its tied holders' (a
            # holder prepacked in place is left out below)
            loaded = {m for n in buffers for m, _ in [self.where[n][:2],
                                                      *self.aliases.get(n, [])]}
            reset_moe_kernels(model, [model.get_submodule(m) if m else model
                                      for m in loaded - set(self.experts)])
            lw.initialize_layerwise_reload(model)
            try:
                for name, buf in buffers.items():
                    # a tied tensor is loaded into every module holding it, so that each
                    # reprocesses its own copy (the LM head's GEMM)
                    for mname, attr in [self.where[name][:2], *self.aliases.get(name, [])]:
                        if mname in self.experts:
                            # holds the owner's parameter object, which the owner's
                            # reload writes: loading it here would reprocess the experts
                            continue
                        module = model.get_submodule(mname) if mname else model
                        param = getattr(module, attr)
                        # the restored parameter is vLLM's stored metadata object: its
                        # loader is put back afterwards, or later reloads would inherit ours
                        saved += snapshot_loaders([param])
                        how = self.mapping.converts.get(name)
                        param.weight_loader = _converting_loader(how) if how else _copy_into
                        param.weight_loader = lw.make_online_process_loader(module, attr)
                        param.weight_loader(param, buf)
            finally:
                lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
                restore_loaders(saved)
            for buffer, name in self.derived:  # views a reload leaves on the old storage
                if name in buffers:
                    buffer.copy_(buffers[name].view(buffer.shape))

    def _committed(self, t0: float) -> float:
        heap, self._heap = self._heap, None
        trims = heap.trims if heap is not None else 0
        if self.heap_slack_bytes is not None:  # else kept for the next commit's copies
            return_freed_memory()
            trims += 1
        seconds = time.perf_counter() - t0
        self._version, self.stale = self.receiver.version, False
        self.last.update(committed=True, commit_seconds=seconds, stale=False,
                         commit_trims=trims,
                         swap_forward=self.forwards,
                         peak_rss_extra=self._peak_extra(),
                         rss_extra=rss_bytes() - self.rss_at_init)
        return seconds

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

    # -- checks (tests, demo) ---------------------------------------------------------
    @torch.no_grad()
    def vllm_reference(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What vLLM's own ``model.load_weights`` makes of a full checkpoint-format state
        dict on this rank, as logical tensors -- without touching the live weights.

        A dry run of layerwise reload: every layer is restored in checkpoint format and
        loaded by the model's own loaders; when a layer is complete its logical tensors
        are captured and the live kernel tensors are put back, unprocessed. (Tensors
        vLLM never moves to meta, such as biases, are written in place with the same
        loaders.)"""
        import vllm.model_executor.model_loader.reload.layerwise as lw
        from vllm.config import set_current_vllm_config

        model = self.model
        names = {m: n for n, m in model.named_modules()}
        captured: dict[str, torch.Tensor] = {}

        def capture(layer: torch.nn.Module, info: Any) -> None:
            lw.materialize_layer(layer, info)
            for p in lw.get_layer_tensors(layer).values():
                p.weight_loader = lw._get_original_loader(p)
            for pname, args in info.loaded_weights:
                param = getattr(layer, pname)
                args.arguments["param"] = param
                param.weight_loader(*args.args, **args.kwargs)
            prefix = names[layer]
            for pname, p in layer._parameters.items():
                if p is not None:
                    name = f"{prefix}.{pname}" if prefix else pname
                    # in its checkpoint dtype, as a fresh load stores it: a bias vLLM
                    # turned to float32 takes the checkpoint's values unrounded here
                    logical = self.where[name][3] if name in self.where else p.dtype
                    captured[name] = p.detach().to(logical, copy=True)
            lw._place_kernel_tensors(layer, info)
            info.reset()

        saved = snapshot_loaders(model.parameters())
        original = lw._layerwise_process
        lw._layerwise_process = capture
        try:
            with set_current_vllm_config(self.vllm_config), quiet_reload(model):
                lw.initialize_layerwise_reload(model)
                try:
                    model.load_weights(iter(state_dict.items()))
                finally:
                    lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            lw._layerwise_process = original
            restore_loaders(saved)
        return captured

    def verify(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Compare the logical buffers of the last refit with :meth:`vllm_reference` of
        ``state_dict``, bit for bit; also the live parameters vLLM keeps unpacked."""
        ref = self.vllm_reference(state_dict)
        mismatched = [n for n, b in {**self.buffers, **self.live}.items()
                      if n not in ref or not _same(ref[n], self._as_loaded(n, b))]
        mismatched += [f"{n} (derived buffer)" for d, n in self.derived
                       if n in ref and not _same(d, ref[n].view(d.shape))]
        mismatched += packed_gemm_mismatches(self.model, ref, self.aliases)
        mismatched += packed_expert_mismatches(self.model, ref, list(self.experts))
        live = dict(self.model.named_parameters())
        # packed linears are empty on CPU (shape differs); MoE experts are reordered in
        # place whatever their shape: compare the others, which vLLM leaves as loaded
        experts = {n for n, (m, _, _, _) in self.where.items()
                   if hasattr(self.model.get_submodule(m) if m else self.model, "w13_weight")}
        live_checked = [n for n, b in self.buffers.items() if n in live and n not in experts
                        and tuple(live[n].shape) == tuple(b.shape)]
        live_mismatched = [n for n in live_checked if not _same(
            live[n].data, self._as_loaded(n, self.buffers[n]))]
        return {"rank": self.rank, "checked": len(self.buffers) + len(self.live),
                "in_place_checked": len(self.live), "mismatched": mismatched,
                "live_checked": len(live_checked), "live_mismatched": live_mismatched}

    def reconnect(self, host: str, port: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """Meet the trainer again at a new ``host:port`` after a lost worker (collective
        with the trainer ranks' ``RefitSender.reconnect`` or fresh senders): the live
        weights and the version are kept; the mapping and the buffers are remade."""
        self.receiver.reconnect(host, port, timeout=timedelta(seconds=timeout_s))
        return self.info()

    def _as_loaded(self, name: str, logical: torch.Tensor) -> torch.Tensor:
        """A logical tensor as vLLM's loader stores it (its conversion applied)."""
        how = self.mapping.converts.get(name)
        return logical if how is None else _converted(how, logical).to(self.where[name][3])

    def close(self) -> None:
        self._counting.remove()
        self.receiver.comm.close()


def _same(held: torch.Tensor, logical: torch.Tensor) -> bool:
    """Bit for bit the same values; where vLLM holds a tensor in another dtype than its
    checkpoint form (a bias it turned to float32), the same through an exact cast both
    ways."""
    if held.dtype == logical.dtype:
        if held.element_size() == 1 and held.is_floating_point():  # FP8: no torch.equal
            return torch.equal(held.view(torch.uint8), logical.view(torch.uint8))
        return torch.equal(held, logical)
    return (torch.equal(held, logical.to(held.dtype)) and
            torch.equal(held.to(logical.dtype), logical))
