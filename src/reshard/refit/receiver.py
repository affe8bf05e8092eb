"""The inference side of a refit: :class:`RefitReceiver` (see :mod:`reshard.refit.side`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from datetime import timedelta

import torch

from reshard.defaults import DEFAULT_REFIT_BUDGET_BYTES
from reshard.errors import ConfigError
from reshard.gate import resolve_key
from reshard.layout import Layout
from reshard.quant.blocks import BlockFormat
from reshard.refit.rendezvous import meet
from reshard.refit.side import RefitStats, Side

__all__ = ["RefitReceiver", "Staged", "check_targets_or_prepare"]


#: ``prepare(trainer_layouts) -> (targets, layouts, direct)``: a receiver's tensors made
#: once the trainer's tensor names, shapes and dtypes are known (at the meeting).
Prepare = Callable[[Mapping[str, Layout]],
                   tuple[Mapping[str, torch.Tensor], Mapping[str, Layout], Collection[str]]]


def check_targets_or_prepare(targets, layouts, prepare: Prepare | None) -> None:
    """A receiver is given its targets and layouts, or ``prepare`` (not both)."""
    if (prepare is None) == (targets is None or layouts is None) or (
            prepare is not None and (targets is not None or layouts is not None)):
        raise ConfigError("give targets and layouts, or prepare= (not both)")


class Staged:
    """A receiver's targets and their staging (:class:`RefitReceiver`,
    :class:`reshard.refit.elastic.ElasticReceiver`): a refit writes the shadow, and
    :meth:`_go_live` copies it over the live targets; ``direct`` targets are the
    caller's own staging (written straight, never shadowed, committed by the caller)."""

    staging: str = "shadow"
    direct: frozenset[str] = frozenset()  # targets the caller stages itself (no shadow)
    received: int | None = None  # a version received whole, not live yet (go_live)
    targets: dict[str, torch.Tensor]
    shadow: dict[str, torch.Tensor]

    def _take(self, targets: Mapping[str, torch.Tensor], direct: Collection[str]) -> None:
        unknown = sorted(set(direct) - set(targets))
        if unknown:
            raise ConfigError(f"direct names targets that do not exist: {unknown[:5]}")
        self.targets, self.direct = dict(targets), frozenset(direct)

    def _new_shadow(self) -> dict[str, torch.Tensor]:
        """What the transfer writes: a clone of each live target with ``staging="shadow"``
        (not empty: regions no layout covers, such as vocabulary padding, keep their live
        values when it is copied over), the target itself otherwise."""
        if self.staging == "none":
            return self.targets
        return {n: t if n in self.direct else t.detach().clone()
                for n, t in self.targets.items()}

    @property
    def shadow_bytes(self) -> int:
        """Extra memory the never-torn guarantee costs on this rank."""
        if self.staging == "none":
            return 0
        return sum(t.numel() * t.element_size() for n, t in self.shadow.items()
                   if n not in self.direct)

    def _go_live(self) -> None:
        if self.staging == "shadow":
            with torch.no_grad():
                for name, live in self.targets.items():
                    if name not in self.direct:
                        live.copy_(self.shadow[name])

    def _received_version(self) -> int:
        """The version received whole and not live yet, now taken (``go_live``)."""
        if self.received is None:
            raise ConfigError("go_live: no version was received whole since the last one "
                              "went live")
        version, self.received = self.received, None
        return version


class RefitReceiver(Staged, Side):
    """The inference side. ``targets``: name -> local tensor to write (views into fused
    parameters are fine); ``layouts``: name -> Layout over the inference ranks. Or,
    instead of both, ``prepare``: called at the meeting with the trainer's layouts, it
    returns ``(targets, layouts, direct)`` (a receiver that maps the trainer's names,
    as the vLLM integration does, needs nothing else from the caller)."""

    def __init__(self, targets: Mapping[str, torch.Tensor] | None = None,
                 layouts: Mapping[str, Layout] | None = None, *,
                 host: str, port: int, rank: int, trainer_size: int, inference_size: int,
                 staging: str = "shadow", budget_bytes: int = DEFAULT_REFIT_BUDGET_BYTES,
                 backend: str = "gloo", timeout: timedelta = timedelta(seconds=120),
                 progress: bool | Callable[[int, int], None] = False,
                 refit_timeout: timedelta | None = None,
                 connect_timeout: timedelta | None = None,
                 checksum: bool | str | None = None, token: str | bytes | None = None,
                 listen: str | None = None,
                 direct: Collection[str] = (), prepare: Prepare | None = None,
                 quant: BlockFormat | None = None) -> None:
        """The timeouts, ``checksum`` and ``token`` are as for :class:`RefitSender`. ``direct``:
        names whose targets are not live memory but the caller's own staging (buffers it
        commits itself once :meth:`refit` returned, as the vLLM integration's logical
        buffers): written straight even with ``staging="shadow"``, never shadowed.
        ``quant``: the FP8 block format of targets whose layout is ``float8_e4m3fn``
        (each with a float32 scale target ``<name>_scale_inv``); the trainer quantizes
        them on the way, shard by shard (``docs/fp8.md``)."""
        made = self._targets_or_prepare(targets, layouts, staging, direct, prepare)
        meet_args = dict(side="inference", side_rank=rank, trainer_size=trainer_size,
                         inference_size=inference_size, backend=backend, layouts=made,
                         timeout=connect_timeout or timeout, token=resolve_key(token),
                         listen=listen, quant=quant)
        super().__init__(meet(host, port, **meet_args), policy=None, budget_bytes=budget_bytes,
                         progress=progress, refit_timeout=refit_timeout, checksum=checksum,
                         meet_args=meet_args)
        self.shadow = self._new_shadow()

    def _targets_or_prepare(self, targets, layouts, staging: str, direct: Collection[str],
                            prepare: Prepare | None):
        """Check the constructor's choice; the layouts, or a function of the other
        side's that makes them (and this rank's targets) with ``prepare``."""
        if staging not in ("shadow", "none"):
            raise ConfigError(f"staging must be 'shadow' or 'none', got {staging!r}")
        check_targets_or_prepare(targets, layouts, prepare)
        self.staging = staging
        if prepare is not None:
            return self._preparing(prepare)
        self._take(targets, direct)
        return layouts

    def _preparing(self, prepare: Prepare) -> Callable[[Mapping[str, Layout]],
                                                       Mapping[str, Layout]]:
        def layouts_from(trainer: Mapping[str, Layout]) -> Mapping[str, Layout]:
            targets, layouts, direct = prepare(trainer)
            self._take(targets, direct)
            return layouts

        return layouts_from

    def refit(self, go_live: bool = True, ready: Callable[[], None] | None = None
              ) -> RefitStats:
        """Receive the next weight version; on success it is live (``direct`` targets:
        written, for the caller to commit) and ``version`` is set. With ``go_live=False``
        (``staging="shadow"`` only) the version waits whole in the shadow until
        :meth:`go_live`: a receive that may run beside readers of the live weights (an
        engine generating while the next version arrives in the background).
        ``ready()`` runs once this rank's part arrived whole, before it confirms it (the
        senders' ``refit`` returns after it on every rank); if it raises, the version
        fails on every rank of both jobs."""
        if not go_live and self.staging != "shadow":
            raise ConfigError("refit(go_live=False) needs staging='shadow': with "
                              "staging='none' the transfer writes the live weights")
        stats = self._move({}, self.shadow, None, ready)
        self.received = stats.version
        if go_live:
            self.go_live()
        return stats

    def invalidate(self) -> None:
        """This rank's staging no longer holds the last version whole (written outside
        a refit, or not to be trusted): its next refit arrives dense, whatever the
        trainer's ``sparse`` mode; the other ranks may still get theirs sparse."""
        self.sparse_refits.base = None

    def go_live(self) -> int:
        """Copy the last version received whole over the live targets (after
        ``refit(go_live=False)``; :meth:`refit` does it by default); returns it."""
        version = self._received_version()
        self._go_live()
        self.version = version
        return self.version

    def reconnect(self, host: str, port: int, *, rank: int | None = None,
                  inference_size: int | None = None, timeout: timedelta | None = None,
                  targets: Mapping[str, torch.Tensor] | None = None,
                  layouts: Mapping[str, Layout] | None = None) -> None:
        """Meet the trainer again at ``host:port`` after a lost worker (see
        :meth:`RefitSender.reconnect`); the live weights and ``version`` are kept. A
        version whose commit this rank never heard of (the group broke during the final
        collective) is made live here if another rank committed it. ``rank``,
        ``targets`` and ``layouts`` change this rank's place (a resized inference side)."""
        if layouts is not None:
            self._meet_args["layouts"] = layouts
        self._remeet(host, port, rank=rank, trainer_size=None, inference_size=inference_size,
                     timeout=timeout)
        if targets is not None:
            self.targets = dict(targets)
        self.shadow = self._new_shadow()  # fresh memory: nothing of the old group writes it

    def _in_doubt(self, version: int) -> None:
        if self.staging == "shadow":
            self.pending = version

    def _reconciled(self, committed: int) -> None:
        if self.pending is not None and committed >= self.pending > self.version:
            self._go_live()
            self.version = self.pending
