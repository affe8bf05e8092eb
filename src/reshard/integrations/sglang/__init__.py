"""Refit a running SGLang engine (a server or a Python ``Engine``) from a reshard
trainer: every SGLang tensor-parallel rank receives only its own bytes, fused
``qkv_proj`` / ``gate_up_proj`` and the padded vocabulary included, into a shadow made
live on every rank at once; SGLang records the weight version and flushes its radix
cache at each commit. The trainer is the same as for vLLM (``hf.refit_params`` ->
``RefitSender``)::

    refit = SglangRefit("http://127.0.0.1:30000")   # or SglangRefit(sglang.Engine(...))
    refit.init(host, port, trainer_size=2)          # while the trainer's RefitSenders meet
    refit.refit(step)                               # while the trainer calls sender.refit(step)

SGLang loads reshard's plugin in its processes (the ``sglang.srt.plugins`` entry point),
which answers the requests ``SglangRefit`` sends through SGLang's own
``update_weights_from_tensor`` with ``load_format="reshard"``.

Where it lives: :mod:`~reshard.integrations.sglang.engine` the caller's side,
:mod:`~reshard.integrations.sglang.rank` one rank's side (mapping, receiver, shadow,
commit), :mod:`~reshard.integrations.sglang.mapping` the HF -> SGLang mapping (pure
Python, vLLM's rules), :mod:`~reshard.integrations.sglang.internals` every reach into
SGLang, :mod:`~reshard.integrations.sglang.plugin` the plugin SGLang loads.

Limits: tensor parallelism only; SGLang 0.5.23 (its internals are reached, so the version
is pinned); unquantized weights held as loaded (no AMX repacking: CPU hosts without AMX,
GPUs).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reshard.integrations.sglang.engine import SglangRefit
    from reshard.integrations.sglang.mapping import SGLANG_CHECKED_FAMILIES, hf_to_sglang

_LAZY = {
    "SglangRefit": "reshard.integrations.sglang.engine",
    "SGLANG_CHECKED_FAMILIES": "reshard.integrations.sglang.mapping",
    "hf_to_sglang": "reshard.integrations.sglang.mapping",
}

__all__ = ["SGLANG_CHECKED_FAMILIES", "SglangRefit", "hf_to_sglang"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
