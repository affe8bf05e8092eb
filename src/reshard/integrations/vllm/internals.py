"""The helpers that reach into vLLM's internals, below its public API: the metadata its
layerwise reload records (each parameter's checkpoint-format shape), what it holds live
(tied tensors, buffers derived from a parameter, which parameters its modules read as
loaded), its weight loaders (saved and put back around a reload), its log of layerwise
reload, and the engine core's reply queues. These follow vLLM 0.32's internals, which is
why the vLLM version is pinned; :mod:`reshard.integrations.vllm.state` builds a refit on
them, with vLLM CPU's kernels (:mod:`reshard.integrations.vllm.kernels`) and the
process's memory (:mod:`reshard.integrations.vllm.memory`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reshard.errors import MappingError

__all__ = [
    "REPLY_RECHECK_S", "derived_buffers", "has_own_lm_head", "kept_live",
    "logical_params", "quiet_reload", "refuse_unreloadable", "replies_asleep",
    "reset_moe_kernels", "restore_loaders", "snapshot_loaders", "tied_aliases",
    "unread_packed_copies",
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



def unread_packed_copies(model: torch.nn.Module) -> tuple[str, ...]:
    """The module kinds whose packed GEMM copy (vLLM CPU's, made after loading) nothing
    reads: an embedding beside an LM head of its own is only looked up (see
    :func:`has_own_lm_head`); where the embedding is the LM head, none."""
    return _READS_WEIGHT_AS_LOADED if has_own_lm_head(model) else ()

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


def _holds_logical(live: Any, entry: tuple[str, str, tuple[int, ...], torch.dtype]) -> bool:
    return (isinstance(live, torch.Tensor) and not live.is_meta
            and tuple(live.shape) == entry[2] and live.dtype == entry[3])


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
