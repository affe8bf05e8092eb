"""The planner: two layouts (or two name -> layout maps) in, a :class:`Plan` out.

Every destination element is written exactly once; a region the destination rank
already holds is a local copy, not a message; where several source replicas hold a
region, senders are chosen to keep the largest per-rank send load small (largest
regions first, each to the least-loaded holder), the same way on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._template import Template, build_template
from .errors import PlanError
from .layout import Layout
from .stats import PlanStats, compute_stats

__all__ = ["Plan", "TensorPlan", "Transfer", "plan"]


@dataclass(frozen=True)
class Transfer:
    """Copy ``size`` elements from ``src_rank``'s local tensor at ``src_offset`` to
    ``dst_rank``'s local tensor at ``dst_offset`` (a local copy when the ranks match)."""

    name: str
    src_rank: int
    dst_rank: int
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    size: tuple[int, ...]
    nbytes: int

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class TensorPlan:
    """The plan of one tensor: a shared template plus this tensor's ranks and senders."""

    name: str
    src: Layout
    dst: Layout
    template: Template
    senders: tuple[tuple[int, tuple[int, ...]], ...]  # (unit index, src slot per remote needer)

    def transfers(self, rank: int | None = None) -> Iterator[Transfer]:
        """Transfers of this tensor, all of them or those that ``rank`` sends or receives."""
        if rank is not None and rank not in self.src.rank_set and rank not in self.dst.rank_set:
            return
        chosen = dict(self.senders)
        src_ranks, dst_ranks = self.src.ranks, self.dst.ranks
        for i, u in enumerate(self.template.units):
            holders = u.holders
            for k, dst_slot, dst_off in u.local:
                r = dst_ranks[dst_slot]
                if rank is None or rank == r:
                    yield Transfer(self.name, r, r, holders[k][1], dst_off, u.size, u.nbytes)
            picks = chosen.get(i)
            for j, (dst_slot, dst_off) in enumerate(u.remote):
                src_slot = picks[j] if picks else holders[0][0]
                s, d = src_ranks[src_slot], dst_ranks[dst_slot]
                if rank is None or rank in (s, d):
                    src_off = next(o for slot, o in holders if slot == src_slot)
                    yield Transfer(self.name, s, d, src_off, dst_off, u.size, u.nbytes)


class Plan:
    """A frozen, printable list of tensor plans. Build it with :func:`plan`."""

    def __init__(self, tensors: tuple[TensorPlan, ...]) -> None:
        self.tensors = tensors
        self._by_name = {t.name: t for t in tensors}
        self._stats: PlanStats | None = None
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorPlan:
        return self._by_name[name]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def transfers(self, rank: int | None = None) -> Iterator[Transfer]:
        """Every transfer of the plan, or those ``rank`` takes part in."""
        for t in self.tensors:
            yield from t.transfers(rank)

    def ranks(self) -> tuple[frozenset[int], frozenset[int]]:
        """(source ranks, destination ranks) over all tensors."""
        src: set[int] = set()
        dst: set[int] = set()
        for t in self.tensors:
            src |= t.src.rank_set
            dst |= t.dst.rank_set
        return frozenset(src), frozenset(dst)

    def stats(self) -> PlanStats:
        if self._stats is None:
            self._stats = compute_stats(self)
        return self._stats

    def fingerprint(self) -> str:
        """A digest of everything that decides who sends what; equal on every rank that
        built the same plan, different as soon as any layout or sender differs."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for t in self.tensors:
                h.update(repr((t.name, t.src.structure, t.src.ranks, t.dst.structure,
                               t.dst.ranks, t.senders)).encode())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def __repr__(self) -> str:
        s = self.stats()
        return (f"Plan({len(self.tensors)} tensors, {s.num_messages} remote regions, "
                f"{s.bytes_sent} B sent, {s.bytes_local} B local, max send {s.max_send_bytes} B "
                f"(lower bound {s.send_lower_bound} B))")


def plan(src: Layout | Mapping[str, Layout], dst: Layout | Mapping[str, Layout], *,
         allow_cast: bool = False) -> Plan:
    """Plan moving ``src`` to ``dst``: two layouts, or two maps of tensor name -> layout.

    With ``allow_cast`` the two sides may differ in dtype (the sender casts to the
    destination dtype); otherwise a dtype mismatch is an error.
    """
    if isinstance(src, Layout) and isinstance(dst, Layout):
        src, dst = {"tensor": src}, {"tensor": dst}
    elif isinstance(src, Layout) or isinstance(dst, Layout):
        raise PlanError("expected two Layouts or two name -> Layout mappings, got one of each")
    _check_names(src, dst)
    cache: dict[tuple, Template] = {}
    tensors = [_plan_tensor(name, src[name], dst[name], allow_cast, cache) for name in src]
    return Plan(_choose_senders(tensors))


def _check_names(src: Mapping[str, Any], dst: Mapping[str, Any]) -> None:
    missing = [n for n in src if n not in dst]
    extra = [n for n in dst if n not in src]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"only in the source: {sorted(missing)[:5]}")
        if extra:
            parts.append(f"only in the destination: {sorted(extra)[:5]}")
        raise PlanError("the two sides name different tensors; " + "; ".join(parts))


def _plan_tensor(name: str, src: Layout, dst: Layout, allow_cast: bool,
                 cache: dict[tuple, Template]) -> TensorPlan:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise PlanError(f"tensor {name!r}: expected Layout objects, got "
                        f"{type(src).__name__} and {type(dst).__name__}")
    if src.shape != dst.shape:
        raise PlanError(f"tensor {name!r}: shape mismatch, source {list(src.shape)} vs "
                        f"destination {list(dst.shape)}")
    if src.dtype != dst.dtype and not allow_cast:
        raise PlanError(f"tensor {name!r}: dtype mismatch, source {src.dtype} vs destination "
                        f"{dst.dtype} (pass allow_cast=True to cast while sending)")
    same_rank = _same_rank_slots(src, dst)
    key = (src.structure, dst.structure, tuple(sorted(same_rank.items())))
    template = cache.get(key)
    if template is None:
        template = cache[key] = build_template(src, dst, same_rank, dst.itemsize)
    return TensorPlan(name, src, dst, template, ())


def _same_rank_slots(src: Layout, dst: Layout) -> dict[int, int]:
    """dst slot -> src slot for every rank present on both sides."""
    shared = src.rank_set & dst.rank_set
    return {dst._slot_of[r]: src._slot_of[r] for r in shared}


def _choose_senders(tensors: list[TensorPlan]) -> tuple[TensorPlan, ...]:
    """Give every remote needer of a replicated region one holder: largest regions first,
    each to the least-loaded holder (ties broken by a rotation, so replicas share)."""
    load: dict[int, int] = {}
    for t in tensors:
        for slot, nbytes in t.template.forced_send:
            r = t.src.ranks[slot]
            load[r] = load.get(r, 0) + nbytes
    items = [(-t.template.units[u].nbytes, ti, u)
             for ti, t in enumerate(tensors) for u in t.template.multi]
    items.sort()
    picks: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for _, ti, u in items:
        t = tensors[ti]
        unit = t.template.units[u]
        slots = [slot for slot, _ in unit.holders]
        chosen = []
        for j in range(len(unit.remote)):
            rot = (j + ti + u) % len(slots)
            order = slots[rot:] + slots[:rot]
            best = min(order, key=lambda s: load.get(t.src.ranks[s], 0))
            load[t.src.ranks[best]] = load.get(t.src.ranks[best], 0) + unit.nbytes
            chosen.append(best)
        picks.setdefault(ti, []).append((u, tuple(chosen)))
    return tuple(
        TensorPlan(t.name, t.src, t.dst, t.template, tuple(sorted(picks.get(i, ()))))
        for i, t in enumerate(tensors))
