"""The caller's side of an SGLang refit: :class:`SglangRefit`, one object for a live
SGLang server (its URL) or an in-process ``sglang.Engine``.

Each command is one SGLang weight-update session: ``begin_weight_update``, an
``update_weights_from_tensor`` request with ``load_format="reshard"`` that carries the
command to every rank (:mod:`reshard.integrations.sglang.internals`), then
``end_weight_update``. A refit's request also carries the weight version, which SGLang
records, and ``flush_cache``, so that its radix cache holds no KV of the old weights;
both only when every rank committed. SGLang holds new requests back while the
request runs, and runs it on each rank between two forward passes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import ReshardError, TransferError

__all__ = ["SglangRefit"]


class SglangRefit:
    """Refit an SGLang engine from a reshard trainer (``RefitSender``, as for vLLM).

    ``target``: the server's base URL (``"http://127.0.0.1:30000"``) or a Python
    ``sglang.Engine``. Every method is collective over the engine's ranks and returns
    their outcomes in rank order; :meth:`init` and :meth:`refit` run while the trainer's
    ranks build their ``RefitSender`` / call ``sender.refit(step)``."""

    def __init__(self, target: Any, timeout_s: float = 600.0) -> None:
        self.target, self.timeout_s = target, timeout_s
        self.is_http = isinstance(target, str)
        self.outcomes: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ commands
    def init(self, host: str, port: int, trainer_size: int, *, token: str | None = None,
             timeout_s: float = 120.0, budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
             unchecked_family_ok: bool = False) -> list[dict[str, Any]]:
        """Meet the trainer at ``host:port``: its tensors are mapped onto each rank's
        parameters (a ``MappingError`` on every rank of both jobs when one side has a
        tensor the other cannot place, nothing moved); returns per-rank sizes."""
        return self._command({"op": "init", "host": host, "port": port,
                              "trainer_size": trainer_size, "token": token,
                              "timeout_s": timeout_s, "budget_bytes": budget_bytes,
                              "unchecked_family_ok": unchecked_family_ok})

    def refit(self, version: int) -> list[dict[str, Any]]:
        """Receive the trainer's ``sender.refit(version)`` and make it live on every
        rank, the radix cache flushed and SGLang's weight version set to ``version``.
        A failed refit raises :class:`TransferError` and leaves the previous version
        serving, whole, on every rank (the outcomes stay in :attr:`outcomes`)."""
        return self._command({"op": "refit", "version": version},
                             weight_version=str(version), flush_cache=True,
                             error=TransferError)

    def info(self) -> list[dict[str, Any]]:
        """Per rank: version, tensors, parameters, expected bytes, shadow bytes."""
        return self._command({"op": "info"})

    def reconnect(self, host: str, port: int, timeout_s: float = 120.0) -> list[dict]:
        """Meet the trainer again at a new ``host:port`` after a lost rank (its
        ``RefitSender.reconnect`` or fresh senders); the live weights are kept."""
        return self._command({"op": "reconnect", "host": host, "port": port,
                              "timeout_s": timeout_s})

    def close(self) -> None:
        """Leave the trainer's group (the engine keeps serving its version)."""
        self._command({"op": "close"})

    def weight_version(self) -> str | None:
        """The weight version SGLang reports (``/model_info``)."""
        if self.is_http:
            return self._get("/model_info").get("weight_version")
        return self.target.tokenizer_manager.config_value("weight_version")

    # ------------------------------------------------------------------ transport
    def _command(self, command: dict[str, Any], *, weight_version: str | None = None,
                 flush_cache: bool = False, error: Callable[[str], Exception] = ReshardError
                 ) -> list[dict[str, Any]]:
        self._session("begin_weight_update")
        try:
            ok, message = self._send(command, weight_version, flush_cache)
        finally:
            self._session("end_weight_update")
        try:
            self.outcomes = json.JSONDecoder().raw_decode(message)[0]
        except ValueError:  # refused before any rank ran it
            raise ReshardError(f"SGLang refused the {command['op']!r} request: {message}"
                               ) from None
        if not ok:
            failed = [o for o in self.outcomes if not o.get("ok")]
            raise error(f"{command['op']} failed on SGLang rank(s) "
                        f"{[o.get('rank') for o in failed]}: {failed[0].get('error')}")
        return self.outcomes

    def _send(self, command: dict[str, Any], weight_version: str | None,
              flush_cache: bool) -> tuple[bool, str]:
        from reshard.integrations.sglang import internals

        if not self.is_http:
            return internals.engine_call(self.target, command, weight_version=weight_version,
                                         flush_cache=flush_cache)
        tp = self._get("/server_info")["tp_size"]
        body = {"serialized_named_tensors": internals.command_payload(command, tp,
                                                                      as_text=True),
                "load_format": internals.LOAD_FORMAT, "flush_cache": flush_cache,
                "weight_version": weight_version}
        reply = self._post("/update_weights_from_tensor", body)
        return bool(reply.get("success")), str(reply.get("message"))

    def _session(self, which: str) -> None:
        if self.is_http:
            reply = self._post(f"/{which}", {})
            ok, message = reply.get("success"), reply.get("message")
        else:
            ok, message = getattr(self.target, which)()
        if not ok:
            raise ReshardError(f"SGLang {which}: {message}")

    def _get(self, path: str) -> dict[str, Any]:
        import requests

        reply = requests.get(self.target.rstrip("/") + path, timeout=self.timeout_s)
        reply.raise_for_status()
        return reply.json()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import requests

        return requests.post(self.target.rstrip("/") + path, json=body,
                             timeout=self.timeout_s).json()
