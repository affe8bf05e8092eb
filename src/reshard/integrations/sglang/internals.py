"""Every reach into SGLang's internals (sglang 0.5.23), here and nowhere else.

SGLang offers one door into its scheduler processes that carries a caller's request to
every tensor-parallel rank and answers with success and a message, inside its own
weight-update session: ``update_weights_from_tensor`` (HTTP ``/update_weights_from_tensor``
or ``Engine.update_weights_from_tensor``), which the scheduler runs between two forward
passes, then records the request's ``weight_version`` and flushes the radix cache, only
when the update succeeded. reshard goes through it with ``load_format="reshard"``:

* in the scheduler processes, the reshard plugin (entry point ``sglang.srt.plugins``,
  loaded by SGLang in each of its processes) puts an *around* hook on the model runner's
  ``WeightUpdater.update_weights_from_tensor`` (:func:`install_hook`): a request whose
  ``load_format`` is ``"reshard"`` carries a command in its one tensor's name, and the
  hook answers it (meet the trainer, receive and commit a version, report) instead of
  loading tensors; its success is the command's on every rank, its message the ranks'
  outcomes as JSON (gathered over SGLang's tensor-parallel CPU group);
* on the caller's side, :func:`command_payload` serializes that request as SGLang's own
  clients do (one payload per rank), and :func:`engine_call` sends it into a Python
  ``Engine`` with a weight version, which ``Engine.update_weights_from_tensor`` does not
  take.

Nothing else of SGLang is touched: the weights the hook writes are the model's
parameters, read with ``named_parameters``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from reshard.errors import ConfigError

__all__ = ["COMMAND_PREFIX", "HOOK_TARGET", "LOAD_FORMAT", "RankContext", "amx_packed",
           "command_payload", "engine_call", "install_hook", "parse_command"]

log = logging.getLogger("reshard.sglang")

#: the ``load_format`` that routes an ``update_weights_from_tensor`` request to reshard
LOAD_FORMAT = "reshard"
#: the command travels as the name of the request's one (empty) tensor
COMMAND_PREFIX = "reshard:"
#: the method the plugin wraps, in every scheduler process
HOOK_TARGET = ("sglang.srt.model_executor.model_runner_components.weight_updater."
               "WeightUpdater.update_weights_from_tensor")


class RankContext:
    """What one scheduler process's rank knows of its engine, read from the model
    runner's weight updater: the model, this rank, the tensor-parallel size, the HF
    config and the model dtype."""

    def __init__(self, updater: Any) -> None:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        self.model = updater.get_model()
        self.rank, self.tp_size = updater.tp_rank, parallel.tp_size
        self.hf_config = updater.model_config.hf_config
        self.dtype = updater.model_config.dtype
        self._group = parallel.tp_group.cpu_group

    def gather(self, outcome: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's outcome, in rank order (collective over SGLang's TP CPU group:
        every rank answers the same request at the same point of its loop)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.tp_size
        dist.all_gather_object(out, outcome, group=self._group)
        return out


def amx_packed(model: Any) -> list[str]:
    """The modules whose weights SGLang repacked for Intel AMX after loading (its
    ``use_intel_amx_backend`` flag: CPUs with AMX and ``sgl_kernel``'s packing op): their
    parameters no longer hold the checkpoint's layout, and SGLang cannot restore it."""
    return [name for name, module in model.named_modules()
            if getattr(module, "use_intel_amx_backend", False)]


def parse_command(named_tensors: Any) -> dict[str, Any]:
    """The command a reshard request carries: ``{"op": ..., ...}`` from the name of its
    one tensor (``reshard:{json}``)."""
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(COMMAND_PREFIX):
        raise ConfigError(f"a {LOAD_FORMAT!r} request carries one tensor named "
                         f"{COMMAND_PREFIX}{{json}}, got {[n for n, _ in named_tensors][:3]}")
    return json.loads(named_tensors[0][0][len(COMMAND_PREFIX):])


Handler = Callable[[RankContext, dict[str, Any]], dict[str, Any]]


def install_hook(handler: Handler) -> None:
    """Wrap the model runner's ``update_weights_from_tensor`` so that a request with
    ``load_format="reshard"`` runs ``handler(context, command)`` on each rank, which
    returns this rank's outcome (``{"ok": bool, ...}``) and never raises (an exception
    in a scheduler kills the server). The request succeeds when every rank's did."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def around(original: Callable, updater: Any, named_tensors: Any,
               load_format: str | None = None, **kwargs: Any) -> tuple[bool, str]:
        if load_format != LOAD_FORMAT:
            return original(updater, named_tensors, load_format=load_format, **kwargs)
        context = RankContext(updater)
        try:
            outcome = handler(context, parse_command(named_tensors))
        except Exception as e:  # the handler's own guard failed: report, never raise
            log.exception("reshard: the command failed on rank %s", context.rank)
            outcome = {"ok": False, "rank": context.rank, "error": f"{type(e).__name__}: {e}"}
        outcomes = context.gather(outcome)
        return all(o.get("ok") for o in outcomes), json.dumps(outcomes)

    HookRegistry.register(HOOK_TARGET, around, HookType.AROUND)


def command_payload(command: dict[str, Any], tp_size: int, *, as_text: bool) -> list[Any]:
    """The ``serialized_named_tensors`` of a reshard request, one payload per rank, as
    SGLang's ``MultiprocessingSerializer`` makes them (torch's ``ForkingPickler``; base64
    text for HTTP with ``as_text``, bytes for a Python ``Engine``), without importing
    SGLang in the caller: ``[("reshard:{json}", empty tensor)]``. An empty tensor pickles
    without shared memory."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 (registers torch's reductions)

    buf = io.BytesIO()
    ForkingPickler(buf).dump([(COMMAND_PREFIX + json.dumps(command), torch.empty(0))])
    data = buf.getvalue()
    return [base64.b64encode(data).decode() if as_text else data] * tp_size


def engine_call(engine: Any, command: dict[str, Any], *, weight_version: str | None = None,
                flush_cache: bool = False) -> tuple[bool, str]:
    """Send a reshard request into a Python ``sglang.Engine`` (inside a weight-update
    session the caller opened): ``(success, message)``."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
    from sglang.srt.runtime_context import get_parallel

    obj = UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=command_payload(command, get_parallel().tp_size,
                                                 as_text=False),
        load_format=LOAD_FORMAT, flush_cache=flush_cache, weight_version=weight_version)
    return engine.loop.run_until_complete(
        engine.tokenizer_manager.update_weights_from_tensor(obj, None))
