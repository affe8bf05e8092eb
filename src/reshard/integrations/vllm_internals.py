"""The helpers that reach into vLLM's internals, below its public API: the metadata its
layerwise reload records (each parameter's checkpoint-format shape), what it holds live
(tied tensors, buffers derived from a parameter, which parameters its modules read as
loaded), its weight loaders (saved and put back around a reload), its log of layerwise
reload, its CPU kernels (MoE prepacking, packed GEMMs), and the process's resident
memory. These follow vLLM 0.32's internals, which is why the vLLM version is pinned;
:mod:`reshard.integrations.vllm_state` builds a refit on them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES
from reshard.integrations.vllm_mapping import MappingError

__all__ = [
    "HeapBound", "REPLY_RECHECK_S", "cpu_experts", "derived_buffers", "direct_experts",
    "direct_modules", "has_own_lm_head", "kept_live", "logical_params",
    "packed_expert_mismatches", "packed_gemm_mismatches", "params_held", "prepack_experts",
    "process_in_place", "quiet_reload", "refuse_unreloadable", "replies_asleep",
    "reset_moe_kernels", "reset_peak_rss", "restore_loaders", "return_freed_memory",
    "rss_bytes", "snapshot_loaders", "stand_in", "take_over", "tied_aliases",
    "unread_lm_head_weight",
]


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
def quiet_reload(model: torch.nn.Module, kept: set[str] = frozenset()) -> Any:
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    f = _QuietLayers(model, kept)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


def reset_moe_kernels(model: torch.nn.Module,
                      only: Sequence[torch.nn.Module] | None = None) -> int:
    """vLLM 0.32 CPU MoE: force the first-load processing (pad + prepack) on reload, for
    every module of ``model`` or ``only`` those given (the ones a reload processes: an
    expert module whose kernel is reset and not reloaded would lose its kernel)."""
    n = 0
    for module in model.modules() if only is None else only:
        qm = getattr(module, "quant_method", None)
        if qm is not None and hasattr(qm, "moe_kernel"):
            qm.moe_kernel = None
            n += 1
    return n


def snapshot_loaders(params: Any) -> list[tuple[torch.Tensor, dict]]:
    keys = ("weight_loader", "_weight_loader")
    return [(p, {k: p.__dict__[k] for k in keys if k in p.__dict__}) for p in params]


def restore_loaders(saved: Sequence[tuple[torch.Tensor, dict]]) -> None:
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


#: vLLM's unquantized methods, whose processing after loading on CPU only packs a GEMM
#: copy of a 2-D weight (``dispatch_cpu_unquantized_gemm``): linear layers, LM heads and
#: embeddings. A commit runs it on the module as it stands (:func:`process_in_place`).
_PACKS_ONLY = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def direct_modules(model: torch.nn.Module, where: Mapping[str, tuple[str, str, tuple[int, ...],
                                                                     torch.dtype]],
                   names: Sequence[str], excluded: set[str] = frozenset()
                   ) -> dict[str, list[str]]:
    """Module name -> its vLLM parameters among ``names``, for the modules a commit
    processes in place (:func:`process_in_place`) rather than through layerwise reload:
    on vLLM CPU, modules of an unquantized method (:data:`_PACKS_ONLY`) whose parameters
    are a 2-D ``weight`` and maybe a ``bias``, none of them in ``excluded``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(where[name][0], []).append(name)
    out = {}
    for mname, ns in by_module.items():
        module = model.get_submodule(mname) if mname else model
        attrs = {where[n][1] for n in ns}
        if (type(getattr(module, "quant_method", None)).__name__ in _PACKS_ONLY
                and "weight" in attrs and attrs <= {"weight", "bias"}
                and len(where[f"{mname}.weight" if mname else "weight"][2]) == 2
                and params_held(module) == attrs and not set(ns) & excluded):
            out[mname] = ns
    return out


def params_held(module: torch.nn.Module) -> set[str]:
    """The names of the parameters ``module`` holds itself (not those set to None)."""
    return {k for k, p in module._parameters.items() if p is not None}


def unread_lm_head_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The weight of an LM head (``ParallelLMHead``) that nothing reads once vLLM CPU
    packed its GEMM, or None. vLLM CPU keeps an LM head's weight after packing (its
    processing, shared with embeddings, which look tokens up in it: ``remove_weight=False``),
    yet the logits come from the packed copy alone (``cpu_linear``) on the paths where vLLM
    drops a linear layer's weight after making the same copy (oneDNN, the small-GEMM
    kernel, zentorch prepacked). Not on the others: no packed GEMM, the plain
    ``F.linear`` fallback, or a GEMM whose closure holds a tensor on the weight's storage
    (zentorch unprepacked) or a module. Such a weight is storage the engine holds and never
    reads: a refit may receive the LM head into it, with no buffer of its own."""
    if type(module).__name__ != "ParallelLMHead":
        return None
    weight = module._parameters.get("weight")
    gemm = module.__dict__.get("cpu_linear")
    if weight is None or not weight.numel() or gemm is None:
        return None
    if gemm is torch.nn.functional.linear or not callable(gemm):
        return None
    storage = weight.untyped_storage().data_ptr()
    captured = [c.cell_contents for c in getattr(gemm, "__closure__", None) or ()]
    captured += list(getattr(gemm, "__defaults__", None) or ())
    if not captured:  # nothing of its own to compute from: it must read the weight
        return None
    for value in captured:
        if isinstance(value, torch.nn.Module) or (
                isinstance(value, torch.Tensor) and value.numel()
                and value.untyped_storage().data_ptr() == storage):
            return None
    return weight.data


def process_in_place(module: torch.nn.Module, logical: Mapping[str, torch.Tensor],
                     heap: HeapBound | None = None) -> None:
    """Give ``module`` new weights and rerun its processing after loading, as layerwise
    reload does but without moving the layer to meta and back: a parameter vLLM keeps
    whole (an embedding, a bias) is overwritten in place; one it packed away (left empty)
    is lent the logical tensor, which the processing packs (a oneDNN or small-GEMM copy
    of its own) and drops; then the module's own parameters are put back, as layerwise
    reload's ``_copy_and_restore_kernel_tensors`` does. The old packed copy is freed
    before the new one is made, so a commit holds no second copy of anything; with a
    ``heap``, its pages are handed back in between where it is large
    (:meth:`HeapBound.make_room`)."""
    kernel = {k: p for k, p in module._parameters.items() if p is not None}
    for attr, tensor in logical.items():
        live = kernel[attr]
        if live.numel() == tensor.numel():
            if live.data_ptr() != tensor.data_ptr():  # not received into its own storage
                live.data.copy_(tensor.view(live.shape))
        else:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    # the old packed copy goes first (its closure holds it): a commit then holds no
    # second copy of any module (the engine does not run between the two)
    if module.__dict__.pop("cpu_linear", None) is not None and heap is not None:
        heap.make_room(sum(t.numel() * t.element_size() for t in logical.values()))
    module.quant_method.process_weights_after_loading(module)
    for attr, live in kernel.items():
        now = module._parameters.get(attr)
        if now is not live and now is not None and now.numel():
            if now.numel() != live.numel():
                raise MappingError(f"{type(module).__name__}.{attr}: vLLM kept a tensor of "
                                   f"{now.numel()} elements after processing, where it held "
                                   f"{live.numel()}")
            live.data.copy_(now)
        module._parameters[attr] = live


#: The parameters of vLLM CPU's unquantized MoE experts a commit prepacks straight into
#: their live storage (:func:`prepack_experts`).
_EXPERT_WEIGHTS = ("w13_weight", "w2_weight")


def cpu_experts(module: torch.nn.Module) -> Any | None:
    """The grouped-GEMM experts of vLLM CPU's unquantized MoE behind ``module`` (a
    ``CPUUnquantizedExperts``: its ``isa`` names the prepacked layout), or None where
    the module is not such an expert layer, or its experts run through zentorch."""
    qm = getattr(module, "quant_method", None)
    if type(qm).__name__ != "UnquantizedFusedMoEMethod":
        return None
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
    except ImportError:
        return None
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch",
                                                                   False):
        return None
    return experts


def direct_experts(model: torch.nn.Module, where: Mapping[str, tuple[str, str, tuple[int, ...],
                                                                     torch.dtype]],
                   names: Sequence[str], excluded: set[str] = frozenset(),
                   aliases: Mapping[str, Sequence[tuple[str, str]]] | None = None
                   ) -> dict[str, list[str]]:
    """Module name -> its vLLM parameters among ``names``, for the MoE expert modules a
    commit prepacks in place (:func:`prepack_experts`) rather than through layerwise
    reload: vLLM CPU's unquantized experts (:func:`cpu_experts`) whose parameters are
    all among ``names``, none in ``excluded``: ``w13_weight`` and ``w2_weight``, and
    maybe others that vLLM keeps as loaded, but no expert biases (the kernel pads
    those); a parameter it shares with a module listed first (DeepSeek's router
    ``e_score_correction_bias``, which the gate owns: its other holders are in
    ``aliases``, see :func:`tied_aliases`) is committed with that module."""
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(where[name][0], []).append(name)
    held_elsewhere = {h for holders in (aliases or {}).values() for h in holders}
    out = {}
    for mname, ns in by_module.items():
        module = model.get_submodule(mname) if mname else model
        attrs = {where[n][1]: n for n in ns}
        held = {a for a in params_held(module) if (mname, a) not in held_elsewhere}
        kept_whole = all(tuple(getattr(module, a).shape) == where[n][2]
                         for a, n in attrs.items() if a not in _EXPERT_WEIGHTS)
        if (cpu_experts(module) is not None and set(attrs) == held >= set(_EXPERT_WEIGHTS)
                and not held & {"w13_bias", "w2_bias"} and kept_whole
                and not set(ns) & excluded):
            out[mname] = ns
    return out


def _padded_experts(attr: str, logical: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """An expert weight in the shape vLLM CPU keeps it: its intermediate dimension
    zero-padded to the kernel's alignment as ``CPUUnquantizedExperts`` pads it (each of
    w13's gate and up halves; w2's last dimension), or ``logical`` itself if unpadded."""
    if tuple(logical.shape) == tuple(shape):
        return logical
    e, rows, cols = logical.shape
    if attr == "w13_weight" and (e, cols) == (shape[0], shape[2]) and shape[1] > rows:
        i, p = rows // 2, shape[1] // 2
        out = logical.new_zeros(shape)
        out[:, :i], out[:, p:p + i] = logical[:, :i], logical[:, i:]
        return out
    if attr == "w2_weight" and (e, rows) == tuple(shape[:2]) and shape[2] > cols:
        out = logical.new_zeros(shape)
        out[:, :, :cols] = logical
        return out
    raise MappingError(f"MoE {attr}: vLLM holds {tuple(shape)}, which is no padding of "
                       f"the logical {tuple(logical.shape)}")


def prepack_experts(module: torch.nn.Module, logical: Mapping[str, torch.Tensor]) -> None:
    """Write new expert weights into a vLLM CPU MoE layer (:func:`cpu_experts`) as its
    processing after loading leaves them: padded, then prepacked by vLLM's own kernel
    straight from the logical tensor into the live parameter's storage (the prepacked
    layout has the padded shape); any other parameter (see :func:`direct_experts`) is
    copied in place. Nothing of the layer is replaced, so the MoE kernel,
    the parameters' metadata and every view of them stay valid; a commit holds no copy
    of the experts beyond the logical buffers (a padded one, where the kernel pads)."""
    experts = cpu_experts(module)
    if experts is None:
        raise MappingError(f"{type(module).__name__}: not vLLM CPU's unquantized MoE")
    sources = {}  # every check before anything is written: the layer is never torn
    for attr in _EXPERT_WEIGHTS:
        live = module._parameters[attr]
        source = _padded_experts(attr, logical[attr], live.shape).contiguous()
        if source.dtype != live.dtype or not live.is_contiguous():
            raise MappingError(f"{type(module).__name__}.{attr}: live {live.dtype} "
                               f"{tuple(live.shape)}, new {source.dtype}")
        sources[attr] = source, live
    for attr, tensor in logical.items():  # the others, kept as loaded
        if attr not in _EXPERT_WEIGHTS:
            module._parameters[attr].data.copy_(tensor)
    for source, live in sources.values():
        torch.ops._C.prepack_moe_weight(source, live.data, experts.isa)


def packed_expert_mismatches(model: torch.nn.Module, reference: Mapping[str, torch.Tensor],
                             modules: Sequence[str]) -> list[str]:
    """The expert modules among ``modules`` whose live prepacked weights differ, bit for
    bit, from what vLLM's own prepacking makes of ``reference`` (vLLM name -> this
    rank's logical tensor)."""
    bad = []
    for mname in modules:
        module = model.get_submodule(mname) if mname else model
        experts = cpu_experts(module)
        for attr in _EXPERT_WEIGHTS:
            live, name = module._parameters[attr], f"{mname}.{attr}" if mname else attr
            ref = reference.get(name)
            if experts is None or ref is None:
                bad.append(f"{name} (prepacked experts)")
                continue
            fresh = torch.empty_like(live)
            torch.ops._C.prepack_moe_weight(
                _padded_experts(attr, ref.to(live.dtype), live.shape).contiguous(), fresh,
                experts.isa)
            if not torch.equal(fresh.view(torch.uint8), live.data.view(torch.uint8)):
                bad.append(f"{name} (prepacked experts)")
    return bad


def stand_in(module: torch.nn.Module, unread: Sequence[torch.Tensor] = ()) -> torch.nn.Module:
    """A copy of ``module`` that :func:`process_in_place` may process while the engine
    runs the module itself: its own attribute, parameter and buffer dicts (so a packed
    copy or a parameter vLLM sets lands on the copy alone) and its own clone of every
    parameter vLLM keeps whole (a bias, an LM head's weight) but those on the storage of
    a tensor in ``unread`` (which the engine never reads: :func:`unread_lm_head_weight`);
    the packed-away (empty) ones and everything else shared, read only."""
    import copy

    shared = {t.untyped_storage().data_ptr() for t in unread}
    other = copy.copy(module)
    other._parameters = {k: p if p is None or not p.numel()
                         or p.untyped_storage().data_ptr() in shared else
                         torch.nn.Parameter(p.data.clone(), requires_grad=False)
                         for k, p in module._parameters.items()}
    other._buffers = dict(module._buffers)
    return other


def take_over(module: torch.nn.Module, processed: torch.nn.Module,
              written: set[int] | None = None) -> None:
    """Make what :func:`process_in_place` made on a :func:`stand_in` of ``module`` live
    in ``module``: the attributes it set (the packed GEMM closure, ``cpu_linear``) by
    reference, the parameters vLLM keeps whole by copy into their storage (any view of
    them, and vLLM's metadata, stay valid) -- except storages in ``written`` (a tied
    weight another holder's hand-over wrote), to which the ones written are added."""
    written = set() if written is None else written
    internal = ("_parameters", "_buffers", "_modules")
    for key, value in processed.__dict__.items():
        if key not in internal and module.__dict__.get(key) is not value:
            module.__dict__[key] = value
    for attr, p in processed._parameters.items():
        live = module._parameters.get(attr)
        if (p is not None and p.numel() and live is not None and live is not p
                and live.data_ptr() not in written):
            live.data.copy_(p.data)
            written.add(live.data_ptr())


def packed_gemm_mismatches(model: torch.nn.Module, reference: Mapping[str, torch.Tensor],
                           aliases: Mapping[str, Sequence[tuple[str, str]]]) -> list[str]:
    """The modules whose packed CPU GEMM (``cpu_linear``, the copy vLLM CPU makes of a
    linear's or an embedding's weight after loading; the embedding's serves an LM head
    made of it) computes otherwise than a GEMM packed fresh from ``reference`` (vLLM
    name -> this rank's logical tensor): both applied to one fixed input, bit for bit,
    with vLLM's own packing routine, so the same kernel runs on both sides (where vLLM
    skips the packing, ``_cpu_skip_gemm_dispatch``, a plain GEMM of the weight on both)."""
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
        if getattr(module, "_cpu_skip_gemm_dispatch", False):
            # vLLM packs no copy of it (MLA's kv_b_proj): a plain GEMM of the live weight
            fresh.cpu_linear = torch.nn.functional.linear
        else:
            dispatch_cpu_unquantized_gemm(fresh, remove_weight=False)
        x = torch.randn(3, ref.shape[1], generator=gen).to(ref.dtype)
        if not torch.equal(module.cpu_linear(x, module.weight, None),
                           fresh.cpu_linear(x, fresh.weight, None)):
            bad.append(f"{mname} (packed GEMM)")
    return bad


def _holds_logical(live: Any, entry: tuple[str, str, tuple[int, ...], torch.dtype]) -> bool:
    return (isinstance(live, torch.Tensor) and not live.is_meta
            and tuple(live.shape) == entry[2] and live.dtype == entry[3])


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``, 1.6 ms
    here, more than the trim), or None where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def return_freed_memory() -> None:
    """Give the heap memory freed by a commit back to the system (glibc ``malloc_trim``):
    each reloaded layer's repacked copy replaces the old one, and glibc keeps the freed
    chunks resident otherwise. A no-op where there is no glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class HeapBound:
    """Keeps a commit's resident memory within ``slack`` bytes of where it began: call
    :meth:`check` after each module; it hands the freed heap back
    (:func:`return_freed_memory`) whenever the process has grown by more.

    A commit frees each module's old packed GEMM copy and makes a new one of the same
    size, but glibc does not always serve the new one from the chunk just freed: it may
    take a free chunk whose pages an earlier trim gave back (faulting them in again)
    and keep the old one's pages resident. Traced per module on vLLM CPU (Qwen2.5-1.5B
    shapes, 12 layers, TP2), an engine rank grew by 42-110 MB per commit that way, one
    module's copy at a time, until the closing trim. A trim costs a few milliseconds,
    so it runs only when the slack is spent, and (:meth:`make_room`) between the free of
    a module's old copy and the making of its new one where that copy is larger than
    the slack: the new copy then cannot land beside the old one's resident pages, so a
    commit's peak stays within the slack of where it began (8 MiB: 2 trims a layer at
    Qwen2.5-1.5B shapes, gate_up and down; ``benchmarks/refit_real.py`` gives the peak
    per phase). Pages handed back are faulted in again by later copies, which costs time
    (:data:`reshard.defaults.DEFAULT_COMMIT_HEAP_SLACK_BYTES`); ``slack=None`` never
    trims, trading the heap's fragmentation held resident for a faster commit."""

    def __init__(self, slack: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES) -> None:
        self.slack, self.base, self.trims = slack, rss_bytes(), 0

    def check(self) -> None:
        """After a module: trim if the process grew by more than the slack (never with
        ``slack=None``: every freed page stays for the next copies to reuse)."""
        if self.slack is not None and rss_bytes() - self.base > self.slack:
            self._trim()

    def make_room(self, nbytes: int) -> None:
        """A packed copy of about ``nbytes`` was just freed and its successor is next:
        trim first if it is larger than the slack."""
        if self.slack is not None and nbytes > self.slack:
            self._trim()

    def _trim(self) -> None:
        return_freed_memory()
        self.trims += 1


def reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the current resident memory (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


#: While a worker call runs, the engine core looks at its reply queues at least this often
#: (seconds) when no notification came: the cost of a notification vLLM's writer dropped.
REPLY_RECHECK_S = 0.01


@contextlib.contextmanager
def replies_asleep(executor: Any, recheck_s: float = REPLY_RECHECK_S) -> Any:
    """While a worker call runs, the engine core waits for its replies asleep, waking at
    least every ``recheck_s`` to look at the queue.

    vLLM 0.32's multiprocess executor reads each worker's reply from a shared-memory
    queue whose reader spins (``sched_yield``) for a second after its last read before it
    sleeps on the writer's notification (``SpinCondition.busy_loop_s``). Through a refit
    that spinning is a busy process beside the workers and the trainer ranks: on a host
    with fewer cores than processes it takes CPU from the refit itself.

    The notification alone is not enough: the writer publishes it on a zmq PUB socket
    with a high-water mark of one message, and PUB drops a message silently while the
    previous one still counts against that mark (until the writer's thread takes its I/O
    thread's word that it left). A reply that follows the previous one within that
    window -- ``outcome`` right after ``finish_weight_update``, the worker spinning and
    answering in a millisecond -- is written without a notification; vLLM's reader finds
    it only because it spins after each read, and otherwise at its 5 s recheck
    (``SHM_READER_RECHECK_INTERVAL_MS``). So the reader here does not spin, and its idle
    waits are cut to ``recheck_s`` (a poll every 10 ms: no CPU to speak of); a dropped
    notification costs at most that. Executors without such queues (Ray, uniprocess)
    are left as they are."""
    conditions = [c for mq in getattr(executor, "response_mqs", None) or ()
                  if (c := getattr(mq, "_spin_condition", None)) is not None
                  and getattr(c, "is_reader", False) and hasattr(c, "busy_loop_s")
                  and callable(getattr(c, "wait", None))]
    saved = [(c.busy_loop_s, c.__dict__.get("wait")) for c in conditions]
    cap_ms = max(1, round(recheck_s * 1000))
    for c in conditions:
        c.busy_loop_s = 0.0
        c.wait = _capped_wait(c.wait, cap_ms)
    try:
        yield len(conditions)
    finally:
        for c, (busy, wait) in zip(conditions, saved, strict=True):
            c.busy_loop_s = busy
            if wait is None:
                del c.wait
            else:
                c.wait = wait


def _capped_wait(wait: Callable[..., None], cap_ms: int) -> Callable[..., None]:
    """``SpinCondition.wait`` with its idle timeout cut to ``cap_ms`` (its caller, vLLM's
    ``acquire_read``, looks at the queue again after every return)."""

    def capped(timeout_ms: int | None = None) -> None:
        wait(timeout_ms=cap_ms if timeout_ms is None else min(timeout_ms, cap_ms))

    return capped
