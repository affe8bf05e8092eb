"""Emulated multi-node cluster on one machine, built from Linux network namespaces.

Each emulated node is a network namespace with loopback up and one veth link
(``eth0`` inside) whose other end sits on a Linux bridge in the root namespace.
Both directions of every node link are rate limited with ``tc tbf`` (optionally
with a ``netem`` delay under it), so traffic between nodes crosses a slow,
shaped "inter-node network" while traffic inside one node stays on the fast
local route (loopback), like NVLink vs InfiniBand.

With ``nics_per_node=n`` each node gets ``n`` such links instead (``eth0`` ..
``eth{n-1}``, each with its own address and its own rate limit), as a GPU node has
one network card per GPU. A process inside the node picks its card with
:func:`use_card`: gloo then listens on the card's address (``GLOO_SOCKET_IFNAME``),
and routing rules send everything the process sends out of that card. Gloo does not
bind the sockets it connects, so the rule for those matches the socket's owner: the
process's filesystem uid (``setfsuid``), one per card, which is also what the kernel
records as the owner of every socket the process makes. Traffic to a card's address
comes in through that card.

Requires root (CAP_NET_ADMIN / CAP_SYS_ADMIN) plus the ``ip`` and ``tc`` tools
from iproute2; :func:`netns_unavailable_reason` says whether this host can do it.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from reshard.errors import ConfigError

__all__ = [
    "EmulatedCluster", "NetnsUnavailableError", "cards_unavailable_reason", "enter_namespace",
    "netns_unavailable_reason", "use_card",
]

CARD_UID_BASE = 61000
"""Card ``j``'s routing rule matches sockets owned by uid ``CARD_UID_BASE + j``."""

_IFNAMSIZ = 15  # longest Linux interface name
_instances = itertools.count()  # distinguishes clusters alive at once in one process


class NetnsUnavailableError(RuntimeError):
    """Network namespaces, veth, bridge or tc cannot be set up on this host."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a short command, capturing output; raise ``RuntimeError`` on failure if ``check``."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"`{' '.join(argv)}` failed (rc={proc.returncode}): {msg}")
    return proc


def _quiet(*argv: str) -> None:
    """Run a cleanup command, ignoring every failure (it may have nothing to remove)."""
    with contextlib.suppress(Exception):
        _run(*argv, check=False)


def netns_unavailable_reason() -> str | None:
    """Return ``None`` if an :class:`EmulatedCluster` can be built here, else why not.

    Checks for root, the ``ip`` and ``tc`` tools, then really creates and deletes a
    throwaway namespace, veth pair, bridge and ``tbf`` qdisc.
    """
    if os.geteuid() != 0:
        return f"network namespaces need root (CAP_NET_ADMIN); running as uid {os.geteuid()}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found on PATH (install iproute2)"
    tag = f"rshprobe{os.getpid() % 10_000_000}"[:_IFNAMSIZ - 1]
    ns, veth, br = tag + "n", tag + "v", tag + "b"
    try:
        _quiet("ip", "netns", "del", ns)
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", br, "type", "bridge")
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", veth, "master", br)
        _run("tc", "qdisc", "add", "dev", veth, "root", "tbf",
             "rate", "100mbit", "burst", "128kb", "latency", "50ms")
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return f"cannot set up network namespaces/veth/bridge/tc here: {exc}"
    finally:
        _quiet("ip", "link", "del", veth)
        _quiet("ip", "link", "del", br)
        _quiet("ip", "netns", "del", ns)
    return None


#: How a node link queues (``EmulatedCluster(link=...)``).
LINKS = ("tbf", "ack-first")


class EmulatedCluster:
    """``num_nodes`` network namespaces joined by a rate-limited bridge.

    Use as a context manager; everything is created on enter and removed on exit
    (also on exceptions, and from ``atexit`` as a last resort)::

        with EmulatedCluster(2, rate_mbit=400) as cluster:
            p = cluster.popen(0, [sys.executable, "worker.py"],
                              env={**os.environ, "GLOO_SOCKET_IFNAME": cluster.iface})

    Node ``i`` has address :meth:`node_addr` on interface :attr:`iface`. Traffic
    between processes of one node uses the local route (fast); traffic between
    nodes crosses two shaped veth links and the bridge (``rate_mbit`` each way).
    With ``nics_per_node=n``, card ``j`` of node ``i`` is :meth:`nic_name` ``(j)``
    with address :meth:`nic_addr` ``(i, j)``, each card shaped to ``rate_mbit``.
    ``queue_ms``: the longest a packet waits in a link's queue (tbf's ``latency``: the
    queue holds that many milliseconds of traffic at the rate; more is dropped).
    ``link``: how a link queues (:data:`LINKS`): ``"tbf"``, one FIFO for everything a
    node sends (the acknowledgements of what it receives wait behind its own data);
    ``"ack-first"``, the same rate and queue, but pure TCP acknowledgements go ahead of
    the data (``htb`` with two classes and a ``u32`` filter), as on a NIC whose
    acknowledgements do not queue behind bulk traffic.
    ``congestion``: the TCP congestion control inside every node (one of the host's
    ``net.ipv4.tcp_allowed_congestion_control``); by default the host's own.
    """

    iface = "eth0"
    """Interface name inside every namespace (use it for ``GLOO_SOCKET_IFNAME``)."""

    def __init__(
        self,
        num_nodes: int,
        *,
        rate_mbit: float = 1000.0,
        delay_ms: float = 0.0,
        prefix: str = "rsh",
        nics_per_node: int = 1,
        queue_ms: float = 50.0,
        link: str = "tbf",
        congestion: str | None = None,
    ) -> None:
        if not 1 <= num_nodes <= 250:
            raise ConfigError(f"num_nodes must be in [1, 250], got {num_nodes}")
        if nics_per_node < 1 or num_nodes * nics_per_node > 250:
            raise ConfigError(f"need nics_per_node >= 1 and at most 250 cards in all, got "
                             f"{nics_per_node} per node on {num_nodes} nodes")
        if link not in LINKS:
            raise ConfigError(f"link must be one of {LINKS}, got {link!r}")
        if link == "ack-first" and delay_ms > 0:
            raise ConfigError("link='ack-first' has no netem delay: use delay_ms=0")
        if rate_mbit <= 0 or delay_ms < 0 or queue_ms <= 0:
            raise ConfigError(f"need rate_mbit > 0, delay_ms >= 0 and queue_ms > 0, got "
                              f"{rate_mbit}, {delay_ms}, {queue_ms}")
        pid = os.getpid()
        tag = f"{prefix}{pid}{chr(ord('a') + next(_instances) % 26)}"
        longest = f"v{num_nodes - 1}" + (f"n{nics_per_node - 1}" if nics_per_node > 1 else "")
        if len(tag) + max(2, len(longest)) > _IFNAMSIZ:
            raise ConfigError(f"prefix {prefix!r} too long for interface names")
        self._num_nodes = num_nodes
        self.nics_per_node = nics_per_node
        self.rate_mbit = float(rate_mbit)
        self.delay_ms = float(delay_ms)
        self.queue_ms = float(queue_ms)
        self.link, self.congestion = link, congestion
        self._tag = tag
        self._subnet = f"10.213.{pid % 256}"
        self._bridge = f"{tag}br"
        self._procs: list[subprocess.Popen[Any]] = []
        self._active = False

    # -- naming ---------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Number of emulated nodes."""
        return self._num_nodes

    def _check(self, i: int) -> None:
        if not 0 <= i < self._num_nodes:
            raise IndexError(f"node {i} out of range [0, {self._num_nodes})")

    def ns_name(self, i: int) -> str:
        """Name of node ``i``'s network namespace (unique per process and instance)."""
        self._check(i)
        return f"{self._tag}n{i}"

    def node_addr(self, i: int) -> str:
        """IPv4 address of node ``i`` on :attr:`iface` (its first card)."""
        return self.nic_addr(i, 0)

    def nic_name(self, j: int) -> str:
        """Interface name of card ``j`` inside every node (for ``GLOO_SOCKET_IFNAME``)."""
        if not 0 <= j < self.nics_per_node:
            raise IndexError(f"card {j} out of range [0, {self.nics_per_node})")
        return card_iface(j)

    def nic_addr(self, i: int, j: int) -> str:
        """IPv4 address of card ``j`` of node ``i``."""
        self._check(i)
        self.nic_name(j)
        return f"{self._subnet}.{i * self.nics_per_node + j + 1}"

    def _host_veth(self, i: int, j: int = 0) -> str:
        return f"{self._tag}v{i}" + (f"n{j}" if self.nics_per_node > 1 else "")

    # -- running processes ----------------------------------------------------------------

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so it runs inside node ``i``'s namespace."""
        return ["ip", "netns", "exec", self.ns_name(i), *argv]

    def popen(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside node ``i``; still-running processes are killed on exit."""
        if not self._active:
            raise RuntimeError("EmulatedCluster is not entered")
        proc = subprocess.Popen(self.command(i, argv), env=None if env is None else dict(env), **kw)
        self._procs.append(proc)
        return proc

    # -- setup / teardown -----------------------------------------------------------------

    def _shape(self, prefix: Sequence[str], dev: str) -> None:
        """Put a tbf rate limit (plus an optional netem delay) on egress of ``dev``."""
        rate_bytes = self.rate_mbit * 1e6 / 8
        # Burst of ~4 ms of traffic, at least 64 KiB + MTU so one GSO skb always fits.
        burst = max(int(rate_bytes * 0.004), 66_000)
        if self.link == "ack-first":
            self._shape_ack_first(prefix, dev, rate_bytes, burst)
            return
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf",
             "rate", f"{self.rate_mbit}mbit", "burst", str(burst),
             "latency", f"{self.queue_ms:g}ms")
        if self.delay_ms > 0:
            _run(*prefix, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                 "netem", "delay", f"{self.delay_ms}ms")

    def _shape_ack_first(self, prefix: Sequence[str], dev: str, rate_bytes: float,
                         burst: int) -> None:
        """The link's rate shared by two classes: pure TCP acknowledgements (IPv4, no
        IP options, under 64 bytes, the ACK flag alone) first, everything else after,
        in a FIFO of ``queue_ms`` of traffic."""
        tc = (*prefix, "tc")
        rate, quantum = f"{self.rate_mbit}mbit", "1514"
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
             "rate", rate, "burst", str(burst), "cburst", str(burst), "quantum", quantum)
        for cls, share, prio in (("1:10", 0.05, "0"), ("1:20", 0.95, "1")):
            _run(*tc, "class", "add", "dev", dev, "parent", "1:1", "classid", cls, "htb",
                 "rate", f"{self.rate_mbit * share:g}mbit", "ceil", rate, "prio", prio,
                 "burst", str(burst), "cburst", str(burst), "quantum", quantum)
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f",
             "at", "0", "match", "u16", "0x0000", "0xffc0", "at", "2", "match", "u8", "0x10",
             "0xff", "at", "33", "flowid", "1:10")
        limit = max(int(rate_bytes * self.queue_ms / 1000), 2 * burst)
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo",
             "limit", str(limit))

    def _setup(self) -> None:
        _run("ip", "link", "add", self._bridge, "type", "bridge")
        _run("ip", "link", "set", self._bridge, "up")
        several = self.nics_per_node > 1
        for i in range(self._num_nodes):
            ns = self.ns_name(i)
            in_ns = ("ip", "netns", "exec", ns)
            _run("ip", "netns", "add", ns)
            _run(*in_ns, "ip", "link", "set", "lo", "up")
            if self.congestion:  # this namespace's own setting; the host's is untouched
                _run(*in_ns, "sysctl", "-qw",
                     f"net.ipv4.tcp_congestion_control={self.congestion}")
            if several:  # each card answers ARP for its own address only; no reverse-path
                # filter (replies to a card's address may come in on another card)
                _run(*in_ns, "sysctl", "-qw", "net.ipv4.conf.all.arp_ignore=1",
                     "net.ipv4.conf.all.arp_announce=2", "net.ipv4.conf.all.rp_filter=0",
                     "net.ipv4.conf.default.rp_filter=0")
            for j in range(self.nics_per_node):
                hv, dev, addr = self._host_veth(i, j), self.nic_name(j), self.nic_addr(i, j)
                _run("ip", "link", "add", hv, "type", "veth", "peer", "name", dev, "netns", ns)
                _run("ip", "link", "set", hv, "master", self._bridge)
                _run("ip", "link", "set", hv, "up")
                _run(*in_ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
                _run(*in_ns, "ip", "link", "set", dev, "up")
                if several:  # sockets of the card's user, or answering at its address,
                    # leave by the card, with its address
                    table = str(100 + j)
                    uid = str(CARD_UID_BASE + j)
                    _run(*in_ns, "ip", "rule", "add", "from", addr, "table", table)
                    _run(*in_ns, "ip", "rule", "add", "uidrange", f"{uid}-{uid}", "table", table)
                    _run(*in_ns, "ip", "route", "add", f"{self._subnet}.0/24", "dev", dev,
                         "src", addr, "table", table)
                self._shape(in_ns, dev)  # node -> network
                self._shape((), hv)  # network -> node

    def close(self) -> None:
        """Kill processes started here and remove namespaces, veths and bridge (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._procs.clear()
        for i in range(self._num_nodes):
            ns = self.ns_name(i)
            # Stray descendants of our processes still living in the namespace.
            with contextlib.suppress(Exception):
                pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
                for pid in pids:
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            for j in range(self.nics_per_node):
                _quiet("ip", "link", "del", self._host_veth(i, j))
            _quiet("ip", "netns", "del", ns)
        _quiet("ip", "link", "del", self._bridge)
        if self._active:
            atexit.unregister(self.close)
            self._active = False

    def __enter__(self) -> EmulatedCluster:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        self.close()  # stale leftovers with our names (e.g. a reused pid)
        self._active = True
        atexit.register(self.close)
        try:
            self._setup()
        except Exception as exc:
            self.close()
            hint = ""
            if self.delay_ms > 0 and "netem" in str(exc):
                hint = " (delay_ms > 0 needs the sch_netem kernel module)"
            raise NetnsUnavailableError(f"emulated cluster setup failed: {exc}{hint}") from exc
        time.sleep(0.05)  # let links come up before callers connect
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EmulatedCluster(num_nodes={self._num_nodes}, rate_mbit={self.rate_mbit}, "
                f"delay_ms={self.delay_ms}, nics_per_node={self.nics_per_node}, "
                f"tag={self._tag!r})")


def enter_namespace(name: str) -> None:
    """Move the calling process into network namespace ``name`` (for forked workers)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newnet = 0x40000000
    with open(f"/var/run/netns/{name}") as f:
        if libc.setns(f.fileno(), clone_newnet) != 0:
            err = ctypes.get_errno()
            raise NetnsUnavailableError(f"setns into {name} failed: {os.strerror(err)}")


def card_iface(j: int) -> str:
    """The interface name of card ``j`` inside every emulated node (card 0 is
    :attr:`EmulatedCluster.iface`, a node's one link by default)."""
    return f"eth{j}"


def use_card(j: int) -> None:
    """Make the calling process, already inside a node of an :class:`EmulatedCluster`
    with several cards, send and receive through card ``j``: gloo listens on its
    address and every socket the process makes is routed out of it. Sets
    ``GLOO_SOCKET_IFNAME`` and the filesystem uid (files are then read and written as
    that unprivileged uid: call it after the process has what it needs from disk)."""
    import ctypes

    _check_world_readable()
    os.environ["GLOO_SOCKET_IFNAME"] = card_iface(j)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setfsuid(CARD_UID_BASE + j)
    if libc.setfsuid(-1) != CARD_UID_BASE + j:  # -1 changes nothing and returns the current
        raise NetnsUnavailableError(f"setfsuid({CARD_UID_BASE + j}) failed")


def cards_unavailable_reason() -> str | None:
    """``None`` if processes can run on their own card (:func:`use_card`), else why not."""
    try:
        _check_world_readable()
    except NetnsUnavailableError as e:
        return str(e)
    return None


def _check_world_readable() -> None:
    """The process keeps importing after :func:`use_card` (torch loads modules lazily),
    now as an unprivileged uid: the Python environment and this package must be
    readable by other users."""
    import stat
    import sys
    from pathlib import Path

    # in this order, always (a set's order changes with the process's hash seed): the
    # environment first, then this package
    for top in dict.fromkeys((Path(sys.prefix), Path(__file__).resolve().parent)):
        for d in [top, *top.parents]:
            st = d.stat()
            # the unprivileged uid keeps this process's group: where the directory
            # belongs to that group, its group bits decide, not the others' bits
            if st.st_gid == os.getegid():
                need = stat.S_IXGRP | (stat.S_IRGRP if d == top else 0)
            else:
                need = stat.S_IXOTH | (stat.S_IROTH if d == top else 0)
            mode = st.st_mode
            if mode & need != need:
                raise NetnsUnavailableError(
                    f"a card per rank runs each rank with an unprivileged filesystem uid, "
                    f"which cannot read {top}: {d} has mode {stat.filemode(mode)} (let "
                    f"other users read it, e.g. chmod go+rx, or use one link per node)")
