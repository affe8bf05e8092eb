"""The trainer side of a refit: :class:`RefitSender` (see :mod:`reshard.refit.side`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import ConfigError
from reshard.gate import resolve_key
from reshard.layout import Layout
from reshard.refit.rendezvous import meet
from reshard.refit.side import RefitStats, Side, layouts_of, local_tensors
from reshard.refit.sparse import DEFAULT_SPARSE, SPARSE_MODES

__all__ = ["RefitSender"]


class RefitSender(Side):
    """The trainer side. ``params``: name -> DTensor (or local tensor with ``layouts``)."""

    def __init__(self, params: Mapping[str, Any], *, host: str, port: int, rank: int,
                 trainer_size: int, inference_size: int,
                 layouts: Mapping[str, Layout] | None = None,
                 policy: Mapping[str, str] | None = None,
                 budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=120),
                 progress: bool | Callable[[int, int], None] = False,
                 refit_timeout: timedelta | None = None,
                 connect_timeout: timedelta | None = None,
                 checksum: bool | str | None = None, token: str | bytes | None = None,
                 listen: str | None = None, sparse: str = DEFAULT_SPARSE) -> None:
        """``timeout`` bounds the meeting and each wait; ``connect_timeout`` (if given)
        bounds the meeting instead; ``refit_timeout`` bounds each whole refit (every wait
        ends by one deadline); ``checksum`` (``True``/``"sum"``, ``"crc32"`` or
        ``"hmac"``; by default ``"hmac"`` with a token, else off) checks every message,
        on both sides alike. ``token`` (else ``$RESHARD_TOKEN``): only ranks holding the
        same one meet; ``listen``: where rank 0's store listens (default ``host``); see
        ``docs/security.md``. ``sparse``: after the first refit, send only the values
        that changed in the engine's dtype, keeping one engine-dtype copy of what this
        rank sends (``"auto"``, the default: dense for a while after a refit where sparse
        did not pay, and no copy where it would take more than half the memory free;
        ``"on"``; ``"off"``: every refit dense, no copy); see ``docs/sparse.md``."""
        if sparse not in SPARSE_MODES:
            raise ConfigError(f"sparse must be one of {SPARSE_MODES}, got {sparse!r}")
        self.params = params
        if layouts is None:
            _, layouts = layouts_of(params)
        meet_args = dict(side="trainer", side_rank=rank, trainer_size=trainer_size,
                         inference_size=inference_size, layouts=layouts, backend=backend,
                         timeout=connect_timeout or timeout, token=resolve_key(token),
                         listen=listen)
        super().__init__(meet(host, port, **meet_args), policy=policy, budget_bytes=budget_bytes,
                         progress=progress, refit_timeout=refit_timeout, checksum=checksum,
                         meet_args=meet_args, sparse=sparse)
        self.explicit_layouts = layouts is not None

    def refit(self, version: int, *, dense: bool = False) -> RefitStats:
        """Send the current parameters as weight version ``version``: the trainer's step
        (``>= 0``), newer than every rank's current version (a fresh receiver holds
        none, :data:`~reshard.defaults.NO_VERSION`, so step 0 goes in).
        ``dense``: this refit dense whatever the ``sparse`` mode (the copy is kept)."""
        src = local_tensors(self.params)
        self.sparse_refits.force_dense = dense
        stats = self._move(src, {}, version)
        self.version = stats.version
        return stats

    def reconnect(self, host: str, port: int, *, inference_size: int | None = None,
                  timeout: timedelta | None = None) -> None:
        """Meet the inference side again at ``host:port`` (a new address: the old group
        is dropped) after a lost worker; the plan is rebuilt for ``inference_size`` (the
        same as before by default). Collective with every receiver's :meth:`reconnect`
        or a fresh :class:`RefitReceiver`. ``timeout`` bounds the meeting."""
        self._remeet(host, port, rank=None, trainer_size=None, inference_size=inference_size,
                     timeout=timeout)
