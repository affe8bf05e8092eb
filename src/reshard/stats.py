"""Statistics of a plan: bytes moved, per-rank loads and their lower bounds, and what
gather-and-broadcast would move for the same pair of layouts."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan


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


def compute_stats(plan: Plan) -> PlanStats:
    send: Counter[int] = Counter()
    recv: Counter[int] = Counter()
    demand: Counter[frozenset[int]] = Counter()
    sent = local = messages = dst_bytes = model = gb_wire = 0
    for t in plan.tensors:
        tpl = t.template
        sent += tpl.remote_bytes
        local += tpl.local_bytes
        messages += tpl.num_remote
        model += t.src.numel * t.src.itemsize
        _add_recv(recv, t)
        dst_bytes += _held_bytes(t.dst) * t.dst.itemsize
        gb_wire += _gather_broadcast_wire(t)
        for slot, nbytes in tpl.forced_send:
            r = t.src.ranks[slot]
            send[r] += nbytes
            demand[frozenset((r,))] += nbytes
        chosen = dict(t.senders)
        for u in tpl.multi:
            unit = tpl.units[u]
            for slot in chosen[u]:
                send[t.src.ranks[slot]] += unit.nbytes
            holders = frozenset(t.src.ranks[s] for s, _ in unit.holders)
            demand[holders] += unit.nbytes * len(unit.remote)
    max_recv = max(recv.values(), default=0)
    return PlanStats(
        num_tensors=len(plan.tensors), num_messages=messages, bytes_sent=sent,
        bytes_local=local, dst_bytes=dst_bytes, max_send_bytes=max(send.values(), default=0),
        max_recv_bytes=max_recv, send_lower_bound=_send_lower_bound(demand),
        recv_lower_bound=max_recv, gather_broadcast_bytes=2 * model,
        gather_broadcast_wire_bytes=gb_wire, model_bytes=model)




def _add_recv(recv: Counter[int], t) -> None:
    for slot, nbytes in t.template.recv:
        recv[t.dst.ranks[slot]] += nbytes


def _held_bytes(layout) -> int:
    """Elements held over all ranks of a layout (replicas counted), cached per structure."""
    cache = layout.__dict__
    if "_held" not in cache:
        cache["_held"] = sum(
            sum(p.numel for p in layout.view_of_slot(s).pieces) for s in range(len(layout.ranks)))
    return cache["_held"]


def _gather_broadcast_wire(t) -> int:
    size = t.src.numel * t.dst.itemsize
    allgather = len(t.src.ranks) * size - _held_bytes(t.src) * t.dst.itemsize
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
