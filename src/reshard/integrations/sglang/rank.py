"""One SGLang tensor-parallel rank's side of a refit (:class:`SglangRank`), and the
commands the scheduler's hook hands it (:func:`handle`).

How a refit lands on one rank:

1. At the meeting (``init``), the trainer's HF names and shapes are mapped onto this
   rank's parameters (:func:`reshard.integrations.sglang.mapping.hf_to_sglang`); the
   receiver's targets are views into the live parameters (a row range of the fused
   ``qkv_proj`` / ``gate_up_proj``, the real rows of the padded vocabulary, ...), each
   with its layout over the SGLang ranks, so this rank receives only its own bytes.
2. ``refit``: :class:`reshard.refit.RefitReceiver` writes a shadow of those targets;
   it returns only once every rank of both jobs has its part, and only then is the
   shadow copied over the live parameters (between two forward passes: the scheduler
   runs the command in its loop). A refit that fails anywhere (a trainer rank lost,
   raising) leaves the live parameters and the version as they were, on every rank.
3. SGLang then records the request's weight version and flushes its radix cache, only
   when every rank's command succeeded (:mod:`reshard.integrations.sglang.internals`).

Memory beyond the weights: the shadow (a copy of what the rank receives, padding rows
aside) and the transfer's staging budget.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import torch

from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import MappingError, ReshardError
from reshard.integrations.sglang.mapping import hf_to_sglang
from reshard.refit.sparse import sparse_summary

__all__ = ["SglangRank", "handle"]

log = logging.getLogger("reshard.sglang")


class SglangRank:
    """One SGLang rank's refit state: the mapping of the trainer's tensors, the
    receiver (shadow staging), the live version (the trainer's step of the last
    commit, ``NO_VERSION`` (-1) before any: the weights SGLang loaded)."""

    def __init__(self, context: Any, *, host: str, port: int, trainer_size: int,
                 budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES, timeout_s: float = 120.0,
                 token: str | None = None, unchecked_family_ok: bool = False) -> None:
        from reshard.refit.receiver import RefitReceiver

        self.context, self.rank = context, context.rank
        self.unchecked_family_ok = unchecked_family_ok
        self.params = {n: p.data for n, p in context.model.named_parameters()}
        self.last: dict[str, Any] = {}
        self.receiver = RefitReceiver(
            prepare=self._prepare, host=host, port=port, rank=self.rank,
            trainer_size=trainer_size, inference_size=context.tp_size, staging="shadow",
            budget_bytes=budget_bytes, timeout=timedelta(seconds=timeout_s), token=token)

    def _prepare(self, trainer: dict[str, Any]) -> tuple[dict, dict, list[str]]:
        """At the meeting: the trainer's layouts -> (targets, layouts, direct)."""
        from reshard.integrations.sglang.internals import amx_packed

        packed = amx_packed(self.context.model)
        if packed:
            raise MappingError(f"SGLang repacked the weights of {len(packed)} modules for "
                               f"Intel AMX (first: {packed[0]!r}); a refit writes the "
                               "checkpoint's layout and cannot land there: not modelled")
        shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.mapping = hf_to_sglang(self.context.hf_config, self.context.tp_size, shapes,
                                    {n: lay.shape for n, lay in trainer.items()},
                                    self.context.dtype, self.unchecked_family_ok)
        odd = [n for n, d in self.mapping.param_dtypes.items()
               if self.params[n].dtype != getattr(torch, d)]
        if odd:
            raise ReshardError(f"SGLang parameters not in the dtype the mapping gives them "
                               f"({self.mapping.dtype}): {odd[:8]}")
        self.expected_bytes = self.mapping.shard_bytes(self.rank)
        return self.mapping.targets(self.rank, self.params), self.mapping.layouts, []

    @property
    def version(self) -> int:
        return self.receiver.version

    def info(self) -> dict[str, Any]:
        return {"ok": True, "rank": self.rank, "version": self.version,
                "tensors": len(self.mapping.tensors), "params": len(self.mapping.param_shapes),
                "expected_bytes": self.expected_bytes,
                "shadow_bytes": self.receiver.shadow_bytes}

    def refit(self, expect: int | None = None) -> dict[str, Any]:
        """Receive the next version into the shadow, then make it live; ``expect``: the
        version the caller is committing (another is received but not made live)."""
        t0 = time.perf_counter()
        try:
            stats = self.receiver.refit(go_live=False)
            if expect is not None and stats.version != expect:
                self.receiver.received = None
                raise ReshardError(f"the trainer sent version {stats.version}, the caller "
                                   f"commits {expect}: not made live")
            t1 = time.perf_counter()
            self.receiver.go_live()
        except Exception as e:
            self.last = {"ok": False, "rank": self.rank, "version": self.version,
                         "error": f"{type(e).__name__}: {e}",
                         "seconds": time.perf_counter() - t0}
            return self.last
        self.last = {"ok": True, "rank": self.rank, "version": self.version,
                     "bytes_received": stats.bytes_received,
                     "expected_bytes": self.expected_bytes, "receive_seconds": t1 - t0,
                     "commit_seconds": time.perf_counter() - t1,
                     "seconds": time.perf_counter() - t0,
                     # a sparse refit (the trainer's sparse="auto", the default, after the
                     # first): what changed, the wire bytes against the dense ones
                     "sparse": sparse_summary(stats.sparse)}
        return self.last

    def reconnect(self, host: str, port: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """Meet the trainer again after a lost rank; live weights and version kept."""
        self.receiver.reconnect(host, port, timeout=timedelta(seconds=timeout_s))
        return self.info()

    def close(self) -> None:
        self.receiver.comm.close()


#: this scheduler process's refit state (one rank per process)
_STATE: SglangRank | None = None


def handle(context: Any, command: dict[str, Any]) -> dict[str, Any]:
    """Run one command on this rank; returns its outcome, never raises:
    ``init`` (meet the trainer), ``refit``, ``info``, ``last``, ``reconnect``, ``close``."""
    global _STATE
    op = command.get("op")
    try:
        if op == "init":
            if _STATE is not None:
                _STATE.close()
                _STATE = None
            args = {k: v for k, v in command.items() if k != "op"}
            _STATE = SglangRank(context, **args)
            return _STATE.info()
        if _STATE is None:
            raise ReshardError(f"{op!r} before init: meet the trainer first")
        if op == "refit":
            return _STATE.refit(command.get("version"))
        if op == "info":
            return _STATE.info()
        if op == "last":
            return {"ok": True, **_STATE.last, "last_ok": _STATE.last.get("ok")}
        if op == "reconnect":
            return _STATE.reconnect(command["host"], command["port"],
                                    command.get("timeout_s", 120.0))
        if op == "close":
            _STATE.close()
            _STATE = None
            return {"ok": True, "rank": context.rank}
        raise ReshardError(f"unknown command {op!r}")
    except Exception as e:
        log.exception("reshard: %s failed on rank %s", op, context.rank)
        return {"ok": False, "rank": context.rank, "error": f"{type(e).__name__}: {e}"}
