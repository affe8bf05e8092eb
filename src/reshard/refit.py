"""The refit API for RL frameworks: a trainer-side sender and an inference-side receiver.

Both sides meet once (:func:`reshard.rendezvous.meet`), plan once, and reuse the plan
for every refit. Each refit carries a weight version; the receiver's ``version`` tells a
rollout which policy it is sampling from.

Never torn: by default the receiver writes into a shadow copy of its parameters and
copies it over the live ones only after every rank of both sides has confirmed that
its part arrived whole (one small collective). A refit that fails midway (a peer dies,
a timeout, a sender raising) leaves the previous version in place on every rank and
raises a :class:`reshard.TransferError`. The shadow costs one extra copy of the
receiving rank's parameters; ``staging="none"`` writes in place instead (no extra
memory, but a failed refit may leave weights torn).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from .errors import ReshardError, TensorMismatchError, TransferError
from .executor import DEFAULT_BUDGET_BYTES, Executor, local_problem
from .layout import Layout
from .plan import Plan
from .plan import plan as make_plan
from .rendezvous import Meeting, meet

__all__ = ["RefitReceiver", "RefitSender", "RefitStats", "layouts_of"]


@dataclass(frozen=True)
class RefitStats:
    version: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    rounds: int


def layouts_of(params: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Layout]]:
    """Local tensors and layouts of parameters held as DTensors (FSDP2 / TP) or plain
    tensors (taken as whole, on this rank alone)."""
    tensors, layouts = {}, {}
    for name, p in params.items():
        data = p.detach() if isinstance(p, torch.Tensor) else p
        if hasattr(data, "to_local") and hasattr(data, "placements"):
            layouts[name] = Layout.from_dtensor(data)
            tensors[name] = data.to_local()
        else:
            raise TensorMismatchError(f"parameter {name!r} is a plain tensor: give its Layout "
                                      "explicitly (layouts=...)")
    return tensors, layouts


class _Side:
    """What sender and receiver share: the meeting, the plan(s), executors, commit."""

    def __init__(self, meeting: Meeting, *, policy: Mapping[str, str] | None,
                 budget_bytes: int, progress: bool | Callable[[int, int], None]) -> None:
        self.meeting, self.comm, self.rank = meeting, meeting.comm, meeting.rank
        self.version = 0
        self.executors = []
        for method, sub in _split_by_policy(meeting.plan, policy or {}).items():
            ex = Executor(sub, self.comm, method=method, budget_bytes=budget_bytes)
            if ex._runner is not None and progress:
                ex._runner.progress = progress if callable(progress) else _print_progress
            self.executors.append(ex)

    def _check(self, src, dst, proposed: int | None) -> int:
        problem = local_problem(self.meeting.plan, self.rank, src, dst)
        views = self.comm.all_gather_object((self.rank, problem, proposed, self.version))
        problems = [(r, p) for r, p, _, _ in views if p]
        if problems:
            raise TensorMismatchError(f"rank {problems[0][0]}: {problems[0][1]}; nothing "
                                      "was moved")
        new = max(v for _, _, v, _ in views if v is not None)
        current = max(c for _, _, _, c in views)
        if new <= current:
            raise ReshardError(f"refit version {new} is not newer than the current version "
                               f"{current}; nothing was moved")
        return new

    def _move(self, src, dst, proposed: int | None) -> RefitStats:
        t0 = time.perf_counter()
        version = self._check(src, dst, proposed)
        error: BaseException | None = None
        sent = received = rounds = 0
        for ex in self.executors:
            try:
                s = ex.run(src, dst, check=False)
                sent, received, rounds = (sent + s.bytes_sent, received + s.bytes_received,
                                          rounds + s.rounds)
            except TransferError as e:
                error = e
                break
        self._commit(error)
        return RefitStats(version, time.perf_counter() - t0, sent, received, rounds)

    def _commit(self, error: BaseException | None) -> None:
        """Every rank says whether its part arrived whole; any failure aborts all."""
        try:
            views = self.comm.all_gather_object((self.rank, None if error is None else
                                                 str(error)))
        except Exception as e:
            raise TransferError(f"rank {self.rank}: refit aborted, the group is broken "
                                f"({str(e).splitlines()[0]}); the previous version stays "
                                "in place") from (error or e)
        failed = [(r, msg) for r, msg in views if msg]
        if failed:
            raise TransferError(f"refit aborted on every rank because rank {failed[0][0]} "
                                f"failed: {failed[0][1]}; the previous version stays in "
                                "place") from error


class RefitSender(_Side):
    """The trainer side. ``params``: name -> DTensor (or local tensor with ``layouts``)."""

    def __init__(self, params: Mapping[str, Any], *, host: str, port: int, rank: int,
                 trainer_size: int, inference_size: int,
                 layouts: Mapping[str, Layout] | None = None,
                 policy: Mapping[str, str] | None = None,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, backend: str = "gloo",
                 timeout: timedelta = timedelta(seconds=120),
                 progress: bool | Callable[[int, int], None] = False) -> None:
        self.params = params
        if layouts is None:
            _, layouts = layouts_of(params)
        meeting = meet(host, port, side="trainer", side_rank=rank, trainer_size=trainer_size,
                       inference_size=inference_size, layouts=layouts, backend=backend,
                       timeout=timeout)
        super().__init__(meeting, policy=policy, budget_bytes=budget_bytes, progress=progress)
        self.explicit_layouts = layouts is not None

    def refit(self, version: int) -> RefitStats:
        """Send the current parameters as weight version ``version`` (must increase)."""
        src = _locals(self.params)
        stats = self._move(src, {}, version)
        self.version = stats.version
        return stats


class RefitReceiver(_Side):
    """The inference side. ``targets``: name -> local tensor to write (views into fused
    parameters are fine); ``layouts``: name -> Layout over the inference ranks."""

    def __init__(self, targets: Mapping[str, torch.Tensor], layouts: Mapping[str, Layout], *,
                 host: str, port: int, rank: int, trainer_size: int, inference_size: int,
                 staging: str = "shadow", budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 backend: str = "gloo", timeout: timedelta = timedelta(seconds=120),
                 progress: bool | Callable[[int, int], None] = False) -> None:
        if staging not in ("shadow", "none"):
            raise ValueError(f"staging must be 'shadow' or 'none', got {staging!r}")
        self.targets, self.staging = dict(targets), staging
        meeting = meet(host, port, side="inference", side_rank=rank, trainer_size=trainer_size,
                       inference_size=inference_size, layouts=layouts, backend=backend,
                       timeout=timeout)
        super().__init__(meeting, policy=None, budget_bytes=budget_bytes, progress=progress)
        # a clone, not empty: regions no layout covers (vocabulary padding) must keep their
        # live values when the shadow is copied over
        self.shadow = ({n: t.detach().clone() for n, t in self.targets.items()}
                       if staging == "shadow" else self.targets)

    @property
    def shadow_bytes(self) -> int:
        """Extra memory the never-torn guarantee costs on this rank."""
        if self.staging == "none":
            return 0
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    def refit(self) -> RefitStats:
        """Receive the next weight version; on success it is live and ``version`` is set."""
        stats = self._move({}, self.shadow, None)
        if self.staging == "shadow":
            with torch.no_grad():
                for name, live in self.targets.items():
                    live.copy_(self.shadow[name])
        self.version = stats.version
        return stats


def _locals(params: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    class _Lazy(dict):
        def __missing__(self, name):  # DTensor -> its local shard, read at send time
            p = params[name]
            data = p.detach() if isinstance(p, torch.Tensor) else p
            return data.to_local() if hasattr(data, "to_local") else data

        def get(self, name, default=None):
            return self[name] if name in params else default

    return _Lazy()


def _split_by_policy(plan: Plan, policy: Mapping[str, str]) -> dict[str, Plan]:
    unknown = sorted(set(policy) - set(plan.names))
    if unknown:
        raise ReshardError(f"policy names parameters that are not in the plan: {unknown[:5]}")
    groups: dict[str, list] = {}
    for t in plan.tensors:
        groups.setdefault(policy.get(t.name, "reshard"), []).append(t)
    out = {}
    for method, tensors in groups.items():
        out[method] = make_plan({t.name: t.src for t in tensors},
                                {t.name: t.dst for t in tensors}, allow_cast=True)
    return out


def _print_progress(done: int, total: int) -> None:
    if total:
        print(f"\rrefit: {done / total:6.1%} of {total / 2**20:.1f} MiB sent", end="",
              flush=True)
        if done >= total:
            print()
