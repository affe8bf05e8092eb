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
  A failed refit does not raise (see :func:`_reported`): ``collective(llm,
  "reshard_last")`` reports it and ``finish_weight_update`` then commits nothing.

vLLM 0.32 caveat: when a ``collective_rpc`` method raises on a worker, the executor stops
reading replies there and the later workers' replies are taken as the answers of the
next call, so no ``reshard_*`` method raises into vLLM; use :func:`collective` to get an
exception back in the caller.

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
     buffer per parameter, committed through vLLM's layerwise reload.
2. ``RefitReceiver.refit()`` writes the buffers directly (they are the staging of what
   they hold: nothing reaches the live model before the commit) and the in-place
   targets through a shadow of just those targets with ``staging="shadow"``, straight
   into the live weights with ``staging="none"``; it returns only once every rank of
   both jobs has its part, and then copies the shadow over the live weights.
3. Commit of the buffered parameters, through vLLM's layerwise reload:
   ``initialize_layerwise_reload`` puts each layer back in checkpoint format (on the
   meta device); each logical buffer is copied whole into its parameter through the
   layer's deferred loader; when a layer is complete vLLM materializes it, reruns
   ``process_weights_after_loading`` (CPU GEMM packing, MoE pad + prepack) and copies
   the result into the original kernel tensors; layers written in place are put back as
   they are; ``finalize_layerwise_reload`` finishes. CPU MoE work-around: vLLM 0.32
   reruns the CPU experts' pad + prepack only on a first load (``quant_method.moe_kernel
   is None``), so that attribute is reset before every commit.

Memory per rank beyond the weights: the buffers of repacked parameters, plus with
``staging="shadow"`` a copy of what is written in place -- together what the rank
receives (plus vocabulary padding rows), the transfer's staging arena (its budget), and
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
Limits: tensor parallelism only (no pipeline or expert parallelism on the vLLM side);
vLLM 0.32's layerwise-reload internals are used, so the vLLM version is pinned.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from reshard.defaults import DEFAULT_BUDGET_BYTES
from reshard.errors import ReshardError
from reshard.integrations.vllm_mapping import (
    MappingError,
    VllmMapping,
    check_family,
    hf_to_vllm,
    unmapped_sides,
)
from reshard.integrations.vllm_plugin import require_loaded as require_plugin

__all__ = [
    "ReshardInitInfo", "ReshardState", "ReshardUpdateInfo", "ReshardWeightTransferEngine",
    "ReshardWorkerExtension", "collective", "has_own_lm_head", "kept_live", "logical_params",
    "map_or_explain", "packed_gemm_mismatches",
    "refuse_unreloadable", "register", "tied_aliases",
]

log = logging.getLogger("reshard.vllm")
BACKEND = "reshard"


def logical_params(model: torch.nn.Module) -> dict[str, tuple[str, str, tuple[int, ...],
                                                                torch.dtype]]:
    """vLLM param name -> (module name, attribute, per-rank logical shape, dtype).

    Shapes come from vLLM's layerwise-reload metadata (the parameters as the model
    created them, before any repacking); parameters vLLM does not record there (biases,
    and DeepSeek's router ``e_score_correction_bias``, added after the layer was created)
    are taken live."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out, seen = {}, set()
    for mname, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        metas = dict(info.restore_metadata[0]) if info is not None else {}
        for pname in ("bias", "e_score_correction_bias"):  # vLLM never records these
            live = module._parameters.get(pname)
            if live is not None and pname not in metas:
                metas[pname] = live
                if pname == "bias" and "weight" in metas:
                    # created in the weight's dtype; vLLM CPU's small-GEMM kernel turns
                    # the bias to float32 after loading (on hosts with AMX)
                    metas[pname] = torch.empty(live.shape, dtype=metas["weight"].dtype,
                                               device="meta")
        for pname, meta in metas.items():
            live = module._parameters.get(pname)
            if live is not None and id(live) in seen:
                continue  # tied: another module's parameter, listed under its first name
            seen.add(id(live))
            out[f"{mname}.{pname}" if mname else pname] = (mname, pname, tuple(meta.shape),
                                                           meta.dtype)
    return out


def refuse_unreloadable(model: torch.nn.Module) -> None:
    """Refuse a model whose attention dropped a weight after loading, so that nothing is
    left for a reload to refill: neither a reshard commit nor vLLM's own
    ``reload_weights`` can then update it. vLLM CPU's AMX MLA backend (picked wherever
    the processor has AMX; it loads bf16 only) packs its own copies of ``kv_b_proj`` and
    leaves that parameter empty; the reference CPU MLA backend keeps it."""
    for mname, module in model.named_modules():
        if getattr(module, "is_amx_bmm_enabled", False):
            raise MappingError(
                f"{mname}: vLLM's AMX MLA backend dropped kv_b_proj.weight after packing "
                "it, so no refit can reach it; start the engine with "
                "attention_backend='CPU_MLA' (the reference CPU MLA backend keeps it)")


#: Module buffers vLLM makes at init as views of a parameter's checkpoint form, which the
#: forward reads: (buffer attribute, parameter relative to the module). Mamba2's
#: ``conv_weights`` views ``conv1d.weight``; where vLLM CPU then repacks ``conv1d`` (its
#: small-GEMM kernel, on hosts with AMX), the view keeps the storage as first loaded and
#: a reload never reaches it, vLLM's own ``reload_weights`` included.
_DERIVED_BUFFERS = (("conv_weights", "conv1d.weight"),)


def derived_buffers(model: torch.nn.Module,
                    where: Mapping[str, tuple[str, str, tuple[int, ...], torch.dtype]]
                    ) -> list[tuple[torch.Tensor, str]]:
    """(live buffer, vLLM parameter name) for each derived buffer of the model
    (:data:`_DERIVED_BUFFERS`): a commit writes the parameter's logical tensor into it."""
    out = []
    for mname, module in model.named_modules():
        for attr, rel in _DERIVED_BUFFERS:
            buffer = module._buffers.get(attr)
            name = f"{mname}.{rel}" if mname else rel
            if buffer is not None and name in where and math.prod(where[name][2]) == \
                    buffer.numel():
                out.append((buffer, name))
    return out


def tied_aliases(model: torch.nn.Module, where: Mapping[str, tuple[str, str, Any, Any]]
                 ) -> dict[str, list[tuple[str, str]]]:
    """vLLM param name -> the other (module, attribute) places holding the same tensor
    (a tied LM head holds ``embed_tokens.weight``): a commit reloads those too, so the
    LM head's own processed copy (its CPU GEMM) follows."""
    by_id = {}
    for name, (mname, attr, _, _) in where.items():
        module = model.get_submodule(mname) if mname else model
        p = module._parameters.get(attr)
        if p is not None:
            by_id[id(p)] = name
    out: dict[str, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            name = by_id.get(id(p)) if p is not None else None
            if name is not None and (mname, attr) != where[name][:2]:
                out.setdefault(name, []).append((mname, attr))
    return out


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


class _QuietLayers(logging.Filter):
    """Drop layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    hold no parameters (RotaryEmbedding's cos/sin cache buffer): a refit carries
    weights only, and every parameter it covers is checked at init."""

    def __init__(self, model: torch.nn.Module, kept: set[str] = frozenset()) -> None:
        super().__init__()
        with_params = {type(m).__name__ for m in model.modules()
                       if any(True for _ in m.parameters(recurse=False))}
        # layers whose parameters a refit writes in place take no part in the reload
        owners = {n.rpartition(".")[0] for n in kept}
        live = {type(m).__name__ for n, m in model.named_modules() if n in owners}
        live -= {type(m).__name__ for n, m in model.named_modules()
                 if n not in owners and any(True for _ in m.parameters(recurse=False))}
        self.names = ({type(m).__name__ for m in model.modules()} - with_params) | live

    def filter(self, record: logging.LogRecord) -> bool:
        return not ("Failed to load weights" in str(record.msg) and record.args
                    and record.args[0] in self.names)


@contextlib.contextmanager
def _quiet(model: torch.nn.Module, kept: set[str] = frozenset()) -> Any:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    f = _QuietLayers(model, kept)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def _reset_moe_kernels(model: torch.nn.Module) -> int:
    """vLLM 0.32 CPU MoE: force the first-load processing (pad + prepack) on reload."""
    n = 0
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and hasattr(qm, "moe_kernel"):
            qm.moe_kernel = None
            n += 1
    return n


def _snapshot_loaders(params: Any) -> list[tuple[torch.Tensor, dict]]:
    keys = ("weight_loader", "_weight_loader")
    return [(p, {k: p.__dict__[k] for k in keys if k in p.__dict__}) for p in params]


def _restore_loaders(saved: Sequence[tuple[torch.Tensor, dict]]) -> None:
    """Put loaders back: on vLLM's stored metadata parameters (which a commit routes
    through a copy loader) and on tensors layerwise reload never moves to meta (biases),
    which it leaves with the unwrapped loader."""
    for p, attrs in reversed(saved):
        for k in ("weight_loader", "_weight_loader"):
            if k in attrs:
                p.__dict__[k] = attrs[k]
            elif k in p.__dict__ and k == "weight_loader":
                del p.__dict__[k]


#: Modules whose forward reads the parameter as loaded even though they carry a
#: ``quant_method`` (an embedding lookup reads ``weight``; on CPU the method also packs a
#: GEMM copy of it, which only an LM head made of the embedding would use: see
#: :func:`kept_live`).
_READS_WEIGHT_AS_LOADED = ("VocabParallelEmbedding",)


def has_own_lm_head(model: torch.nn.Module) -> bool:
    """Whether the model computes its logits with an LM head module of its own
    (``ParallelLMHead``). Where it has none, the logits come from the embedding module
    itself (vLLM's Gemma 2, Gemma 3n, Command R: ``logits_processor(embed_tokens, ...)``),
    through the GEMM copy vLLM CPU packs of the embedding after loading: writing the
    embedding in place would leave that copy, and so the logits, at the old weights."""
    return any(type(m).__name__ == "ParallelLMHead" for m in model.modules())


def kept_live(model: torch.nn.Module, where: Mapping[str, tuple[str, str, tuple[int, ...],
                                                                torch.dtype]],
              aliases: Mapping[str, Any] | None = None) -> set[str]:
    """The vLLM parameters a refit writes in place: those whose live tensor is their
    checkpoint (logical) form and whose module reads them as they are, decided from what
    vLLM holds now. A module is kept live whole or not at all (vLLM reloads layer by
    layer): norms, embeddings, Mamba ``A`` / ``D`` / ``dt_bias``; not linear layers that
    vLLM repacks (CPU GEMMs), MoE experts it pads, a tensor other modules hold too
    (``aliases``, see :func:`tied_aliases`: an embedding tied to an LM head), or an
    embedding that is itself the LM head (no ``ParallelLMHead``, see
    :func:`has_own_lm_head`: its packed GEMM copy makes the logits)."""
    aliases = aliases or {}
    embedding_read_as_loaded = has_own_lm_head(model)
    by_module: dict[str, list[str]] = {}
    for name, (mname, _, _, _) in where.items():
        by_module.setdefault(mname, []).append(name)
    live: set[str] = set()
    for mname, names in by_module.items():
        module = model.get_submodule(mname) if mname else model
        if _reads_as_loaded(module, embedding_read_as_loaded) and all(
                _holds_logical(getattr(module, where[n][1]), where[n]) and
                n not in aliases for n in names):
            live.update(names)
    return live


def _reads_as_loaded(module: torch.nn.Module, embedding: bool = True) -> bool:
    kind = type(module).__name__
    return getattr(module, "quant_method", None) is None or (
        embedding and kind in _READS_WEIGHT_AS_LOADED)


def packed_gemm_mismatches(model: torch.nn.Module, reference: Mapping[str, torch.Tensor],
                           aliases: Mapping[str, Sequence[tuple[str, str]]]) -> list[str]:
    """The modules whose packed CPU GEMM (``cpu_linear``, the copy vLLM CPU makes of a
    linear's or an embedding's weight after loading; the embedding's serves an LM head
    made of it) computes otherwise than a GEMM packed fresh from ``reference`` (vLLM
    name -> this rank's logical tensor): both applied to one fixed input, bit for bit,
    with vLLM's own packing routine, so the same kernel runs on both sides."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    holders = {}
    for name in reference:
        mname, _, attr = name.rpartition(".")
        if attr == "weight":
            holders[mname] = name
            for alias, a_attr in aliases.get(name, ()):
                if a_attr == "weight":
                    holders[alias] = name
    # an embedding beside an LM head of its own is only looked up: its copy is never read
    unread = _READS_WEIGHT_AS_LOADED if has_own_lm_head(model) else ()
    bad, gen = [], torch.Generator().manual_seed(0)
    for mname, name in sorted(holders.items()):
        module = model.get_submodule(mname) if mname else model
        ref = reference[name]
        if (not callable(getattr(module, "cpu_linear", None)) or ref.dim() != 2
                or type(module).__name__ in unread):
            continue
        fresh = torch.nn.Module()
        fresh.weight = torch.nn.Parameter(ref.clone(), requires_grad=False)
        dispatch_cpu_unquantized_gemm(fresh, remove_weight=False)
        x = torch.randn(3, ref.shape[1], generator=gen).to(ref.dtype)
        if not torch.equal(module.cpu_linear(x, module.weight, None),
                           fresh.cpu_linear(x, fresh.weight, None)):
            bad.append(f"{mname} (packed GEMM)")
    return bad


def _holds_logical(live: Any, entry: tuple[str, str, tuple[int, ...], torch.dtype]) -> bool:
    return (isinstance(live, torch.Tensor) and not live.is_meta
            and tuple(live.shape) == entry[2] and live.dtype == entry[3])


def _rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _return_freed_memory() -> None:
    """Give the heap memory freed by a commit back to the system (glibc ``malloc_trim``):
    each reloaded layer's repacked copy replaces the old one, and glibc keeps the freed
    chunks resident otherwise. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the current resident memory (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class ReshardState:
    """One vLLM rank's side of the refit: mapping, where each parameter is written,
    logical buffers for the repacked ones, receiver, commit."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, *, rank: int,
                 inference_size: int, host: str, port: int, trainer_size: int,
                 staging: str = "shadow", budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 hf_tensors: Mapping[str, Sequence[int]] | None = None,
                 timeout_s: float = 120.0, unchecked_family_ok: bool = False) -> None:
        from reshard.refit.receiver import RefitReceiver

        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ReshardError("the reshard vLLM integration covers tensor parallelism only "
                               f"(pipeline_parallel_size={pc.pipeline_parallel_size})")
        self.model, self.vllm_config, self.rank = model, vllm_config, rank
        self.inference_size = inference_size
        self.where = logical_params(model)
        self.aliases = tied_aliases(model, self.where)
        self.derived = derived_buffers(model, self.where)
        self.staging = staging
        self.unchecked_family_ok = unchecked_family_ok
        self.stale = False  # a refit with staging="none" failed midway: weights may be torn
        self.last: dict[str, Any] = {}
        self._version = 0
        self.measured_peak = _reset_peak_rss()
        self.rss_at_init = _rss_bytes()
        common = dict(host=host, port=port, rank=rank, trainer_size=trainer_size,
                      inference_size=inference_size, staging=staging,
                      budget_bytes=budget_bytes, timeout=timedelta(seconds=timeout_s))
        if hf_tensors is not None:  # told by the caller
            targets, layouts, direct = self._prepare(hf_tensors)
            self.receiver = RefitReceiver(targets, layouts, direct=direct, **common)
        else:  # learnt from the trainer at the meeting
            self.receiver = RefitReceiver(prepare=self._prepare_from, **common)
        self.created = time.monotonic()

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
        self.buffers = {n: b for n, b in self.mapping.allocate(self.rank).items()
                        if n not in self.live_names}
        self.expected_bytes = self.mapping.shard_bytes(self.rank)
        slots = self.mapping.slots(self.rank)
        targets = self.mapping.targets(self.rank, {**self.buffers, **self.live})
        return targets, self.mapping.layouts, [h for h, s in slots.items()
                                                if s.param in self.buffers]

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
        buffer_bytes, shadow_bytes = nbytes(self.buffers.values()), self.receiver.shadow_bytes
        return {"rank": self.rank, "version": self.version, "stale": self.stale,
                "staging": self.staging, "tensors": len(self.mapping.tensors),
                "params": len(self.mapping.param_shapes),
                "in_place": sorted(self.live_names), "buffered": sorted(self.buffers),
                "weight_bytes": nbytes(self.live.values()) + nbytes(self.buffers.values()),
                "in_place_bytes": nbytes(self.live.values()),
                "expected_bytes": self.expected_bytes, "buffer_bytes": buffer_bytes,
                "shadow_bytes": shadow_bytes, "extra_bytes": buffer_bytes + shadow_bytes,
                "commit_transient_bytes": self._commit_transient(),
                "rss_extra": _rss_bytes() - self.rss_at_init}

    def _commit_transient(self) -> int:
        """Bytes a commit holds beyond the buffers, at its peak, as vLLM 0.32 CPU's
        layerwise reload behaves (traced per reloaded parameter with ``VmRSS``, see
        ``benchmarks/engine_memory.py``):

        * a repacked linear (GEMM) keeps its old packed kernel until the reload ends, so
          every such buffer is held twice;
        * MoE experts lose their old prepacked copy when the commit resets the expert
          kernel (:func:`_reset_moe_kernels`), and each expert module, when reloaded,
          holds its materialized weights and the new prepacked copy at once;
        * layers are reloaded one at a time: on top of the kept kernels, the largest
          layer's materialized weights (times two for experts)."""
        kept, per_module = 0, {}
        for name, buf in self.buffers.items():
            mname, n = self.where[name][0], buf.numel() * buf.element_size()
            module = self.model.get_submodule(mname) if mname else self.model
            experts = hasattr(getattr(module, "quant_method", None), "moe_kernel")
            kept += 0 if experts else n
            per_module[mname] = per_module.get(mname, 0) + (2 * n if experts else n)
        return kept + max(per_module.values(), default=0)

    def status(self) -> dict[str, Any]:
        """The live version and whether the weights may be torn (``stale``: a refit with
        ``staging="none"`` failed midway; the next complete refit clears it)."""
        return {"rank": self.rank, "version": self.version, "stale": self.stale}

    def receive(self) -> dict[str, Any]:
        """RefitReceiver.refit() into the logical buffers; raises on failure (nothing
        committed, ``last`` says why)."""
        t0 = time.perf_counter()
        self.measured_peak = _reset_peak_rss()  # this refit's own peak
        rss_start = _rss_bytes() - self.rss_at_init
        try:
            stats = self.receiver.refit()
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
                     "peak_rss_extra_receive": self._peak_extra()}
        return self.last

    @torch.no_grad()
    def commit(self) -> float:
        """Copy the logical buffers into the live model through vLLM's layerwise reload."""
        import vllm.model_executor.model_loader.reload.layerwise as lw
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        model = self.model
        if not self.buffers:  # every parameter was written in place
            return self._committed(t0)
        saved = _snapshot_loaders(model.parameters())
        with set_current_vllm_config(self.vllm_config), _quiet(model, self.live_names):
            _reset_moe_kernels(model)
            lw.initialize_layerwise_reload(model)
            try:
                for name, buf in self.buffers.items():
                    # a tied tensor is loaded into every module holding it, so that each
                    # reprocesses its own copy (the LM head's GEMM)
                    for mname, attr in [self.where[name][:2], *self.aliases.get(name, [])]:
                        module = model.get_submodule(mname) if mname else model
                        param = getattr(module, attr)
                        # the restored parameter is vLLM's stored metadata object: its
                        # loader is put back afterwards, or later reloads would inherit ours
                        saved += _snapshot_loaders([param])
                        how = self.mapping.converts.get(name)
                        param.weight_loader = _converting_loader(how) if how else _copy_into
                        param.weight_loader = lw.make_online_process_loader(module, attr)
                        param.weight_loader(param, buf)
            finally:
                lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
                _restore_loaders(saved)
            for buffer, name in self.derived:  # views a reload leaves on the old storage
                if name in self.buffers:
                    buffer.copy_(self.buffers[name].view(buffer.shape))
        return self._committed(t0)

    def _committed(self, t0: float) -> float:
        _return_freed_memory()
        seconds = time.perf_counter() - t0
        self._version, self.stale = self.receiver.version, False
        self.last.update(committed=True, commit_seconds=seconds, stale=False,
                         peak_rss_extra=self._peak_extra(),
                         rss_extra=_rss_bytes() - self.rss_at_init)
        return seconds

    def _peak_extra(self) -> int | None:
        """Peak resident memory since the refit state began, beyond what it was then."""
        return _rss_bytes("VmHWM") - self.rss_at_init if self.measured_peak else None

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

        saved = _snapshot_loaders(model.parameters())
        original = lw._layerwise_process
        lw._layerwise_process = capture
        try:
            with set_current_vllm_config(self.vllm_config), _quiet(model):
                lw.initialize_layerwise_reload(model)
                try:
                    model.load_weights(iter(state_dict.items()))
                finally:
                    lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            lw._layerwise_process = original
            _restore_loaders(saved)
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
        self.receiver.comm.close()


def _same(held: torch.Tensor, logical: torch.Tensor) -> bool:
    """Bit for bit the same values; where vLLM holds a tensor in another dtype than its
    checkpoint form (a bias it turned to float32), the same through an exact cast both
    ways."""
    if held.dtype == logical.dtype:
        return torch.equal(held, logical)
    return (torch.equal(held, logical.to(held.dtype)) and
            torch.equal(held.to(logical.dtype), logical))


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
                     budget_bytes: int = DEFAULT_BUDGET_BYTES,
                     hf_tensors: Mapping[str, Sequence[int]] | None = None,
                     timeout_s: float = 120.0, unchecked_family_ok: bool = False
                     ) -> dict[str, Any]:
        """Meet the trainer at ``host:port`` (collective with its RefitSender ranks):
        learn its tensor names and shapes there, build the mapping, the logical buffers
        and the receiver; returns sizes. ``hf_tensors`` (HF name -> global shape) is
        only needed to map before the meeting; an unknown tensor on either side is a
        ``MappingError`` on every rank of both jobs, nothing moved; so is a model family
        whose refit was never checked end to end (``vllm_mapping.CHECKED_FAMILIES``)
        unless ``unchecked_family_ok`` (or ``RESHARD_UNCHECKED_FAMILIES=1``)."""
        self._reshard_drop()
        size = inference_size or self.vllm_config.parallel_config.world_size
        self._reshard = ReshardState(
            self.model_runner.get_model(), self.vllm_config, rank=self.rank,
            inference_size=size, host=host, port=port, trainer_size=trainer_size,
            staging=staging, budget_bytes=budget_bytes, hf_tensors=hf_tensors,
            timeout_s=timeout_s, unchecked_family_ok=unchecked_family_ok)
        return self._reshard.info()

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
        """{rank, version, stale}: ``stale`` while the live weights may be torn (a refit
        with ``staging="none"`` failed midway), until a complete refit lands."""
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
    trainer_size: int
    staging: str = "shadow"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    hf_tensors: dict[str, list[int]] | None = None
    timeout_s: float = 120.0
    #: refit a model family whose refit was never checked end to end (see
    #: ``reshard.integrations.vllm_mapping.check_family``)
    unchecked_family_ok: bool = False


@dataclass
class ReshardUpdateInfo(WeightTransferUpdateInfo):
    """Nothing per round: the plan was agreed at init, the version comes from the
    trainer."""


class ReshardWeightTransferEngine(WeightTransferEngine[ReshardInitInfo, ReshardUpdateInfo]):
    """``weight_transfer_config={"backend": "reshard"}``: init meets the trainer,
    ``update_weights`` receives, ``finish_weight_update`` commits."""

    init_info_cls = ReshardInitInfo
    update_info_cls = ReshardUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.state: ReshardState | None = None
        self.received: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: ReshardInitInfo) -> None:
        if self.state is not None:
            self.state.close()
            self.state = None
        pc = self.parallel_config
        self.state = ReshardState(
            self.model, self.vllm_config, rank=pc.rank, inference_size=pc.world_size,
            host=init_info.master_address, port=init_info.master_port,
            trainer_size=init_info.trainer_size, staging=init_info.staging,
            budget_bytes=init_info.budget_bytes, hf_tensors=init_info.hf_tensors,
            timeout_s=init_info.timeout_s, unchecked_family_ok=init_info.unchecked_family_ok)

    def start_weight_update(self) -> None:
        self.received = None

    def update_weights(self, update_info: Any) -> None:
        # the base class synchronizes the accelerator, which raises on CPU-only torch
        self.receive_weights(self.parse_update_info(update_info or {}))

    def receive_weights(self, update_info: ReshardUpdateInfo) -> None:
        """Receive into the logical buffers. A failed refit does not raise (see
        :func:`_reported`: raising on every worker desynchronizes vLLM 0.32's RPC
        replies); it is logged, ``reshard_last`` reports it, and the following
        ``finish_weight_update`` commits nothing, so the previous version stays live."""
        if self.state is None:
            raise ReshardError("init_weight_transfer_engine first")
        try:
            self.received = self.state.receive()
        except Exception:
            log.exception("reshard: refit failed; the previous weights stay live")
            self.received = None

    def finish_weight_update(self) -> None:
        if self.state is not None and self.received is not None:
            self.state.commit()
        self.received = None

    def shutdown(self) -> None:
        if self.state is not None:
            self.state.close()
            self.state = None


def register() -> None:
    """Register the ``reshard`` backend in vLLM's weight-transfer engine registry."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # already registered in this process
        WeightTransferEngineFactory.register_engine(BACKEND, ReshardWeightTransferEngine)


register()
