"""Statistics of a plan: bytes moved, per-rank loads and their lower bounds, and what
gather-and-broadcast would move for the same pair of layouts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from reshard.tensor_plan import TensorPlan


@dataclass(frozen=True)
class PlanStats:
    num_tensors: int
    num_messages: int
    """Remote (rank-to-rank) region copies before packing; the executor packs them into
    one message per rank pair and round."""
    bytes_sent: int
    """Bytes that cross between ranks."""
    bytes_local: int
    """Bytes copied inside a rank (regions the destination already holds)."""
    dst_bytes: int
    """Sum of every destination rank's share (local tensors without padding)."""
    max_send_bytes: int
    max_recv_bytes: int
    send_lower_bound: int
    """No choice of senders can make the largest per-rank send smaller than this."""
    recv_lower_bound: int
    gather_broadcast_bytes: int
    """Logical payload of gather-and-broadcast: all-gather + broadcast = 2x the model."""
    gather_broadcast_wire_bytes: int
    """Bytes gather-and-broadcast puts between ranks: each source rank receives what it
    lacks, and every destination rank not on the source side receives the full tensor."""
    model_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def send_balance(self) -> float:
        """max send / lower bound (1.0 is optimal)."""
        return self.max_send_bytes / self.send_lower_bound if self.send_lower_bound else 1.0


def compute_stats(tensors: Sequence[TensorPlan]) -> PlanStats:
    """The statistics of a plan's tensors (:attr:`reshard.planner.Plan.tensors`)."""
    send: Counter[int] = Counter()
    recv: Counter[int] = Counter()
    demand: Counter[frozenset[int]] = Counter()
    sent = local = messages = dst_bytes = model = gb_wire = 0
    held: dict[tuple, int] = {}  # elements held over all ranks, per layout structure
    # Everything but the chosen senders depends only on the template and the two sides'
    # ranks, so tensors are counted per such group (all the experts of a layer are one).
    for t, count in tensor_groups(tensors):
        tpl = t.template
        src_ranks, dst_ranks = t.src.ranks, t.dst.ranks
        sent += tpl.remote_bytes * count
        local += tpl.local_bytes * count
        messages += tpl.num_remote * count
        model += t.src.numel * t.src.itemsize * count
        for slot, nbytes in tpl.recv:
            recv[dst_ranks[slot]] += nbytes * count
        dst_bytes += _held_bytes(t.dst, held) * t.dst.itemsize * count
        gb_wire += _gather_broadcast_wire(t, held) * count
        for slot, nbytes in tpl.forced_send:
            r = src_ranks[slot]
            send[r] += nbytes * count
            demand[frozenset((r,))] += nbytes * count
        for u in tpl.multi:
            unit = tpl.units[u]
            holders = frozenset(src_ranks[s] for s, _ in unit.holders)
            demand[holders] += unit.nbytes * len(unit.remote) * count
    for t in tensors:
        if t.senders:
            units, src_ranks = t.template.units, t.src.ranks
            for u, chosen in t.senders:
                nbytes = units[u].nbytes
                for slot in chosen:
                    send[src_ranks[slot]] += nbytes
    max_recv = max(recv.values(), default=0)
    return PlanStats(
        num_tensors=len(tensors), num_messages=messages, bytes_sent=sent,
        bytes_local=local, dst_bytes=dst_bytes, max_send_bytes=max(send.values(), default=0),
        max_recv_bytes=max_recv, send_lower_bound=_send_lower_bound(demand),
        recv_lower_bound=max_recv, gather_broadcast_bytes=2 * model,
        gather_broadcast_wire_bytes=gb_wire, model_bytes=model)


def tensor_groups(tensors) -> list[tuple[Any, int]]:
    """(representative tensor plan, count) per (template, source ranks, destination ranks).

    A template fixes both sides' structures (shapes, dtypes, placements), so tensors of
    one group differ only in their names and senders. Grouping goes by object identity
    first (shared Layout objects), then by value.
    """
    by_id: dict[tuple[int, int, int], list] = {}
    by_value: dict[tuple, list] = {}
    for t in tensors:
        key = (id(t.template), id(t.src), id(t.dst))
        group = by_id.get(key)
        if group is None:
            value_key = (id(t.template), t.src.ranks, t.dst.ranks)
            group = by_value.get(value_key)
            if group is None:
                group = by_value[value_key] = [t, 0]
            by_id[key] = group
        group[1] += 1
    return [(t, count) for t, count in by_value.values()]


def _held_bytes(layout, by_structure: dict[tuple, int] | None = None) -> int:
    """Elements held over all ranks of a layout (replicas counted), cached per layout and,
    with ``by_structure``, per structure (layouts that differ only in rank numbers)."""
    cache = layout.__dict__
    if "_held" not in cache:
        key = layout.structure
        if by_structure is not None and key in by_structure:
            cache["_held"] = by_structure[key]
        else:
            cache["_held"] = sum(sum(p.numel for p in layout.view_of_slot(s).pieces)
                                 for s in range(len(layout.ranks)))
            if by_structure is not None:
                by_structure[key] = cache["_held"]
    return cache["_held"]


def _gather_broadcast_wire(t, by_structure: dict[tuple, int] | None = None) -> int:
    size = t.src.numel * t.dst.itemsize
    held = _held_bytes(t.src, by_structure)
    allgather = len(t.src.ranks) * size - held * t.dst.itemsize
    outsiders = len(t.dst.rank_set - t.src.rank_set)
    return allgather + outsiders * size


def _send_lower_bound(demand: Counter[frozenset[int]]) -> int:
    """max over holder sets H of (bytes only ranks in H can send) / |H|, rounded up.

    Any assignment puts all bytes whose holders lie inside H on ranks of H, so some rank
    of H sends at least their average.
    """
    singles = {next(iter(h)): b for h, b in demand.items() if len(h) == 1}
    groups = [(h, b) for h, b in demand.items() if len(h) > 1]
    best = max(singles.values(), default=0)
    candidates = [h for h, _ in groups]
    if demand:
        candidates.append(frozenset().union(*demand))
    for h in candidates:
        total = sum(singles.get(r, 0) for r in h) + sum(b for g, b in groups if g <= h)
        best = max(best, -(-total // len(h)))
    return best


def distinct_shard_slots(layout) -> tuple[int, ...]:
    """Slots holding one copy of each distinct shard (the first replica of each): what
    gather-and-broadcast all-gathers, since gathering replicas would repeat bytes."""
    cached = layout.__dict__.get("_distinct_slots")
    if cached is None:
        seen: set[tuple] = set()
        slots = []
        for slot in range(len(layout.ranks)):
            key = tuple((p.offset, p.size) for p in layout.view_of_slot(slot).pieces)
            if key not in seen:
                seen.add(key)
                slots.append(slot)
        cached = layout.__dict__["_distinct_slots"] = tuple(slots)
    return cached
