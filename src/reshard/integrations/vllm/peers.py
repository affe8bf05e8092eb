"""Peer bootstrap for vLLM engines (:class:`Peers`, mixed into
:class:`~reshard.integrations.vllm.state.ReshardState`): a new engine fills itself from
live engines' committed weights (:mod:`reshard.refit.bootstrap`), then meets the
trainer for the next refit, keeping the version; a live engine lends its weights in a
thread of each worker while it goes on serving.

What a live rank lends: its receiver's targets, the tensors a refit writes and a commit
makes live -- the logical buffers of the parameters vLLM repacks (which keep the last
version whole after its commit) and the live parameters written in place -- in the
layouts it receives its refits in. Only a rank whose last refit (or bootstrap) committed
lends (:attr:`whole`); one whose last refit failed, or is under way, says why and the
bootstrap fails on every rank before a byte moves. A refit waits for a lending in flight
before it writes those tensors; a lending asked for during a refit refuses.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from reshard.defaults import NO_VERSION
from reshard.errors import ReshardError

__all__ = ["Peers"]


class Peers:
    """Lending and bootstrapping, on one vLLM rank's refit state. Reads what the state
    set up (``receiver``, ``mapping``, ``rank``, ``inference_size``, ``version``,
    ``forwards``, ``budget_bytes``, ``timeout_s``, ``token``)."""

    whole = False  # the receiver's targets hold the live version whole (lendable)
    lending: threading.Thread | None = None
    lent: dict[str, Any] | None = None  # the last lending's outcome

    def _init_peers(self) -> None:
        self._guard = threading.Lock()

    @property
    def bootstrapped(self) -> bool:
        """Filled by a bootstrap and not yet met by a trainer."""
        from reshard.refit.bootstrap import BootstrapReceiver

        return isinstance(self.receiver, BootstrapReceiver)

    def _bootstrap_receiver(self, host: str, port: int, num_peers: int) -> Any:
        """A receiver whose meeting is with ``num_peers`` live engines (this rank 0
        hosts it at ``host:port``), its targets made from their tensors' names and
        shapes as from a trainer's."""
        from reshard.refit.bootstrap import BootstrapReceiver

        timeout = timedelta(seconds=self.timeout_s)
        return BootstrapReceiver(prepare=self._prepare_from, host=host, port=port,
                                 rank=self.rank, tp_size=self.inference_size,
                                 num_peers=num_peers, staging=self.staging,
                                 budget_bytes=self.budget_bytes, timeout=timeout,
                                 refit_timeout=timeout, token=self.token)

    def meet_trainer(self, host: str, port: int, trainer_size: int,
                     token: str | None = None) -> dict[str, Any]:
        """After a bootstrap: meet the trainer (collective with its ``RefitSender``
        ranks) with the targets the bootstrap filled; the live weights and the version
        are kept, and the next refit is this engine's like any other's."""
        from reshard.refit.receiver import RefitReceiver

        old = self.receiver
        self.token = token if token is not None else self.token
        self.receiver = RefitReceiver(old.targets, self.mapping.layouts, direct=old.direct,
                                      **self._receiver_options(host, port, trainer_size))
        self.receiver.version = self._version
        return self.info()

    def join_fleet(self, host: str, port: int, replica: str, fanout: str = "auto",
                   token: str | None = None) -> dict[str, Any]:
        """After a bootstrap: ask to join the trainer's fleet (its ``ElasticSender``
        ranks) as replica ``replica``, with the targets the bootstrap filled; the live
        weights and the version are kept (a sparse refit may build on them), and the
        fleet's next refit is this engine's like any other replica's."""
        old = self.receiver
        self.token = token if token is not None else self.token
        self.receiver = self._replica_receiver(host, port, replica, fanout,
                                               targets=old.targets,
                                               layouts=self.mapping.layouts,
                                               direct=old.direct)
        self.receiver.version = self._version
        return self.info()

    def lend(self, host: str, port: int, peer: int) -> dict[str, Any]:
        """Lend this rank's committed weights, as peer ``peer``, to a new engine
        bootstrapping at ``host:port``: in a thread, beside the serving engine; returns
        at once. :meth:`lent` waits for the outcome."""
        with self._guard:
            if self.lending is not None and self.lending.is_alive():
                raise ReshardError(f"rank {self.rank} lends already; call reshard_lent first")
            problem = None if self.whole else (
                f"rank {self.rank}'s last refit did not commit (version {self.version} "
                "live, its refit buffers not whole)" if self.version != NO_VERSION else
                f"rank {self.rank} holds no refitted version yet")
            self.lent = None
            self.lending = threading.Thread(target=self._lend, name="reshard-lend",
                                            args=(host, port, peer, problem), daemon=True)
            self.lending.start()
        return {"ok": True, "rank": self.rank, "version": self.version, "problem": problem}

    def _lend(self, host: str, port: int, peer: int, problem: str | None) -> None:
        from reshard.refit.bootstrap import BootstrapSender

        t0, forwards = time.perf_counter(), self.forwards
        timeout = timedelta(seconds=self.timeout_s)
        try:
            sender = BootstrapSender(self.receiver.targets, self.mapping.layouts, host=host,
                                     port=port, peer=peer, rank=self.rank,
                                     tp_size=self.inference_size, version=self.version,
                                     problem=problem, budget_bytes=self.budget_bytes,
                                     timeout=timeout, refit_timeout=timeout,
                                     token=self.token)
            stats = sender.send()
            self.lent = {"ok": True, "rank": self.rank, "version": stats.version,
                         "bytes_sent": stats.bytes_sent, "rounds": stats.rounds}
        except Exception as e:  # noqa: BLE001 - reported by lent()
            self.lent = {"ok": False, "rank": self.rank, "error": f"{type(e).__name__}: {e}"}
        self.lent.update(seconds=time.perf_counter() - t0,
                         forwards_during=self.forwards - forwards)

    def wait_lent(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The outcome of the last lending, once it ended: {ok, rank, version,
        bytes_sent, rounds, seconds, forwards_during (the engine's forward passes
        meanwhile), error?}."""
        thread = self.lending
        if thread is None:
            raise ReshardError(f"rank {self.rank} was never asked to lend")
        wait = self.timeout_s * 2 if timeout_s is None else timeout_s
        thread.join(wait)
        if thread.is_alive():
            raise ReshardError(f"rank {self.rank} still lends after {wait:.0f} s")
        return dict(self.lent or {})

    def _stop_lending(self) -> None:
        """Before a refit writes the lent tensors: wait for a lending in flight (bounded
        by its own deadlines), then mark them no longer whole."""
        while True:
            with self._guard:
                thread = self.lending
                if thread is None or not thread.is_alive():
                    self.whole = False
                    return
            thread.join(self.timeout_s * 2)
            if thread.is_alive():
                raise ReshardError(f"rank {self.rank}: a bootstrap still reads the weights "
                                   "a refit would write; nothing was moved")
