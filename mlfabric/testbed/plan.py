"""The layout of an emulated cluster: namespaces, veth pairs, bridges, addresses (DESIGN §6).

This module is pure: it turns a bandwidth graph (:mod:`mlfabric.scheduler.core.graph`) into a
:class:`Layout` that says which network namespaces, bridges and veth ends to create and how
to shape each end. :mod:`mlfabric.testbed.cluster` executes a layout with ``ip`` and ``tc``.

The emulation:

- every host is a network namespace; its NIC is one end of a veth pair and carries the
  host's address from ``198.18.0.0/16`` (the RFC 2544 benchmarking range);
- every switch is a namespace holding one Linux bridge whose ports are veth ends;
- every link is a veth pair. Each direction is shaped on its *sender's* egress, so the
  ``a -> b`` direction is the egress qdisc of the end in ``a`` and the ``b -> a`` direction
  the egress qdisc of the end in ``b``. A host's ingress is therefore shaped too: on the
  egress of the switch port facing it (paper §5's per-link capacities, each way);
- a separate, unshaped control network (``198.19.0.0/16``) joins every host to a control
  namespace, where the scheduler runs. Control traffic does not compete with the data
  plane, like a management network.

Hosts with more than one link, and cycles (bridges would need STP), are refused with a
:class:`LayoutError` that names the host or link.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

import networkx as nx

__all__ = [
    "CONTROL_NET",
    "DATA_NET",
    "PREFIX_PATTERN",
    "Layout",
    "LayoutError",
    "Namespace",
    "VethEnd",
    "plan_layout",
]

#: Host data-plane addresses (shaped links).
DATA_NET = ipaddress.IPv4Network("198.18.0.0/16")
#: Control network (unshaped): the scheduler and every daemon's control stream.
CONTROL_NET = ipaddress.IPv4Network("198.19.0.0/16")
#: A run prefix: ``mlf`` and 6 hex digits. The stale-namespace sweep only touches names
#: that match ``<prefix>-...`` with this pattern.
PREFIX_PATTERN = re.compile(r"^mlf[0-9a-f]{6}$")
#: Interface names are at most 15 bytes (IFNAMSIZ - 1).
IFNAME_MAX = 15
#: Name of the bridge inside a switch namespace and of the control bridge.
BRIDGE = "br0"
#: Name of a host's control-network interface.
CONTROL_IF = "ctl0"


class LayoutError(ValueError):
    """The topology cannot be emulated; the message names the host, switch or link."""


@dataclass(frozen=True)
class VethEnd:
    """One end of a veth pair.

    Attributes
    ----------
    namespace : str
        The namespace the end lives in.
    ifname : str
        Interface name inside that namespace.
    rate : float or None
        Egress shaping rate in bytes/s (``None``: unshaped).
    latency : float
        One-way latency to add on egress, seconds (needs netem).
    bridge : str or None
        Bridge the end is a port of (switch and control namespaces).
    address : str or None
        ``ip/prefixlen`` to assign (host NICs and control interfaces).
    """

    namespace: str
    ifname: str
    rate: float | None = None
    latency: float = 0.0
    bridge: str | None = None
    address: str | None = None


@dataclass(frozen=True)
class Namespace:
    """A namespace to create: a host, a switch (with a bridge) or the control namespace."""

    name: str
    kind: str
    node: str
    bridge: str | None = None
    bridge_address: str | None = None


@dataclass
class Layout:
    """Everything :class:`~mlfabric.testbed.cluster.Testbed` creates, in creation order.

    Attributes
    ----------
    prefix : str
        The run prefix; every namespace name starts with ``prefix + "-"``.
    namespaces : list of Namespace
    pairs : list of (VethEnd, VethEnd)
        The veth pairs; data links first, then control links.
    host_namespace, host_address, host_control_address : dict
        Per host name: its namespace, data-plane IP and control-network IP.
    link_ends : dict
        Directed link ``(u, v)`` -> the veth end whose egress carries ``u -> v``.
    control_namespace, control_address : str
        Where the scheduler runs, and its IP on the control network.
    """

    prefix: str
    namespaces: list[Namespace] = field(default_factory=list)
    pairs: list[tuple[VethEnd, VethEnd]] = field(default_factory=list)
    host_namespace: dict[str, str] = field(default_factory=dict)
    host_address: dict[str, str] = field(default_factory=dict)
    host_control_address: dict[str, str] = field(default_factory=dict)
    link_ends: dict[tuple[str, str], VethEnd] = field(default_factory=dict)
    control_namespace: str = ""
    control_address: str = ""

    def shaped_ends(self) -> list[VethEnd]:
        """The veth ends that carry a shaping qdisc."""
        return [end for pair in self.pairs for end in pair if end.rate is not None]


def _address(net: ipaddress.IPv4Network, n: int) -> str:
    if not 0 < n < net.num_addresses - 1:
        raise LayoutError(f"{net} has room for {net.num_addresses - 2} addresses, asked for #{n}")
    return str(net.network_address + n)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]


def plan_layout(graph: nx.DiGraph, prefix: str) -> Layout:
    """Lay out a bandwidth graph as namespaces, bridges and shaped veth pairs.

    Parameters
    ----------
    graph : networkx.DiGraph
        A bandwidth graph from :func:`mlfabric.scheduler.core.graph.parse_topology`: nodes with
        ``kind``, each direction of a link an edge with ``capacity`` (bytes/s) and
        ``latency`` (s).
    prefix : str
        The run prefix, ``mlf`` + 6 hex digits (see :data:`PREFIX_PATTERN`).

    Returns
    -------
    Layout
        Namespaces ``<prefix>-h<i>-<host>``, ``<prefix>-s<j>-<switch>`` and
        ``<prefix>-ctl``; one veth pair per link, each end shaped at the rate of the
        direction it sends; one unshaped control pair per host.

    Raises
    ------
    LayoutError
        If the prefix is malformed, a host has more than one link, or the links form a
        cycle.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> layout = plan_layout(star(["ps", "w0"], 50e6), "mlf00beef")
    >>> layout.host_address["ps"], layout.host_namespace["w0"]
    ('198.18.0.1', 'mlf00beef-h1-w0')
    >>> layout.link_ends[("sw", "w0")].rate  # the switch port's egress = w0's ingress
    6250000.0
    """
    if not PREFIX_PATTERN.match(prefix):
        raise LayoutError(f"prefix {prefix!r} does not match {PREFIX_PATTERN.pattern}")
    undirected = graph.to_undirected(as_view=True)
    if not nx.is_forest(nx.Graph(undirected)):
        cycle = nx.find_cycle(nx.Graph(undirected))
        raise LayoutError(
            "the links form a cycle (" + " - ".join(u for u, _ in cycle) + "); "
            "the testbed's bridges do not run STP, so only trees are supported"
        )
    layout = Layout(prefix=prefix)
    layout.control_namespace = f"{prefix}-ctl"
    layout.control_address = _address(CONTROL_NET, 1)
    ports: dict[str, int] = {}
    bridges: dict[str, str] = {}
    host_index = switch_index = 0
    for node, kind in graph.nodes(data="kind"):
        if kind == "host":
            if undirected.degree(node) > 1:
                raise LayoutError(
                    f"host '{node}' has {undirected.degree(node)} links; the testbed emulates "
                    "one NIC per host (join extra links through a switch)"
                )
            ns = f"{prefix}-h{host_index}-{_safe(node)}"
            host_index += 1
            layout.namespaces.append(Namespace(ns, "host", node))
            layout.host_namespace[node] = ns
            layout.host_address[node] = _address(DATA_NET, host_index)
            layout.host_control_address[node] = _address(CONTROL_NET, host_index + 1)
        elif kind == "switch":
            ns = f"{prefix}-s{switch_index}-{_safe(node)}"
            switch_index += 1
            layout.namespaces.append(Namespace(ns, "switch", node, bridge=BRIDGE))
            bridges[node] = ns
        else:
            raise LayoutError(f"node '{node}' has unknown kind {kind!r}")
    layout.namespaces.append(
        Namespace(
            layout.control_namespace,
            "control",
            "",
            bridge=BRIDGE,
            bridge_address=f"{layout.control_address}/{CONTROL_NET.prefixlen}",
        )
    )
    node_ns = {**layout.host_namespace, **bridges}

    def end(node: str, peer: str) -> VethEnd:
        ns = node_ns[node]
        if node in bridges:
            index = ports.get(ns, 0)
            ports[ns] = index + 1
            ifname, bridge, address = f"p{index}", BRIDGE, None
        else:
            ifname, bridge = "eth0", None
            address = f"{layout.host_address[node]}/{DATA_NET.prefixlen}"
        edge = graph.edges[node, peer]
        return VethEnd(ns, ifname, edge["capacity"], float(edge.get("latency", 0.0)), bridge, address)

    seen: set[frozenset[str]] = set()
    for u, v in graph.edges:
        key = frozenset((u, v))
        if key in seen:
            continue
        seen.add(key)
        a, b = end(u, v), end(v, u)
        layout.pairs.append((a, b))
        layout.link_ends[(u, v)] = a
        layout.link_ends[(v, u)] = b
    for i, (host, ns) in enumerate(layout.host_namespace.items()):
        host_end = VethEnd(
            ns, CONTROL_IF, address=f"{layout.host_control_address[host]}/{CONTROL_NET.prefixlen}"
        )
        ctl_end = VethEnd(layout.control_namespace, f"c{i}", bridge=BRIDGE)
        layout.pairs.append((host_end, ctl_end))
    for a, b in layout.pairs:
        for e in (a, b):
            if len(e.ifname) > IFNAME_MAX:
                raise LayoutError(f"interface name {e.ifname!r} is longer than {IFNAME_MAX} bytes")
    return layout
