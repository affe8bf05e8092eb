"""What the cost model's methods share: the cluster seen per rank (:class:`Net`: domains,
NICs, link capacities, the most loaded link of a set of loads), per-link byte loads, a
method's :class:`Prediction`, and NCCL's pipelined ring over a list of ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reshard.sim.cluster import Cluster, RankMap

__all__ = ["LinkLoads", "Net", "Prediction", "ring", "ring_fill"]


@dataclass(frozen=True)
class LinkLoads:
    """Bytes per link class: NIC out / in per NIC, fast links out / in per rank."""

    nic_out: np.ndarray
    nic_in: np.ndarray
    intra_out: np.ndarray
    intra_in: np.ndarray

    @property
    def network_bytes(self) -> float:
        return float(self.nic_in.sum())

    @property
    def intra_bytes(self) -> float:
        return float(self.intra_in.sum())


@dataclass(frozen=True)
class Prediction:
    """One method's predicted refit time and what limits it."""

    method: str
    seconds: float
    bottleneck: str
    """The slowest link, in words (link class and rank)."""
    link: str
    """Its class: nic_out, nic_in, intra_out, intra_in, intra_shared, or a collective's."""
    rank: int | None
    lower_bound_s: float
    stages: dict[str, float] = field(default_factory=dict)
    loads: LinkLoads | None = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("method", "seconds", "bottleneck", "link", "rank",
                                             "lower_bound_s", "stages")}
        if self.loads is not None:
            out["network_bytes"] = self.loads.network_bytes
            out["intra_bytes"] = self.loads.intra_bytes
        return out




class Net:
    """The cluster seen per rank: domain and NIC arrays, link capacities."""

    def __init__(self, cluster: Cluster, ranks: RankMap) -> None:
        self.cluster = cluster
        self.domain = ranks.domain
        self.nic = ranks.nic
        self.num_ranks = len(ranks.domain)
        self.num_nics = 1 + max(ranks.nic, default=-1)
        self.dom_arr = np.asarray(ranks.domain, dtype=np.int64)
        self.nic_arr = np.asarray(ranks.nic, dtype=np.int64)
        self.nic_bw = cluster.nic_gb_per_s * 1e9
        self.intra_bw = cluster.intra_gb_per_s * 1e9
        shared = cluster.shared_intra_gb_per_s
        self.shared_bw = None if shared is None else shared * 1e9

    def loads(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> LinkLoads:
        """Link loads of transfers src[i] -> dst[i] of nbytes[i] (local ones ignored)."""
        cross = self.dom_arr[src] != self.dom_arr[dst]
        inside = ~cross & (src != dst)
        n, k = self.num_ranks, max(self.num_nics, 1)
        return LinkLoads(
            np.bincount(self.nic_arr[src[cross]], nbytes[cross], minlength=k),
            np.bincount(self.nic_arr[dst[cross]], nbytes[cross], minlength=k),
            np.bincount(src[inside], nbytes[inside], minlength=n),
            np.bincount(dst[inside], nbytes[inside], minlength=n))

    def nic_ranks(self, nic: int) -> str:
        members = [r for r, k in enumerate(self.nic) if k == nic]
        who = f"rank {members[0]}" if len(members) == 1 else \
            f"ranks {members[0]}..{members[-1]}"
        return f"{who}, domain {self.domain[members[0]]}"

    def stage(self, loads: LinkLoads, parts: Sequence[str] = ("nic", "intra")
              ) -> tuple[float, str, str, int | None]:
        """(seconds, link class, words, rank) of the most loaded link among ``parts``."""
        c = self.cluster
        best: tuple[float, str, str, int | None] = (0.0, "none", "nothing to move", None)
        for cls, arr, bw, who in (
                ("nic_out", loads.nic_out, self.nic_bw, "nic"),
                ("nic_in", loads.nic_in, self.nic_bw, "nic"),
                ("intra_out", loads.intra_out, self.intra_bw, "intra"),
                ("intra_in", loads.intra_in, self.intra_bw, "intra")):
            if who not in parts or not arr.size or arr.max() <= 0:
                continue
            i = int(arr.argmax())
            t = float(arr[i]) / bw
            if t > best[0]:
                if who == "nic":
                    words = f"{c.nic_name} {cls[4:]}, {self.nic_ranks(i)}"
                    rank = next(r for r, k in enumerate(self.nic) if k == i)
                else:
                    words = f"{c.intra_name} {cls[6:]}, rank {i} (domain {self.domain[i]})"
                    rank = i
                best = (t, cls, words, rank)
        if "intra" in parts and self.shared_bw is not None:
            t = float(loads.intra_in.sum()) / self.shared_bw
            if t > best[0]:
                best = (t, "intra_shared", f"all {c.intra_name} traffic (shared host)", None)
        return best



#: NCCL's most ring channels per communicator (``MAXCHANNELS`` in NCCL 2.x's device.h):
#: a ring crosses a domain boundary through at most this many NICs at once.
MAX_RING_CHANNELS = 32


def _domain_nics(members: Sequence[int], net: Net) -> dict[int, set[int]]:
    nics: dict[int, set[int]] = {}
    for r in members:
        nics.setdefault(net.domain[r], set()).add(net.nic[r])
    return nics


def _channels(a: int, b: int, nics: dict[int, set[int]], net: Net) -> int:
    """NCCL channels across the boundary a -> b: one per NIC the ring has on both sides."""
    k = min(len(nics[net.domain[a]]), len(nics[net.domain[b]]))
    return min(k, MAX_RING_CHANNELS)


def ring(members: list[int], closed: bool, net: Net, *, nccl: bool | None = None
         ) -> tuple[float, tuple, list]:
    """(bandwidth B/s, (link class, slowest link, its rank), links) of a ring (``closed``)
    or a chain over ``members`` in that order. NCCL runs one channel per NIC the ring has
    in a domain, so a link between domains carries min(NICs on either side) x NIC
    bandwidth; gloo runs one TCP flow per link, and flows through one NIC share it.
    ``nccl`` overrides the cluster's ``collectives`` (a framework that always runs NCCL)."""
    links = list(zip(members, members[1:]))
    if closed and len(members) > 1:
        links.append((members[-1], members[0]))
    dom, nic, c = net.domain, net.nic, net.cluster
    use_nccl = c.collectives == "nccl" if nccl is None else nccl
    nics = _domain_nics(members, net)
    flows_out: dict[int, int] = {}
    flows_in: dict[int, int] = {}
    for a, b in links:
        if dom[a] != dom[b]:
            flows_out[nic[a]] = flows_out.get(nic[a], 0) + 1
            flows_in[nic[b]] = flows_in.get(nic[b], 0) + 1
    num_intra = sum(dom[a] == dom[b] for a, b in links)
    best, label = float("inf"), ("none", "no link", None)
    for a, b in links:
        if dom[a] == dom[b]:
            bw = net.intra_bw if net.shared_bw is None else min(net.intra_bw,
                                                                  net.shared_bw / num_intra)
            kind = c.intra_name
        elif use_nccl:
            k = _channels(a, b, nics, net)
            bw, kind = k * net.nic_bw, f"{k} {c.nic_name}(s) between domains"
        else:
            k = max(flows_out[nic[a]], flows_in[nic[b]])
            bw, kind = net.nic_bw / k, f"{c.nic_name} shared by {k} flow(s)"
        if bw < best:
            best, label = bw, (kind, f"rank {a} -> rank {b}", a)
    return best, label, links


def ring_fill(links: Sequence[tuple[int, int]], net: Net) -> float:
    """Seconds for the first NCCL step to reach the end of a pipelined chain (``links`` in
    order). Each hop forwards a step only once it holds all of it, so every hop adds one
    step (``cluster.ring_step_bytes``) through that hop's share of its link, plus the hop's
    latency: a step crosses a domain boundary over one NIC (one channel per NIC), and
    inside a domain over the fast links, which the ring's channels share."""
    if not links:
        return 0.0
    c = net.cluster
    members = [links[0][0], *(b for _, b in links)]
    nics = _domain_nics(members, net)
    cross = [(a, b) for a, b in links if net.domain[a] != net.domain[b]]
    channels = min((_channels(a, b, nics, net) for a, b in cross), default=1)
    step = float(c.ring_step_bytes)
    inter = step / net.nic_bw + c.nic_latency_s
    intra = step * channels / net.intra_bw + c.intra_latency_s
    return len(cross) * inter + (len(links) - len(cross)) * intra
