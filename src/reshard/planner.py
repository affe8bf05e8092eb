"""The planner: two layouts (or two name -> layout maps) in, a :class:`Plan` out.

Every destination element is written exactly once; a region the destination rank
already holds is a local copy, not a message; where several source replicas hold a
region, senders are chosen to keep the largest per-rank send load small (largest
regions first, each to the least-loaded holder), the same way on every rank.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from reshard._template import Template, build_template
from reshard.errors import PlanError
from reshard.layout import Layout
from reshard.stats import PlanStats, compute_stats
from reshard.tensor_plan import TensorPlan, Transfer

__all__ = ["SINGLE_NAME", "Plan", "gc_paused", "plan"]

#: The name :func:`plan` gives the one tensor of a single-layout plan.
SINGLE_NAME = "tensor"


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
            with gc_paused():
                self._stats = compute_stats(self.tensors)
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
        src, dst = {SINGLE_NAME: src}, {SINGLE_NAME: dst}
    elif isinstance(src, Layout) or isinstance(dst, Layout):
        raise PlanError("expected two Layouts or two name -> Layout mappings, got one of each")
    elif not isinstance(src, Mapping) or not isinstance(dst, Mapping):
        raise PlanError(f"expected two Layouts or two name -> Layout mappings, got "
                        f"{type(src).__name__} and {type(dst).__name__}")
    _check_names(src, dst)
    with gc_paused():
        return _plan_all(src, dst, allow_cast)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Planning allocates many small tuples and no reference cycles; the cyclic collector
    would repeatedly traverse everything alive (all the layouts and their views), which
    costs more than the planning itself for large models."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_all(src: Mapping[str, Layout], dst: Mapping[str, Layout], allow_cast: bool) -> Plan:
    cache: dict[tuple, Template] = {}
    # Tensors sharing both Layout objects share everything the template depends on, so
    # the checks and the template lookup run once per distinct (src, dst) pair.
    by_pair: dict[tuple[int, int], Template] = {}
    same_rank: dict[tuple, dict[int, int]] = {}
    tensors = []
    for name in src:
        s, d = src[name], dst[name]
        pair = (id(s), id(d))
        template = by_pair.get(pair)
        if template is None:
            template = by_pair[pair] = _template_for(name, s, d, allow_cast, cache, same_rank)
        tensors.append(TensorPlan(name, s, d, template, ()))
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


def _template_for(name: str, src: Layout, dst: Layout, allow_cast: bool,
                  cache: dict[tuple, Template],
                  same_rank_cache: dict[tuple, dict[int, int]]) -> Template:
    if not isinstance(src, Layout) or not isinstance(dst, Layout):
        raise PlanError(f"tensor {name!r}: expected Layout objects, got "
                        f"{type(src).__name__} and {type(dst).__name__}")
    if src.shape != dst.shape:
        raise PlanError(f"tensor {name!r}: shape mismatch, source {list(src.shape)} vs "
                        f"destination {list(dst.shape)}")
    if src.dtype != dst.dtype and not allow_cast:
        raise PlanError(f"tensor {name!r}: dtype mismatch, source {src.dtype} vs destination "
                        f"{dst.dtype} (pass allow_cast=True to cast while sending)")
    same_rank = _same_rank_slots(src, dst, same_rank_cache)
    key = (src.structure, dst.structure, tuple(sorted(same_rank.items())))
    template = cache.get(key)
    if template is None:
        template = cache[key] = build_template(src, dst, same_rank, dst.itemsize)
    return template


def _same_rank_slots(src: Layout, dst: Layout,
                     cache: dict[tuple, dict[int, int]] | None = None) -> dict[int, int]:
    """dst slot -> src slot for every rank present on both sides (memoised in ``cache`` by
    the two rank tuples: by identity when meshes are shared, else by value)."""
    if cache is None:
        return _shared_slots(src, dst)
    by_id = (id(src.ranks), id(dst.ranks))
    found = cache.get(by_id)
    if found is None:
        by_value = (src.ranks, dst.ranks)
        found = cache.get(by_value)
        if found is None:
            found = cache[by_value] = _shared_slots(src, dst)
        cache[by_id] = found
    return found


def _shared_slots(src: Layout, dst: Layout) -> dict[int, int]:
    shared = src.rank_set & dst.rank_set
    return {dst._slot_of[r]: src._slot_of[r] for r in shared}


def _choose_senders(tensors: list[TensorPlan]) -> tuple[TensorPlan, ...]:
    """Give every remote needer of a replicated region one holder: largest regions first,
    each to the least-loaded holder (ties broken by a rotation, so replicas share)."""
    load: dict[int, int] = {}
    # forced loads: tensors with the same template and source ranks add the same amounts
    forced: dict[tuple[int, int], list] = {}
    items = []
    for ti, t in enumerate(tensors):
        tpl = t.template
        if tpl.forced_send:
            ranks = t.src.ranks
            group = forced.get((id(tpl), id(ranks)))
            if group is None:
                forced[(id(tpl), id(ranks))] = [tpl, ranks, 1]
            else:
                group[2] += 1
        if tpl.multi:
            units = tpl.units
            items.extend((-units[u].nbytes, ti, u) for u in tpl.multi)
    for tpl, ranks, count in forced.values():
        for slot, nbytes in tpl.forced_send:
            r = ranks[slot]
            load[r] = load.get(r, 0) + nbytes * count
    items.sort()
    picks: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for _, ti, u in items:
        t = tensors[ti]
        unit = t.template.units[u]
        ranks = t.src.ranks
        slots = [slot for slot, _ in unit.holders]
        holder_ranks = [ranks[slot] for slot in slots]
        loads = [load.get(r, 0) for r in holder_ranks]
        n, nbytes = len(slots), unit.nbytes
        if len(set(holder_ranks)) < n:  # a rank holding the region twice (explicit layouts)
            picks.setdefault(ti, []).append((u, _pick_slow(load, slots, holder_ranks, unit,
                                                           ti + u)))
            continue
        chosen = []
        for j in range(len(unit.remote)):
            # the first least-loaded holder in rotation order starting at `rot`
            rot = (j + ti + u) % n
            least = min(loads)
            try:
                k = loads.index(least, rot)
            except ValueError:
                k = loads.index(least)
            loads[k] += nbytes
            chosen.append(slots[k])
        for r, value in zip(holder_ranks, loads):
            load[r] = value
        picks.setdefault(ti, []).append((u, tuple(chosen)))
    out = list(tensors)
    for ti, chosen_units in picks.items():
        t = tensors[ti]
        out[ti] = TensorPlan(t.name, t.src, t.dst, t.template, tuple(sorted(chosen_units)))
    return tuple(out)


def _pick_slow(load: dict[int, int], slots: list[int], holder_ranks: list[int], unit,
               shift: int) -> tuple[int, ...]:
    """:func:`_choose_senders`' rule, one holder at a time (holders may repeat a rank)."""
    rank_of = dict(zip(slots, holder_ranks))
    chosen = []
    for j in range(len(unit.remote)):
        rot = (j + shift) % len(slots)
        order = slots[rot:] + slots[:rot]
        best = min(order, key=lambda s: load.get(rank_of[s], 0))
        load[rank_of[best]] = load.get(rank_of[best], 0) + unit.nbytes
        chosen.append(best)
    return tuple(chosen)
