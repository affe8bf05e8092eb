"""Cluster presets for the cost model: how many GPUs share a fast domain, the bandwidth and
latency of the fast links and of the network, and where each rank of a plan sits.

Every constant below comes from hardware specifications or from NCCL's own published
behaviour (never fitted to the refit results it is later compared with):

* NVLink: H100 SXM has 18 NVLink-4 links of 25 GB/s per direction = 450 GB/s per
  direction per GPU (NVIDIA H100 datasheet, "900 GB/s" bidirectional); GB200 has NVLink 5,
  1.8 TB/s bidirectional = 900 GB/s per direction per GPU (NVIDIA GB200 NVL72 datasheet).
  Used at face value: NCCL reaches somewhat less, so NVLink-bound predictions are
  optimistic.
* Network: one 400 Gb/s NIC per GPU (ConnectX-7 on DGX H100; the GB200 NVL72 compute
  trays also carry one 400 Gb/s NIC per GPU) = 50 GB/s line rate. We use **45 GB/s**
  effective: nccl-tests report a bus bandwidth of about 90% of line rate per 400 Gb/s
  InfiniBand NIC (~45-48 GB/s); we take the low end.
* Latency: NCCL's tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol):
  8.4 us base latency per operation, 3.4 us per NVLink hop, 9.6 us per network hop.
* Ring pipeline step: NCCL's Simple protocol moves a ring's data in steps of
  ``NCCL_BUFFSIZE`` / ``NCCL_STEPS`` = 4 MiB / 8 = 512 KiB per channel (NCCL defaults,
  src/init.cc and src/include/device.h); a broadcast only ever uses the ring algorithm.
* GPU memory (NeMo RL's broadcast buffers are 2% of it): H100 SXM 80 GB (H100
  datasheet); GB200 186 GB HBM3e per GPU (13.4 TB over 72 GPUs, GB200 NVL72 datasheet).

The ``emulated`` cluster describes this repository's emulated nodes (network namespaces
joined by rate-limited veth links, see :mod:`reshard.tools.netns`); its constants are measured
on the machine by ``benchmarks/validate_costmodel.py`` (bare sends, no refit), and the
preset below holds one such measurement for ``--cluster emulated``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

from reshard.errors import ClusterError

__all__ = ["CLUSTERS", "Cluster", "ClusterError", "RankMap", "emulated", "get_cluster"]

COLLECTIVES = ("nccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Link parameters of one kind of cluster (bandwidths in GB/s = 1e9 bytes/s)."""

    name: str
    gpus_per_domain: int
    """GPUs sharing one fast domain (an NVLink domain; an emulated node)."""
    intra_gb_per_s: float
    """Fast-link bandwidth of one GPU, per direction, inside its domain."""
    nic_gb_per_s: float
    """Effective bandwidth of one NIC, per direction."""
    gpus_per_nic: int = 1
    """GPUs sharing one NIC (1 on DGX H100 / GB200; every rank of an emulated node)."""
    intra_latency_s: float = 3.4e-6
    """Latency of one message (one hop) on the fast links."""
    nic_latency_s: float = 9.6e-6
    """Latency of one message (one hop) over the network."""
    op_latency_s: float = 8.4e-6
    """Fixed cost of one collective operation or one executor round."""
    collectives: str = "nccl"
    """Whose collective algorithms gather_broadcast uses: ``nccl`` (pipelined ring
    broadcast, one ring channel per NIC) or ``gloo`` (ring all-gather over one TCP
    connection per neighbour, binomial-tree broadcast, store and forward)."""
    ring_step_bytes: int = 512 * 1024
    """One pipeline step of an NCCL ring (Simple protocol: ``NCCL_BUFFSIZE`` 4 MiB over
    ``NCCL_STEPS`` 8): each hop of a ring broadcast holds a whole step before forwarding
    it, so a long ring fills for one step per hop before its bandwidth counts."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU (NeMo RL sizes its broadcast buffers from it); None: unknown."""
    shared_intra_gb_per_s: float | None = None
    """Cap on all intra-domain traffic of the whole cluster at once (the emulated nodes'
    loopback copies share the host's CPU cores); None on real hardware."""
    intra_name: str = "NVLink"
    nic_name: str = "NIC"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("gpus_per_domain", "gpus_per_nic"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ClusterError(f"cluster {self.name!r}: {name} must be an int >= 1, "
                                   f"got {value!r}")
        for name in ("intra_gb_per_s", "nic_gb_per_s"):
            if not getattr(self, name) > 0:
                raise ClusterError(f"cluster {self.name!r}: {name} must be > 0, "
                                   f"got {getattr(self, name)!r}")
        if self.shared_intra_gb_per_s is not None and not self.shared_intra_gb_per_s > 0:
            raise ClusterError(f"cluster {self.name!r}: shared_intra_gb_per_s must be > 0 or "
                               f"None, got {self.shared_intra_gb_per_s!r}")
        if not isinstance(self.ring_step_bytes, int) or self.ring_step_bytes < 0:
            raise ClusterError(f"cluster {self.name!r}: ring_step_bytes must be an int >= 0, "
                               f"got {self.ring_step_bytes!r}")
        if self.gpu_memory_gb is not None and not self.gpu_memory_gb > 0:
            raise ClusterError(f"cluster {self.name!r}: gpu_memory_gb must be > 0 or None, "
                               f"got {self.gpu_memory_gb!r}")
        if self.collectives not in COLLECTIVES:
            raise ClusterError(f"cluster {self.name!r}: collectives must be one of "
                               f"{COLLECTIVES}, got {self.collectives!r}")

    @property
    def nics_per_domain(self) -> int:
        return -(-self.gpus_per_domain // self.gpus_per_nic)

    def place(self, src_ranks: Iterable[int], dst_ranks: Iterable[int], *,
              separate: bool = True) -> RankMap:
        """Put a plan's ranks on this cluster. With ``separate`` (the default: trainer and
        inference GPUs are different machines) each side fills whole domains of its own,
        trainer ranks first; otherwise, or when the sides share ranks, rank ``r`` sits in
        domain ``r // gpus_per_domain``."""
        src, dst = sorted(set(src_ranks)), sorted(set(dst_ranks))
        size = 1 + max([*src, *dst], default=-1)
        domain, slot = [-1] * size, [0] * size
        if separate and not set(src) & set(dst):
            first = -(-len(src) // self.gpus_per_domain)
            for base, side in ((0, src), (first, dst)):
                for i, r in enumerate(side):
                    domain[r] = base + i // self.gpus_per_domain
                    slot[r] = i % self.gpus_per_domain
        else:
            for r in {*src, *dst}:
                domain[r], slot[r] = divmod(r, self.gpus_per_domain)
        nic = [d * self.nics_per_domain + s // self.gpus_per_nic if d >= 0 else -1
               for d, s in zip(domain, slot)]
        return RankMap(tuple(domain), tuple(nic))


@dataclass(frozen=True)
class RankMap:
    """Where every rank of a plan sits: its domain and its NIC (-1: not in the plan)."""

    domain: tuple[int, ...]
    nic: tuple[int, ...]

    @classmethod
    def from_domains(cls, domains: dict[int, int] | list[int], gpus_per_nic: int = 1) -> RankMap:
        """Explicit rank -> domain; ranks of one domain share NICs in rank order."""
        items = dict(enumerate(domains)) if isinstance(domains, list) else dict(domains)
        size = 1 + max(items, default=-1)
        domain, nic, seen = [-1] * size, [-1] * size, {}
        for r in sorted(items):
            d = domain[r] = items[r]
            k = seen[d] = seen.get(d, -1) + 1
            nic[r] = (d, k // gpus_per_nic)
        ids: dict[Any, int] = {}
        return cls(tuple(domain), tuple(ids.setdefault(n, len(ids)) if n != -1 else -1
                                        for n in nic))

    def topology(self):
        """The same placement as a :class:`reshard.topology.Topology` (for schedules)."""
        from reshard.topology import Topology

        return Topology(domains={r: d for r, d in enumerate(self.domain) if d >= 0})


def emulated(*, nic_gb_per_s: float, intra_gb_per_s: float, latency_s: float,
             shared_intra_gb_per_s: float | None, gpus_per_node: int,
             source: str = "measured") -> Cluster:
    """The emulated nodes of :mod:`reshard.tools.netns`: one shaped link per node (shared by all
    its ranks), loopback inside a node, gloo collectives."""
    return Cluster(name="emulated", gpus_per_domain=gpus_per_node, gpus_per_nic=gpus_per_node,
                   intra_gb_per_s=intra_gb_per_s, nic_gb_per_s=nic_gb_per_s,
                   intra_latency_s=latency_s, nic_latency_s=latency_s, op_latency_s=latency_s,
                   collectives="gloo", shared_intra_gb_per_s=shared_intra_gb_per_s,
                   intra_name="loopback", nic_name="node link", source=source)


_NCCL_LATENCY = "NCCL src/graph/tuning.cc ring/Simple latencies"
CLUSTERS: dict[str, Cluster] = {
    "dgx-h100": Cluster(
        name="dgx-h100", gpus_per_domain=8, intra_gb_per_s=450.0, nic_gb_per_s=45.0,
        gpu_memory_gb=80.0,
        source="H100 SXM NVLink 4 (450 GB/s/dir), 8x ConnectX-7 400 Gb/s (45 GB/s "
               f"effective); {_NCCL_LATENCY}"),
    "gb200-nvl72": Cluster(
        name="gb200-nvl72", gpus_per_domain=72, intra_gb_per_s=900.0, nic_gb_per_s=45.0,
        gpu_memory_gb=186.0,
        source="GB200 NVLink 5 (900 GB/s/dir), one 400 Gb/s NIC per GPU (45 GB/s "
               f"effective); {_NCCL_LATENCY}"),
    # One measurement of this machine's emulated nodes (500 Mbit/s links, 2 CPU cores);
    # benchmarks/validate_costmodel.py re-measures before it predicts anything.
    "emulated": emulated(nic_gb_per_s=0.060, intra_gb_per_s=1.5, latency_s=1.2e-3,
                         shared_intra_gb_per_s=2.2, gpus_per_node=4,
                         source="bare gloo sends between network namespaces, 500 Mbit/s"),
}

_CUSTOM_KEYS = {"domain": "gpus_per_domain", "intra": "intra_gb_per_s",
                "nic": "nic_gb_per_s", "gpus_per_nic": "gpus_per_nic",
                "intra_lat_us": "intra_latency_s", "nic_lat_us": "nic_latency_s",
                "op_lat_us": "op_latency_s", "collectives": "collectives",
                "shared_intra": "shared_intra_gb_per_s", "name": "name",
                "ring_step": "ring_step_bytes", "gpu_memory": "gpu_memory_gb"}


def get_cluster(spec: str | Cluster) -> Cluster:
    """A preset by name, or ``custom:domain=8,intra=450,nic=45[,gpus_per_nic=1,
    intra_lat_us=3.4,nic_lat_us=9.6,op_lat_us=8.4,collectives=nccl,shared_intra=...]``;
    ``PRESET:key=value,...`` overrides fields of a preset."""
    if isinstance(spec, Cluster):
        return spec
    name, _, args = spec.partition(":")
    if name == "custom":
        base = Cluster(name="custom", gpus_per_domain=8, intra_gb_per_s=450.0,
                       nic_gb_per_s=45.0, source="custom")
    elif name in CLUSTERS:
        base = CLUSTERS[name]
    else:
        raise ClusterError(f"unknown cluster {spec!r}; expected one of "
                           f"{', '.join([*CLUSTERS, 'custom:domain=8,intra=450,nic=45'])}")
    return replace(base, **_parse_overrides(spec, args)) if args else base


def _parse_overrides(spec: str, args: str) -> dict[str, Any]:
    types = {f.name: f.type for f in fields(Cluster)}
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key not in _CUSTOM_KEYS:
            raise ClusterError(f"bad cluster {spec!r}: expected key=value with a key in "
                               f"{sorted(_CUSTOM_KEYS)}, got {part!r}")
        field_name = _CUSTOM_KEYS[key]
        kind = str(types[field_name])
        try:
            if field_name in ("name", "collectives"):
                out[field_name] = value
            elif kind == "int":
                out[field_name] = int(value)
            else:
                out[field_name] = float(value) * (1e-6 if key.endswith("_us") else 1.0)
        except ValueError:
            raise ClusterError(f"bad cluster {spec!r}: {key} expects a number, "
                               f"got {value!r}") from None
    return out
