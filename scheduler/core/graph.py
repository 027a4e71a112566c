"""The bandwidth graph: hosts, switches and links with capacities (DESIGN §2, paper §5).

A bandwidth graph is a :class:`networkx.DiGraph`. Nodes carry ``kind`` (``"host"`` or
``"switch"``); every directed edge ``(u, v)`` is one direction of a link and carries
``capacity`` (bytes per second) and ``latency`` (seconds). A full-duplex link is two
edges, one each way, each with the link's rate.

Topology files are TOML::

    # hosts are end points (one daemon each); switches only forward
    hosts = ["ps", "w0", "w1"]
    switches = ["tor"]

    [[links]]
    a = "ps"
    b = "tor"
    gbps = 1.0          # rate each way; or `mbps = 100`

    [[links]]
    a = "w0"
    b = "tor"
    mbps = 200
    mbps_ba = 50        # optional: a different rate from b to a
    latency_ms = 0.1    # optional

Hosts and switches may also be tables (``[[hosts]]`` with ``name = "w0"``) so that later
fields can be attached to them. A host table's ``aggregator = false`` keeps aggregates off
that host (paper §5; default: any host whose daemon allows it); it becomes the node
attribute ``aggregator``.
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import networkx as nx

__all__ = [
    "PathCache",
    "TopologyError",
    "bottleneck",
    "fat_tree",
    "hosts",
    "load_topology",
    "parse_topology",
    "path_links",
    "shortest_path",
    "star",
    "two_tier",
]

BITS_PER_BYTE = 8


class TopologyError(ValueError):
    """A topology file or dict is malformed; the message names the host, link or field."""


def _rate_bytes(link: Mapping[str, Any], where: str, suffix: str = "") -> float | None:
    gbps = link.get("gbps" + suffix)
    mbps = link.get("mbps" + suffix)
    if gbps is not None and mbps is not None:
        raise TopologyError(f"{where}: give gbps{suffix} or mbps{suffix}, not both")
    value = gbps * 1e9 if gbps is not None else (mbps * 1e6 if mbps is not None else None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise TopologyError(f"{where}: rate{suffix} must be a positive number, got {gbps or mbps!r}")
    return float(value) / BITS_PER_BYTE


def _names(items: Any, field: str) -> list[str]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise TopologyError(f"'{field}' must be a list, got {type(items).__name__}")
    names = []
    for i, item in enumerate(items):
        name = item.get("name") if isinstance(item, Mapping) else item
        if not isinstance(name, str) or not name:
            raise TopologyError(f"{field}[{i}]: expected a non-empty name, got {item!r}")
        names.append(name)
    return names


def parse_topology(data: Mapping[str, Any]) -> nx.DiGraph:
    """Build a bandwidth graph from a topology mapping (the parsed TOML or JSON).

    Parameters
    ----------
    data : mapping
        With ``hosts`` and optional ``switches`` (lists of names or of tables with
        ``name``) and ``links`` (tables with ``a``, ``b``, ``gbps`` or ``mbps``, optional
        ``gbps_ba``/``mbps_ba`` for the reverse direction and ``latency_ms``).

    Returns
    -------
    networkx.DiGraph
        Nodes with ``kind``; each direction of a link an edge with ``capacity`` in
        bytes/s and ``latency`` in seconds.

    Raises
    ------
    TopologyError
        Naming the offending host, switch, link or field.

    Examples
    --------
    >>> g = parse_topology({"hosts": ["a", "b"], "links": [{"a": "a", "b": "b", "gbps": 8}]})
    >>> g["a"]["b"]["capacity"]
    1000000000.0
    """
    if not isinstance(data, Mapping):
        raise TopologyError(f"a topology must be a table, got {type(data).__name__}")
    unknown = set(data) - {"hosts", "switches", "links", "name", "description"}
    if unknown:
        raise TopologyError(f"unknown topology field(s): {', '.join(sorted(unknown))}")
    host_names = _names(data.get("hosts"), "hosts")
    switch_names = _names(data.get("switches"), "switches")
    if not host_names:
        raise TopologyError("a topology needs at least one host")
    g = nx.DiGraph()
    for kind, names in (("host", host_names), ("switch", switch_names)):
        for name in names:
            if name in g:
                raise TopologyError(f"{kind} '{name}' is declared twice")
            g.add_node(name, kind=kind)
    for item in data.get("hosts") or []:
        if isinstance(item, Mapping) and "aggregator" in item:
            if not isinstance(item["aggregator"], bool):
                raise TopologyError(f"host '{item['name']}': aggregator must be true or false")
            g.nodes[item["name"]]["aggregator"] = item["aggregator"]
    links = data.get("links", [])
    if not isinstance(links, list):
        raise TopologyError("'links' must be a list of tables")
    for i, link in enumerate(links):
        if not isinstance(link, Mapping):
            raise TopologyError(f"links[{i}]: expected a table, got {link!r}")
        a, b = link.get("a"), link.get("b")
        where = f"links[{i}] ({a}-{b})"
        extra = set(link) - {"a", "b", "gbps", "mbps", "gbps_ba", "mbps_ba", "latency_ms"}
        if extra:
            raise TopologyError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
        for end in (a, b):
            if end not in g:
                raise TopologyError(f"{where}: '{end}' is not a declared host or switch")
        if a == b:
            raise TopologyError(f"{where}: a link cannot join '{a}' to itself")
        if g.has_edge(a, b):
            raise TopologyError(f"{where}: duplicate link between '{a}' and '{b}'")
        rate = _rate_bytes(link, where)
        if rate is None:
            raise TopologyError(f"{where}: missing rate (gbps or mbps)")
        rate_ba = _rate_bytes(link, where, "_ba") or rate
        latency = link.get("latency_ms", 0.0)
        if not isinstance(latency, int | float) or latency < 0:
            raise TopologyError(f"{where}: latency_ms must be a number >= 0, got {latency!r}")
        g.add_edge(a, b, capacity=rate, latency=latency / 1e3)
        g.add_edge(b, a, capacity=rate_ba, latency=latency / 1e3)
    for h in host_names:
        if g.degree(h) == 0 and len(host_names) > 1:
            raise TopologyError(f"host '{h}' has no link")
    return g


def load_topology(path: str | Path) -> nx.DiGraph:
    """Load a TOML topology file (see the module docstring for the format).

    Raises
    ------
    TopologyError
        If the file is missing, is not TOML, or describes an invalid topology; the
        message starts with the file name.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise TopologyError(f"{path}: no such topology file") from None
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: not valid TOML: {exc}") from None
    try:
        return parse_topology(data)
    except TopologyError as exc:
        raise TopologyError(f"{path}: {exc}") from None


def star(n: int | Iterable[str], nic_bps: float | Mapping[str, float], switch: str = "sw") -> nx.DiGraph:
    """A star: hosts around one switch, each with one full-duplex NIC link.

    Parameters
    ----------
    n : int or iterable of str
        Number of hosts (named ``h0..h{n-1}``) or their names.
    nic_bps : float or mapping
        NIC rate in bits/s for every host, or per host name (heterogeneous NICs).
    switch : str
        Name of the central switch.

    Examples
    --------
    >>> g = star(3, 8e9)
    >>> sorted(hosts(g)), g["h0"]["sw"]["capacity"]
    (['h0', 'h1', 'h2'], 1000000000.0)
    """
    names = [f"h{i}" for i in range(n)] if isinstance(n, int) else list(n)
    g = nx.DiGraph()
    g.add_node(switch, kind="switch")
    for name in names:
        rate = nic_bps[name] if isinstance(nic_bps, Mapping) else nic_bps
        if rate <= 0:
            raise TopologyError(f"host '{name}': NIC rate must be positive, got {rate}")
        g.add_node(name, kind="host")
        g.add_edge(name, switch, capacity=rate / BITS_PER_BYTE, latency=0.0)
        g.add_edge(switch, name, capacity=rate / BITS_PER_BYTE, latency=0.0)
    return g


def hosts(g: nx.DiGraph) -> list[str]:
    """The host nodes of ``g``, in insertion order."""
    # the graph's own node dict (no view: a pass per decision, issue 24)
    return [v for v, d in g._node.items() if d.get("kind") == "host"]


def shortest_path(g: nx.DiGraph, src: str, dst: str) -> list[str]:
    """Hop-count shortest path from ``src`` to ``dst`` (deterministic).

    Raises
    ------
    TopologyError
        If either end is not in the graph or no path joins them.
    """
    for end in (src, dst):
        if end not in g:
            raise TopologyError(f"'{end}' is not a host of the bandwidth graph")
    try:
        return list(nx.shortest_path(g, src, dst))
    except nx.NetworkXNoPath:
        raise TopologyError(f"no path from '{src}' to '{dst}'") from None


def path_links(path: list[str]) -> list[tuple[str, str]]:
    """The directed links ``(u, v)`` along a node path."""
    return list(itertools.pairwise(path))


def bottleneck(g: nx.DiGraph, path: list[str]) -> tuple[tuple[str, str] | None, float]:
    """The lowest-capacity link of ``path`` and its capacity (bytes/s).

    A path of one node (same host) has no links: ``(None, inf)``.
    """
    best: tuple[str, str] | None = None
    rate = float("inf")
    for link in path_links(path):
        cap = g.edges[link]["capacity"]
        if cap < rate:
            best, rate = link, cap
    return best, rate


def _nic_rate(nic_bps: float | Mapping[str, float], name: str) -> float:
    rate = nic_bps[name] if isinstance(nic_bps, Mapping) else nic_bps
    if rate <= 0:
        raise TopologyError(f"host '{name}': NIC rate must be positive, got {rate}")
    return float(rate) / BITS_PER_BYTE


def _link(g: nx.DiGraph, a: str, b: str, rate: float) -> None:
    g.add_edge(a, b, capacity=rate, latency=0.0)
    g.add_edge(b, a, capacity=rate, latency=0.0)


def two_tier(
    racks: int,
    hosts_per_rack: int,
    nic_bps: float | Mapping[str, float],
    oversubscription: float = 1.0,
) -> nx.DiGraph:
    """Racks of hosts under top-of-rack switches joined by one core switch.

    Each rack's uplink (both directions) runs at ``hosts_per_rack * nominal NIC rate /
    oversubscription``; with ``oversubscription > 1`` the uplinks are the bottlenecks the
    paper's network settings emulate (§7, NS1-NS3).

    Parameters
    ----------
    racks, hosts_per_rack : int
        Hosts are ``h0 .. h{racks*hosts_per_rack-1}``, rack ``r`` holding ``h{r*hosts_per_rack}``
        onwards, under switch ``tor{r}``; the core switch is ``core``.
    nic_bps : float or mapping
        NIC rate in bits/s, for every host or per host name (heterogeneous NICs; the uplink
        uses the mean of the rack's NICs).
    oversubscription : float
        Ratio of a rack's total NIC rate to its uplink rate (>= 1 usually).

    Returns
    -------
    networkx.DiGraph

    Examples
    --------
    >>> g = two_tier(2, 4, 8e9, oversubscription=2.0)
    >>> len(hosts(g)), g["tor0"]["core"]["capacity"] / g["h0"]["tor0"]["capacity"]
    (8, 2.0)
    """
    if racks < 1 or hosts_per_rack < 1:
        raise TopologyError(
            f"two_tier needs racks >= 1 and hosts_per_rack >= 1, got {racks}, {hosts_per_rack}"
        )
    if oversubscription <= 0:
        raise TopologyError(f"oversubscription must be positive, got {oversubscription}")
    g = nx.DiGraph()
    g.add_node("core", kind="switch")
    for r in range(racks):
        tor = f"tor{r}"
        g.add_node(tor, kind="switch")
        total = 0.0
        for j in range(hosts_per_rack):
            name = f"h{r * hosts_per_rack + j}"
            rate = _nic_rate(nic_bps, name)
            total += rate
            g.add_node(name, kind="host")
            _link(g, name, tor, rate)
        if racks > 1:
            _link(g, tor, "core", total / oversubscription)
    if racks == 1:
        g.remove_node("core")
    return g


def fat_tree(k: int, link_bps: float) -> nx.DiGraph:
    """A k-ary fat-tree (Al-Fares et al.): k pods, (k/2)^2 core switches, k^3/4 hosts.

    Parameters
    ----------
    k : int
        Even number of ports per switch.
    link_bps : float
        Rate of every link in bits/s.

    Returns
    -------
    networkx.DiGraph
        Hosts ``h0..``; edge switches ``e{pod}_{i}``, aggregation switches ``a{pod}_{i}``,
        core switches ``c{i}_{j}``.

    Examples
    --------
    >>> g = fat_tree(4, 8e9)
    >>> len(hosts(g)), g.number_of_nodes() - len(hosts(g))
    (16, 20)
    """
    if k < 2 or k % 2:
        raise TopologyError(f"fat_tree needs an even k >= 2, got {k}")
    rate = link_bps / BITS_PER_BYTE
    if rate <= 0:
        raise TopologyError(f"link rate must be positive, got {link_bps}")
    half = k // 2
    g = nx.DiGraph()
    host = 0
    for pod in range(k):
        for i in range(half):
            g.add_node(f"e{pod}_{i}", kind="switch")
            g.add_node(f"a{pod}_{i}", kind="switch")
        for i in range(half):
            for _ in range(half):
                g.add_node(f"h{host}", kind="host")
                _link(g, f"h{host}", f"e{pod}_{i}", rate)
                host += 1
            for j in range(half):
                _link(g, f"e{pod}_{i}", f"a{pod}_{j}", rate)
        for i in range(half):
            for j in range(half):
                core = f"c{i}_{j}"
                if core not in g:
                    g.add_node(core, kind="switch")
                _link(g, f"a{pod}_{i}", core, rate)
    return g


class PathCache:
    """Cached hop-count shortest paths of one bandwidth graph (deterministic).

    When every link is full duplex and the links form a tree (a star, a two-tier cluster),
    the path between two nodes is the only simple one, so it is found by climbing both ends'
    ancestor chains to their lowest common ancestor: memory the nodes times the tree's depth
    (issue 24: one breadth-first tree per candidate aggregator held ~10^8 entries, 3 GB, at
    10,240 workers). Otherwise one breadth-first search per destination yields the path from every
    source, kept until the cache is dropped. :meth:`next_hops` always builds (and keeps) the
    destination's breadth-first tree. :meth:`links` keeps at most :attr:`MAX_LINKS` paths'
    links (all dropped when full). Paths depend only on the topology, so a cache can be
    reused for a graph whose capacities changed (see :meth:`same_topology`).

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (read only).

    Examples
    --------
    >>> pc = PathCache(star(3, 8e9))
    >>> pc.path("h0", "h2"), pc.links("h0", "h2")
    (('h0', 'sw', 'h2'), (('h0', 'sw'), ('sw', 'h2')))
    """

    __slots__ = ("_down", "_graph", "_links", "_parent", "_trees", "_up", "_up_links")

    MAX_LINKS = 1 << 16
    """The most paths whose links :meth:`links` keeps."""

    def __init__(self, graph: nx.DiGraph) -> None:
        self._graph = graph
        self._trees: dict[str, dict[str, str]] = {}
        self._links: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        self._parent: dict[str, str] = {}
        self._up: dict[str, tuple[str, ...]] = {}  # node -> it, its parent, ..., the root
        self._up_links: dict[str, tuple[tuple[str, str], ...]] = {}  # the links of that climb
        self._down: dict[str, tuple[tuple[str, str], ...]] = {}  # the links from the root down to it
        self._root_tree()

    def _root_tree(self) -> None:
        """Parent pointers and ancestor chains when the links form a tree (else leave them empty)."""
        g = self._graph
        n = g.number_of_nodes()
        if n == 0 or g.number_of_edges() != 2 * (n - 1):
            return
        succ = g._succ
        if any(u == v or u not in succ[v] for u, v in g.edges):
            return  # a one-way link or a self loop
        root = next(iter(g))
        parent = {root: root}
        up: dict[str, tuple[str, ...]] = {root: (root,)}
        frontier = [root]
        while frontier:
            nxt = []
            for v in frontier:
                for u in succ[v]:
                    if u not in parent:
                        parent[u] = v
                        up[u] = (u, *up[v])
                        nxt.append(u)
            frontier = nxt
        if len(parent) != n:
            return  # not connected (then not a tree)
        self._parent, self._up = parent, up
        for v, chain in up.items():
            climb = tuple(itertools.pairwise(chain))
            self._up_links[v] = climb
            self._down[v] = tuple((b, a) for a, b in reversed(climb))

    def _meet(self, src: str, dst: str) -> tuple[int, int]:
        """Indices of the lowest common ancestor in ``src``'s and ``dst``'s ancestor chains."""
        up = self._up
        a, b = up.get(src), up.get(dst)
        if b is None:
            raise TopologyError(f"'{dst}' is not a host of the bandwidth graph")
        if a is None:
            raise self._no_path(src, dst)
        i, j = len(a) - 1, len(b) - 1  # both chains end at the root
        while i and j and a[i - 1] == b[j - 1]:
            i -= 1
            j -= 1
        return i, j

    @property
    def is_tree(self) -> bool:
        """Whether paths come from parent pointers (the links form a tree) rather than searches."""
        return bool(self._parent)

    @property
    def graph(self) -> nx.DiGraph:
        """The graph the paths belong to."""
        return self._graph

    def same_topology(self, other: nx.DiGraph) -> bool:
        """Whether ``other`` has the same nodes and links (capacities may differ)."""
        g = self._graph
        if other is g:
            return True
        return (
            other.number_of_nodes() == g.number_of_nodes()
            and other.number_of_edges() == g.number_of_edges()
            and all(other.has_edge(u, v) for u, v in g.edges)
        )

    def _tree(self, dst: str) -> dict[str, str]:
        tree = self._trees.get(dst)
        if tree is None:
            if dst not in self._graph:
                raise TopologyError(f"'{dst}' is not a host of the bandwidth graph")
            tree = {dst: dst}
            frontier = [dst]
            pred = self._graph._pred  # v -> its predecessors, in predecessors(v)'s order (issue 24)
            while frontier:
                nxt = []
                for v in frontier:
                    for u in pred[v]:
                        if u not in tree:
                            tree[u] = v
                            nxt.append(u)
                frontier = nxt
            self._trees[dst] = tree
        return tree

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """Node path from ``src`` to ``dst``.

        Raises
        ------
        TopologyError
            If an end is unknown or no path joins them.
        """
        if self._parent:
            return self._tree_path(src, dst)
        tree = self._tree(dst)
        if src not in tree:
            raise self._no_path(src, dst)
        path = [src]
        while path[-1] != dst:
            path.append(tree[path[-1]])
        return tuple(path)

    def next_hop(self, src: str, dst: str) -> str:
        """The node after ``src`` on its path to ``dst`` (``dst`` itself when ``src == dst``).

        Raises
        ------
        TopologyError
            As :meth:`path`.
        """
        if self._parent:
            path = self._tree_path(src, dst)
            return path[1] if len(path) > 1 else dst
        hop = self._tree(dst).get(src)
        if hop is None:
            raise self._no_path(src, dst)
        return hop

    def next_hops(self, dst: str) -> Mapping[str, str]:
        """Every node with a path to ``dst`` -> its next hop (``dst`` -> itself), nearest first.

        Read only (the cache's own tree). A node's next hop is listed before it.

        Raises
        ------
        TopologyError
            If ``dst`` is not in the graph.

        Examples
        --------
        >>> list(PathCache(star(2, 8e9)).next_hops("h0").items())
        [('h0', 'h0'), ('sw', 'h0'), ('h1', 'sw')]
        """
        return self._tree(dst)

    def _tree_path(self, src: str, dst: str) -> tuple[str, ...]:
        """The path up from ``src`` and down to ``dst`` through their lowest common ancestor."""
        i, j = self._meet(src, dst)
        return self._up[src][: i + 1] + self._up[dst][j - 1 :: -1] if j else self._up[src][: i + 1]

    def _no_path(self, src: str, dst: str) -> TopologyError:
        if src not in self._graph:
            return TopologyError(f"'{src}' is not a host of the bandwidth graph")
        return TopologyError(f"no path from '{src}' to '{dst}'")

    def links(self, src: str, dst: str) -> tuple[tuple[str, str], ...]:
        """Directed links of the path from ``src`` to ``dst`` (cached)."""
        key = (src, dst)
        links = self._links.get(key)
        if links is None:
            if self._parent:
                i, j = self._meet(src, dst)
                links = self._up_links[src][:i] + self._down[dst][len(self._down[dst]) - j :]
            else:
                links = tuple(itertools.pairwise(self.path(src, dst)))
            if len(self._links) >= self.MAX_LINKS:
                self._links.clear()  # a bound: links are a function of the topology alone
            self._links[key] = links
        return links
