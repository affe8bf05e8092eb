"""vLLM CPU's kernels, as a commit meets them: the packed GEMM copies of linear layers,
LM heads and embeddings (processed in place, on a stand-in beside the serving engine,
checked against a fresh packing) and the prepacked MoE experts (written straight into
their live storage, checked likewise). They follow vLLM 0.32's CPU kernels, which is why
the vLLM version is pinned; :mod:`reshard.integrations.vllm.commit` drives them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from reshard.errors import MappingError
from reshard.integrations.vllm.internals import unread_packed_copies

if TYPE_CHECKING:
    from reshard.integrations.vllm.memory import HeapBound

__all__ = [
    "cpu_experts", "direct_experts", "direct_modules", "packed_expert_mismatches",
    "packed_gemm_mismatches", "params_held", "prepack_experts", "process_in_place",
    "stand_in", "take_over", "unread_lm_head_weight",
]


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
    unread = unread_packed_copies(model)
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
