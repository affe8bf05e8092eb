"""Topology: which ranks share a fast domain (an NVLink domain, a node), and the
domain-aware schedule that makes every needed byte cross the slow network once per
destination domain.

For each region and each destination domain that needs it: if a source rank in that
domain holds it, it is served over the fast links; otherwise one needer in the domain
receives it over the network (receivers chosen so the domain's ranks split the network
receive evenly by bytes, senders chosen among source replicas so the largest per-rank
network send is small) and forwards it to the domain's other needers over the fast
links, from its own already-written destination tensor. Forwards wait for the round that
brought their bytes in, so with a staging budget the forwarding of one round overlaps
the network transfer of the next.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from reshard.errors import LayoutError
from reshard.fanout import Region, check_fanout, choose_fanout, regions
from reshard.planner import Plan
from reshard.schedule import DEST, Hop, RoundPacker, Schedule, add_capped, is_solo, split_hop

__all__ = ["Topology", "domain_schedule", "link_bytes", "inter_domain_lower_bound"]

ENV_VARS = ("RESHARD_DOMAINS", "RESHARD_DOMAIN_SIZE")


@dataclass(frozen=True)
class Topology:
    """Rank -> fast domain, and link bandwidths (GB/s) used by the cost model."""

    domains: Mapping[int, int] | None = None
    domain_size: int | None = None
    intra_gbps: float = 450.0
    inter_gbps: float = 50.0
    nic_gbps: float = 50.0
    name: str = field(default="custom", compare=False)
    domain_gbps: Mapping[int, float] | None = None
    """A domain's network link, where it differs from ``inter_gbps`` (a trainer's nodes
    with more cards than a replica's): what the fan-out's cost model reads."""

    def __post_init__(self) -> None:
        if (self.domains is None) == (self.domain_size is None):
            raise LayoutError("give a Topology exactly one of domains= (rank -> domain) or "
                              "domain_size=")
        if self.domain_size is not None and self.domain_size < 1:
            raise LayoutError(f"domain_size must be >= 1, got {self.domain_size}")

    @classmethod
    def uniform(cls, domain_size: int, **kw: Any) -> Topology:
        """Consecutive blocks of ``domain_size`` ranks share a domain (8 on a DGX node)."""
        return cls(domain_size=domain_size, **kw)

    @classmethod
    def from_env(cls, default: Topology | None = None, *,
                 env: Mapping[str, str] | None = None) -> Topology | None:
        """``RESHARD_DOMAIN_SIZE=8`` or ``RESHARD_DOMAINS=0,0,1,1`` (domain of rank i),
        read from ``env`` (``os.environ`` by default); ``default`` if neither is set."""
        env = os.environ if env is None else env
        domains, size = (env.get(k, "").strip() for k in ENV_VARS)
        if domains and size:
            raise LayoutError(f"both RESHARD_DOMAINS={domains!r} and RESHARD_DOMAIN_SIZE="
                              f"{size!r} are set: set one of them")
        if domains:
            try:
                ids = [int(x) for x in domains.split(",")]
            except ValueError:
                raise LayoutError(f"RESHARD_DOMAINS={domains!r}: expected the domain of rank "
                                  "0, 1, ... as comma-separated integers, e.g. 0,0,1,1"
                                  ) from None
            return cls(domains=dict(enumerate(ids)))
        if size:
            if not size.isdigit() or int(size) < 1:
                raise LayoutError(f"RESHARD_DOMAIN_SIZE={size!r}: expected a positive "
                                  "integer (ranks per domain, e.g. 8)")
            return cls.uniform(int(size))
        return default

    @classmethod
    def detect(cls, comm: Any, key: Callable[[], str] | None = None, *,
               env: Mapping[str, str] | None = None) -> Topology:
        """Ranks that report the same host (and network namespace) share a domain.
        The environment variables of :meth:`from_env` override it; every rank must then
        have the same setting. Collective over ``comm``: a bad or differing setting
        raises the same :class:`LayoutError` on every rank."""
        env = os.environ if env is None else env
        override, problem = None, None
        try:
            override = cls.from_env(env=env)
            if override is not None and override.domains is not None \
                    and len(override.domains) != comm.size:
                problem = (f"RESHARD_DOMAINS names the domains of {len(override.domains)} "
                           f"ranks, but the group has {comm.size}")
        except LayoutError as e:
            problem = str(e)
        setting = " ".join(f"{k}={env[k].strip()}" for k in ENV_VARS
                           if env.get(k, "").strip()) or "no setting"
        views = comm.all_gather_object((setting, (key or _host_key)(), problem))
        bad = [(r, p) for r, (_, _, p) in enumerate(views) if p]
        if bad:
            r, p = bad[0]
            raise LayoutError(f"rank {r}: {p}")
        settings = {s for s, _, _ in views}
        if len(settings) > 1:
            who = "; ".join(f"{s} on ranks "
                            f"{[r for r, v in enumerate(views) if v[0] == s]}"
                            for s in sorted(settings))
            raise LayoutError(f"the ranks' fast-domain settings differ ({who}): set "
                              "RESHARD_DOMAINS or RESHARD_DOMAIN_SIZE alike on every rank, "
                              "or on none")
        if override is not None:
            return override
        ids: dict[str, int] = {}
        return cls(domains={r: ids.setdefault(n, len(ids)) for r, (_, n, _) in enumerate(views)})

    def link_gbps(self, domain: int) -> float:
        """The rate of one domain's network link (GB/s)."""
        return (self.domain_gbps or {}).get(domain, self.inter_gbps)

    def domain(self, rank: int) -> int:
        if self.domain_size is not None:
            return rank // self.domain_size
        try:
            return self.domains[rank]  # type: ignore[index]
        except KeyError:
            raise LayoutError(f"rank {rank} has no domain in this topology") from None


def _host_key() -> str:
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{socket.gethostname()}|{netns}"


@dataclass
class _Loads:
    send: dict[int, int] = field(default_factory=dict)
    recv: dict[int, int] = field(default_factory=dict)

    def pick(self, ranks: Iterable[int], table: dict[int, int], nbytes: int) -> int:
        best = min(ranks, key=lambda r: (table.get(r, 0), r))
        table[best] = table.get(best, 0) + nbytes
        return best


def domain_schedule(plan: Plan, topology: Topology, budget_bytes: int,
                    staging_bytes: int | None = None, *, fanout: str = "auto",
                    same_source: Mapping[str, str] | None = None) -> Schedule:
    """The ``reshard`` schedule: network once per destination domain, then forward.
    With every rank in one domain there is no network to save: the flat schedule.
    ``staging_bytes`` caps what a round stages on a receiver for the hops that are not
    network chunks or their forwards (those are cut to a sixth of the budget anyway;
    :func:`reshard.schedule.pack_rounds`). ``fanout``: how domains that need the same
    region are fed, ``direct`` from the sources or ``relay``ed domain to domain
    (:mod:`reshard.fanout`; ``auto``: the cost model's choice); ``same_source``: see
    there."""
    check_fanout(fanout)
    src, dst = plan.ranks()
    if len({topology.domain(r) for r in src | dst}) <= 1:
        from reshard.schedule import flat_schedule

        return replace(flat_schedule(plan, budget_bytes, staging_bytes), method="reshard")
    mode = choose_fanout(plan, topology, budget_bytes, fanout, same_source)
    loads = _Loads()
    chains: list[list[tuple[Hop, list[Hop]]]] = []
    for region in regions(plan, same_source):
        chains.extend(_region_hops(region, topology, loads, mode == "relay"))
    return Schedule(_pack_chains(chains, budget_bytes, plan, staging_bytes), "reshard",
                    budget_bytes, mode)


Stage = tuple[Hop, list[Hop]]  # a hop into a domain, then its forwards inside it


def _region_hops(region: Region, topo: Topology, loads: _Loads,
                 relay: bool) -> list[list[Stage]]:
    """Chains of stages for one region: local copies and fast-link hops (one stage,
    no forwards), one chain per far domain (direct) or one chain through all of them in
    domain order, the same order for every region (relay: each domain link then carries
    one stream each way, :mod:`reshard.fanout`)."""
    t0, ui = region.members[0]
    u = t0.template.units[ui]
    holders = {t0.src.ranks[s]: off for s, off in u.holders}
    out: list[list[Stage]] = []
    for t, _ in region.members:
        for k, dst_slot, dst_off in u.local:
            r = t.dst.ranks[dst_slot]
            out.append([(Hop(t.name, r, r, u.holders[k][1], dst_off, u.size, u.nbytes), [])])
    far: list[int] = []
    by_domain = region.needers(topo.domain)
    for dom in sorted(by_domain):
        near = [h for h in holders if topo.domain(h) == dom]
        if not near:
            far.append(dom)
            continue
        for name, r, dst_off in by_domain[dom]:  # co-located source: fast links only
            s = loads.pick(near, loads.send, u.nbytes)
            out.append([(Hop(name, s, r, holders[s], dst_off, u.size, u.nbytes), [])])
    chain: list[Stage] = []
    for dom in far:
        needers = by_domain[dom]
        receiver = loads.pick([r for _, r, _ in needers], loads.recv, u.nbytes)
        name, _, recv_off = next(n for n in needers if n[1] == receiver)
        if relay and chain:  # from the previous domain's receiver, what it received
            up = chain[-1][0]
            feed = Hop(name, up.dst_rank, receiver, up.dst_offset, recv_off, u.size,
                       u.nbytes, DEST, read_name="" if up.name == name else up.name)
        else:
            sender = loads.pick(sorted(holders), loads.send, u.nbytes)
            feed = Hop(name, sender, receiver, holders[sender], recv_off, u.size, u.nbytes)
        forwards = [Hop(n, receiver, r, recv_off, off, u.size, u.nbytes, DEST,
                        read_name="" if n == name else name)
                    for n, r, off in needers if (n, r) != (name, receiver)]
        chain.append((feed, forwards))
        if not relay:
            out.append(chain)
            chain = []
    if chain:
        out.append(chain)
    return out


def _pack_chains(chains: list[list[Stage]], budget: int, plan: Plan,
                 staging_bytes: int | None = None) -> tuple[tuple[Hop, ...], ...]:
    """Place each network hop (split into chunks), then its forwards after its last
    chunk. A round gives the network at most a third of the budget, leaving the rest to
    forward the previous round's chunks: the two stages overlap round by round. In a
    relay chain, chunk ``c`` of each domain's feed waits for the round that brought
    chunk ``c`` into the domain before it: the chain is a pipeline of chunks."""
    packer = RoundPacker(budget, network_cap=max(1, budget // 3), staging_cap=staging_bytes)
    chunk = max(1, budget // 6)
    for chain in chains:
        hop, forwards = chain[0]
        if len(chain) == 1 and not forwards:  # local, fast-link, or a lone receiver
            for part in split_hop(hop, max(1, budget // 2)):
                add_capped(packer, part, plan, staging_bytes)
            continue
        arrived: list[int] = []
        for hop, forwards in chain:
            parts = split_hop(hop, chunk)
            if arrived:
                parts = [replace(p, after=a) for p, a in zip(parts, arrived)]
            arrived = [packer.add(p, network=True, solo=is_solo(p, plan)) for p in parts]
            for fwd in forwards:
                for part in split_hop(fwd, chunk):
                    part = replace(part, after=max(arrived))
                    packer.add(part, solo=is_solo(part, plan))
    return packer.result()


def link_bytes(schedule: Schedule, topology: Topology) -> dict[str, int]:
    """Bytes per link class: ``inter`` (between domains), ``intra`` (inside a domain,
    between ranks) and ``local`` (inside a rank)."""
    out = {"inter": 0, "intra": 0, "local": 0}
    for _, h in schedule.hops():
        if h.is_local:
            out["local"] += h.nbytes
        elif topology.domain(h.src_rank) == topology.domain(h.dst_rank):
            out["intra"] += h.nbytes
        else:
            out["inter"] += h.nbytes
    return out


def inter_domain_lower_bound(plan: Plan, topology: Topology) -> int:
    """Each destination domain must receive, over the network, every byte its ranks need
    that no source rank of that domain (nor the needing rank itself) holds."""
    total = 0
    for t in plan.tensors:
        for u in t.template.units:
            held = {topology.domain(t.src.ranks[s]) for s, _ in u.holders}
            need = {topology.domain(t.dst.ranks[s]) for s, _ in u.remote}
            total += u.nbytes * len(need - held)
    return total
