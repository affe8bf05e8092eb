"""Fan-out to many replicas: direct (every destination domain fed by the sources) or
relayed (a pipelined chain across destination domains).

When several destination domains (the nodes of inference replicas) need the same
region and no source rank sits in them, the domain schedule
(:func:`reshard.topology.domain_schedule`) either sends it from a source rank into
every domain (``direct``: the sources' links carry one copy per domain), or into one
domain only and lets each domain's receiver forward it to the next one over its own
link (``relay``: the sources' links carry about one copy whatever the number of
replicas). A relay forwards from its own received destination tensor (the shadow of a
refit, not yet committed), chunk by chunk: chunk ``c`` leaves a relay in a round after
the one that brought it in, so the chain runs as a pipeline and its time grows with the
number of domains only by the pipeline's fill. Every region's chain visits the domains in
the same order, so each domain link carries one stream each way (the domain before it
in, the one after it out): streams that share a link compete for it, and over TCP that
costs more than any balance of the loads wins (docs/fleets.md, "One order").

``auto`` chooses by the cost model below, from the topology's link bandwidths: the
busiest domain link (bytes out or in over its rate) plus, for a chain, its fill.
Everything here is a pure function of the plan and the topology: every rank builds the
same schedule without talking.

Replicas that are separate tensors of one plan (the elastic group's ``<offset>:<name>``)
relay to each other when the caller says they hold the same source data
(``same_source``: tensor name -> the name of its data) and their layouts match (same
source layout and ranks, same destination structure and dtype): their plan templates
are then equal, unit by unit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from reshard.errors import ConfigError
from reshard.planner import Plan
from reshard.tensor_plan import TensorPlan

__all__ = ["FANOUTS", "Region", "choose_fanout", "fanout_costs", "regions"]

#: ``auto`` (the cost model picks), ``direct`` or ``relay``.
FANOUTS = ("auto", "direct", "relay")


@dataclass(frozen=True)
class Region:
    """One unit of the plan's templates, shared by the tensors of one source group:
    ``members`` are (tensor plan, unit index) pairs whose units are equal."""

    members: tuple[tuple[TensorPlan, int], ...]

    @property
    def nbytes(self) -> int:
        t, ui = self.members[0]
        return t.template.units[ui].nbytes

    def needers(self, domain: Callable[[int], int]
                ) -> dict[int, list[tuple[str, int, tuple[int, ...]]]]:
        """Destination domain -> [(tensor name, rank, local offset)] of remote needers."""
        out: dict[int, list[tuple[str, int, tuple[int, ...]]]] = {}
        for t, ui in self.members:
            for dst_slot, dst_off in t.template.units[ui].remote:
                r = t.dst.ranks[dst_slot]
                out.setdefault(domain(r), []).append((t.name, r, dst_off))
        return out

    def holder_domains(self, domain: Callable[[int], int]) -> set[int]:
        t, ui = self.members[0]
        return {domain(t.src.ranks[s]) for s, _ in t.template.units[ui].holders}


def check_fanout(fanout: str) -> str:
    if fanout not in FANOUTS:
        raise ConfigError(f"unknown fanout {fanout!r}; expected one of {FANOUTS}")
    return fanout


def _group_key(t: TensorPlan, same_source: Mapping[str, str] | None) -> tuple:
    if not same_source or t.name not in same_source:
        return ("tensor", t.name)
    return ("data", same_source[t.name], t.src.structure, t.src.ranks, t.dst.structure,
            len(t.template.units))


def regions(plan: Plan, same_source: Mapping[str, str] | None = None) -> list[Region]:
    """Every unit of the plan once per source group, largest first (ties in plan order)."""
    groups: dict[tuple, list[TensorPlan]] = {}
    for t in plan.tensors:
        groups.setdefault(_group_key(t, same_source), []).append(t)
    items = []
    for gi, members in enumerate(groups.values()):
        for ui, u in enumerate(members[0].template.units):
            items.append((-u.nbytes, gi, ui, tuple((t, ui) for t in members)))
    items.sort(key=lambda x: x[:3])
    return [Region(m) for *_, m in items]


def _far(region: Region, domain: Callable[[int], int]) -> list[int]:
    """The destination domains that need the region and hold no source of it."""
    held = region.holder_domains(domain)
    return sorted(d for d in region.needers(domain) if d not in held)


def fanout_costs(plan: Plan, topology, budget_bytes: int,
                 same_source: Mapping[str, str] | None = None) -> dict[str, float]:
    """Predicted seconds of the network part of each fan-out: the busiest domain link
    (bytes out or in, over its rate) and, relayed, the fill of the longest chain (one
    network chunk, a sixth of the budget, per domain after the first)."""
    loads: dict[str, dict[tuple[str, int], float]] = {"direct": {}, "relay": {}}
    depth = 1

    def add(mode: str, way: str, dom: int, nbytes: float) -> None:
        loads[mode][way, dom] = loads[mode].get((way, dom), 0.0) + nbytes

    for region in regions(plan, same_source):
        far = _far(region, topology.domain)
        if not far:
            continue
        held = sorted(region.holder_domains(topology.domain))
        n = region.nbytes
        for d in held:
            add("direct", "out", d, n * len(far) / len(held))
            add("relay", "out", d, n / len(held))
        for d in far:
            add("direct", "in", d, n)
            add("relay", "in", d, n)
        for d in far[:-1]:
            add("relay", "out", d, n)
        depth = max(depth, len(far))
    chunk = max(1, budget_bytes // 6)
    out = {}
    for mode, by_link in loads.items():
        busiest = max((b / (topology.link_gbps(d) * 1e9) for (_, d), b in by_link.items()),
                      default=0.0)
        fill = 0.0 if mode == "direct" else (depth - 1) * chunk / (
            min((topology.link_gbps(d) for _, d in by_link), default=1.0) * 1e9)
        out[mode] = busiest + fill
    return out


def choose_fanout(plan: Plan, topology, budget_bytes: int, fanout: str = "auto",
                  same_source: Mapping[str, str] | None = None) -> str:
    """``direct`` or ``relay``: as asked, or (``auto``) the cheaper by
    :func:`fanout_costs`, direct on a tie."""
    check_fanout(fanout)
    if fanout != "auto":
        return fanout
    cost = fanout_costs(plan, topology, budget_bytes, same_source)
    return "relay" if cost["relay"] < cost["direct"] else "direct"
