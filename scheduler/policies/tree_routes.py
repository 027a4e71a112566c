"""Routes of aggregation trees (:mod:`~mlfabric.scheduler.policies.trees`), kept across decisions.

Within the tree of one server the route from a host to an aggregator runs up the host's
path towards the server to where the aggregator's path joins it, then down the
aggregator's path reversed (when those links exist; else the hop-count shortest path).
Those routes depend on the topology only: a :class:`RouteCache` keeps them per server host
(node paths, and integer link ids for the fast estimate of ``tree_cost.py``) for as long as
the topology stands — a long-lived policy keeps one across its decisions. Each host's path
to the server is computed once, and a pair's route is read off the two hosts' paths. It also
keeps the last few :class:`TreeShape` (which eligible hosts lie below each switch of the
tree, for one set of sources and aggregators and one order of the graph's hosts).
:class:`Routes` adds what one decision's graph and timelines say of each link: seconds per
byte and when it is free. Internal to the tree planner.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.native import _plan_native
from mlfabric.scheduler.core.schedule import Link
from mlfabric.scheduler.core.timeline import Timelines

__all__ = ["RouteCache", "TreeShape"]


class _LinkIds:
    """Integer ids of links, made on first use (shared by a cache and its servers' routes)."""

    __slots__ = ("lid", "links")

    def __init__(self) -> None:
        self.links: list[Link] = []  # link id -> link
        self.lid: dict[Link, int] = {}

    def __call__(self, link: Link) -> int:
        i = self.lid.get(link)
        if i is None:
            i = self.lid[link] = len(self.links)
            self.links.append(link)
        return i


class _Host:
    """One node's path to a server and the ids of its links."""

    __slots__ = ("path", "up")

    def __init__(self, path: tuple[str, ...], up: tuple[int, ...]) -> None:
        self.path = path
        self.up = up  # ids of (path[k], path[k + 1])


class _Dst:
    """What a route down to one host needs of its path: positions, links back down, reversed."""

    __slots__ = ("back", "down", "pos")

    def __init__(self, path: tuple[str, ...], down: tuple[int, ...]) -> None:
        self.pos = {x: i for i, x in enumerate(path)}
        self.down = down  # ids of (path[k + 1], path[k]), for as long as those links exist
        self.back = path[::-1]


class _ServerRoutes:
    """Routes within the tree of one server host (topology only)."""

    __slots__ = ("adj", "dsts", "hosts", "ids", "link_id", "pc", "server", "walks")

    dst_type = _Dst  # what _dst makes (the C routes make it too)

    def __init__(self, pc: PathCache, link_id: _LinkIds, server: str) -> None:
        self.pc, self.link_id, self.server = pc, link_id, server  # no reference to the cache: no cycle
        self.adj: dict[str, dict[str, dict[str, object]]] | None = None  # the topology's, made on first use
        self.hosts: dict[str, _Host] = {}
        self.dsts: dict[str, _Dst] = {}
        self.ids: dict[str, dict[str, tuple[int, ...]]] = {}  # destination -> source -> route's link ids
        self.walks: dict[str, dict[str, tuple[str, ...]]] = {}  # destination -> source -> route (nodes)

    def host(self, h: str) -> _Host:
        """The path of ``h`` to the server (raises TopologyError where there is none)."""
        got = self.hosts.get(h)
        if got is None:
            if h == self.server:
                got = self.hosts[h] = _Host((h,), ())
                return got
            self._every()
            got = self.hosts.get(h)
            if got is None:
                self.pc.next_hop(h, self.server)  # raises: no path
                raise AssertionError(f"{h} has a next hop towards {self.server} but no path")
        return got

    def _every(self) -> None:
        """The path of every node with one to the server, each from its next hop's (listed first)."""
        hosts = self.hosts
        ids, links = self.link_id.lid, self.link_id.links  # self.link_id(link), inline
        next_hops = self.pc.next_hops(self.server)
        if _plan_native is not None and type(next_hops) is dict:
            _plan_native.tree_hosts(next_hops, hosts, ids, links, _Host)  # the loop below in C
            return
        for v, nxt in next_hops.items():
            if v in hosts:
                continue
            if v == nxt:  # the server
                hosts[v] = _Host((v,), ())
                continue
            on = hosts[nxt]
            link = (v, nxt)
            i = ids.get(link)
            if i is None:
                i = ids[link] = len(links)
                links.append(link)
            hosts[v] = _Host((v, *on.path), (i, *on.up))

    def _dst(self, h: str) -> _Dst:
        got = self.dsts.get(h)
        if got is None:
            path = self.host(h).path
            if _plan_native is not None:  # the loop below in C
                if self.adj is None:
                    self.adj = dict(self.pc.graph.adjacency())  # node -> its links out, read directly
                got = self.dsts[h] = _plan_native.tree_dst(
                    path, self.adj, self.link_id.lid, self.link_id.links, _Dst
                )
                return got
            has_edge = self.pc.graph.has_edge
            down = []
            for a, b in itertools.pairwise(path):
                if not has_edge(b, a):
                    break
                down.append(self.link_id((b, a)))
            got = self.dsts[h] = _Dst(path, tuple(down))
        return got

    def _meet(self, up: _Host, down: _Dst) -> tuple[int, int] | None:
        """Where two paths meet: (index on the sender's, on the receiver's); None: go round."""
        where = down.pos
        for i, x in enumerate(up.path):
            j = where.get(x)
            if j is not None:
                return (i, j) if j <= len(down.down) else None
        return None

    def pair_ids(self, src: str, dst: str) -> tuple[int, ...]:
        """Link ids of the tree route from ``src`` to ``dst`` (both with paths to the server)."""
        to = self.ids.get(dst)
        if to is None:
            to = self.ids[dst] = {}
        out = to.get(src)
        if out is None:
            up = self.hosts.get(src) or self.host(src)
            if dst == self.server:
                out = up.up
            else:
                down = self.dsts.get(dst) or self._dst(dst)
                meet = self._meet(up, down)
                if meet is None:
                    lid = self.link_id
                    out = tuple(lid(link) for link in self.pc.links(src, dst))
                else:
                    i, j = meet
                    out = up.up[:i] + down.down[j - 1 :: -1] if j else up.up[:i]
            to[src] = out
        return out

    def pair_path(self, src: str, dst: str) -> tuple[str, ...]:
        """Node path of the tree route from ``src`` to ``dst`` (both with paths to the server)."""
        to = self.walks.get(dst)
        if to is None:
            to = self.walks[dst] = {}
        out = to.get(src)
        if out is None:
            up = self.hosts.get(src) or self.host(src)
            if dst == self.server:
                out = up.path
            else:
                down = self.dsts.get(dst) or self._dst(dst)
                meet = self._meet(up, down)
                if meet is None:
                    out = self.pc.path(src, dst)
                else:
                    i, j = meet
                    out = up.path[:i] + down.back[len(down.back) - 1 - j :]
            to[src] = out
        return out


class TreeShape:
    """What a server's tree takes from the topology for one set of sources and aggregators.

    Attributes
    ----------
    paths : dict
        Each source, and each eligible host whose path crosses a source's, -> its path to
        the server.
    below : dict
        Node between a source and the server -> the eligible hosts whose path crosses it,
        in graph order.
    rank : dict
        Host -> its place in graph order.
    """

    __slots__ = ("below", "paths", "rank")

    def __init__(
        self, paths: dict[str, tuple[str, ...]], below: dict[str, list[str]], rank: dict[str, int]
    ) -> None:
        self.paths, self.below, self.rank = paths, below, rank


#: tree shapes a :class:`RouteCache` keeps (the most recently used)
SHAPES_KEPT = 4


class RouteCache:
    """Routes of the aggregation trees on one topology, per server host (kept across decisions).

    Parameters
    ----------
    pc : PathCache
        The path cache of the topology; the routes are valid for as long as it is.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 2, 8e6)
    >>> rc = RouteCache(PathCache(g))
    >>> r = rc.routes(g, "h0", {h: rc.pc.path(h, "h0") for h in ("h1", "h2", "h3")})
    >>> r.path("h2", "h3"), r.path("h3", "h0"), r.path("h1", "h3")
    (('h2', 'tor1', 'h3'), ('h3', 'tor1', 'core', 'tor0', 'h0'), ('h1', 'tor0', 'core', 'tor1', 'h3'))
    >>> [rc.links[i] for i in r.ids("h2", "h3")]
    [('h2', 'tor1'), ('tor1', 'h3')]
    """

    __slots__ = ("_servers", "_shapes", "link_id", "links", "pc")

    def __init__(self, pc: PathCache) -> None:
        self.pc = pc
        self.link_id = _LinkIds()  # link -> its integer id (made on first use)
        self.links = self.link_id.links  # link id -> link
        self._servers: dict[str, _ServerRoutes] = {}
        self._shapes: dict[tuple[str, frozenset[str], frozenset[str], tuple[str, ...]], TreeShape] = {}

    def shape(
        self, server_host: str, eligible: frozenset[str], sources: frozenset[str], every: Sequence[str]
    ) -> TreeShape:
        """The :class:`TreeShape` of ``server_host``'s tree (kept for the last few keys).

        Parameters
        ----------
        server_host : str
            The tree's server.
        eligible : frozenset of str
            Hosts that may aggregate.
        sources : frozenset of str
            The updates' hosts.
        every : sequence of str
            Every host of the graph, in graph order.
        """
        key = (server_host, eligible, sources, tuple(every))
        got = self._shapes.pop(key, None)
        if got is None:
            got = self._shape(server_host, eligible, sources, every)
            if len(self._shapes) >= SHAPES_KEPT:
                del self._shapes[next(iter(self._shapes))]  # the least recently used
        self._shapes[key] = got
        return got

    def _shape(
        self, server_host: str, eligible: frozenset[str], sources: frozenset[str], every: Sequence[str]
    ) -> TreeShape:
        tree = self.server(server_host)
        rank = {h: i for i, h in enumerate(every)}
        if _plan_native is not None:  # the loops below in C
            made = _plan_native.tree_shape(
                tree,
                tree.hosts,
                server_host,
                eligible,
                sources,
                every if type(every) is list else list(every),
            )
            return TreeShape(*made, rank)
        paths = {s: tree.host(s).path for s in sources}
        crossed = {x for p in paths.values() for x in p[1:-1]}
        below: dict[str, list[str]] = {}
        known = tree.hosts
        for h in every:
            if h not in eligible or h == server_host:
                continue
            if h not in paths:
                on = known.get(h)
                if on is None:
                    try:
                        on = tree.host(h)
                    except ValueError:
                        continue
                path = on.path
                if not crossed.intersection(path):
                    continue
                paths[h] = path
            for x in paths[h][1:-1]:
                below.setdefault(x, []).append(h)
        return TreeShape(paths, below, rank)

    def server(self, server_host: str) -> _ServerRoutes:
        """The routes within the tree of ``server_host``."""
        got = self._servers.get(server_host)
        if got is None:
            got = self._servers[server_host] = _ServerRoutes(self.pc, self.link_id, server_host)
        return got

    def path(self, h: str, server_host: str) -> tuple[str, ...]:
        """Node path from ``h`` to ``server_host`` (cached; TopologyError where there is none)."""
        return self.server(server_host).host(h).path

    def bottlenecks(self, graph: nx.DiGraph, server_host: str, sources: Iterable[str]) -> dict[str, float]:
        """Each source -> the lowest capacity on ``graph`` of its path to ``server_host`` (inf: none).

        Each node's bottleneck is its first link's capacity or its next hop's bottleneck,
        whichever is lower: one capacity read per node (every node with a path, next hops
        first) rather than per link of every path.
        """
        adj = dict(graph.adjacency())  # node -> its links out (attributes), read directly
        tree = self.server(server_host)
        next_hops = self.pc.next_hops(server_host)
        if _plan_native is not None and type(next_hops) is dict:
            known = _plan_native.tree_bottlenecks(adj, next_hops, server_host)  # the loop below in C
        else:
            known = {server_host: math.inf}
            for v, nxt in next_hops.items():  # every node after its next hop
                if v != nxt:
                    cap = float(adj[v][nxt]["capacity"])
                    rate = known[nxt]
                    known[v] = cap if cap < rate else rate
        out = {}
        for src in sources:
            got = known.get(src)
            if got is None:
                tree.host(src)  # raises: no path
                raise AssertionError(f"{src} has a path to {server_host} but no bottleneck")
            out[src] = got
        return out

    def routes(
        self,
        graph: nx.DiGraph,
        server_host: str,
        paths: Mapping[str, tuple[str, ...]],
        tls: Timelines | None = None,
    ) -> Routes:
        """One decision's :class:`Routes` of ``server_host``'s tree on ``graph`` (this topology)."""
        return Routes(graph, self, server_host, paths, tls)


class Routes:
    """One decision's routes of a server's tree: paths, link ids, per-byte times, free times.

    A route between two hosts of ``paths`` (the hosts of the tree, each with its path to the
    server) goes up and down the in-tree (:class:`RouteCache`); one to the server is the
    sender's path; any other is the hop-count shortest path.

    Parameters
    ----------
    graph : networkx.DiGraph
        The decision's graph (capacities: :attr:`per`).
    cache : RouteCache
        The routes of the graph's topology.
    server_host : str
        The tree's server.
    paths : mapping
        The tree's hosts -> their paths to the server.
    tls : Timelines, optional
        The decision's timelines (:attr:`free`); default: every link free.
    """

    def __init__(
        self,
        graph: nx.DiGraph,
        cache: RouteCache,
        server_host: str,
        paths: Mapping[str, tuple[str, ...]],
        tls: Timelines | None = None,
    ) -> None:
        self.graph, self.cache, self.server_host, self.paths, self.tls = graph, cache, server_host, paths, tls
        self._tree = cache.server(server_host)
        self._adj = dict(graph.adjacency())  # node -> its links out (attributes), read directly
        self._shared = self._tree.ids  # the in-tree routes' link ids, kept across decisions
        self._ids: dict[tuple[str, str], tuple[int, ...]] = {}  # the other routes' (this decision's)
        self._other: dict[tuple[str, str], tuple[str, ...]] = {}
        self.per: list[float] = []  # link id -> seconds per byte
        self.free: list[float] = []  # link id -> end of its last reservation on ``tls``
        self._grow()  # the links of the routes kept from earlier decisions

    def _in_tree(self, src: str, dst: str) -> bool:
        return dst == self.server_host or (src in self.paths and dst in self.paths)

    def ids(self, src: str, dst: str) -> tuple[int, ...]:
        """Integer ids of the links from ``src`` to ``dst`` (indices into :attr:`per`, :attr:`free`)."""
        if src == dst:
            return ()
        paths = self.paths
        if dst == self.server_host or (src in paths and dst in paths):  # _in_tree: the shared routes
            to = self._shared.get(dst)
            out = None if to is None else to.get(src)
            if out is None:
                out = self._tree.pair_ids(src, dst)
                if len(self.per) < len(self.cache.links):
                    self._grow()
            return out
        key = (src, dst)
        out = self._ids.get(key)
        if out is None:
            lid = self.cache.link_id
            out = self._ids[key] = tuple(lid(link) for link in itertools.pairwise(self.path(src, dst)))
            if len(self.per) < len(self.cache.links):
                self._grow()
        return out

    def tree_ids(self, src: str, dst: str) -> tuple[int, ...]:
        """:meth:`ids` of two hosts of the tree (``dst`` may be the server), without checking that."""
        to = self._shared.get(dst)
        out = None if to is None else to.get(src)
        if out is None:
            if src == dst:
                return ()
            out = self._tree.pair_ids(src, dst)
            if len(self.per) < len(self.cache.links):
                self._grow()
        return out

    def tree_path(self, src: str, dst: str) -> tuple[str, ...]:
        """:meth:`path` of two hosts of the tree (``dst`` may be the server), without checking that."""
        to = self._tree.walks.get(dst)
        out = None if to is None else to.get(src)
        if out is None:
            out = (src,) if src == dst else self._tree.pair_path(src, dst)
        return out

    def sync(self) -> None:
        """Per-byte and free times of the links given ids since (routes made outside these methods)."""
        if len(self.per) < len(self.cache.links):
            self._grow()

    def _grow(self) -> None:
        """Per-byte times and free times of the links given ids since the last call."""
        adj, tls, per, free = self._adj, self.tls, self.per, self.free
        new = self.cache.links[len(per) :]
        if _plan_native is not None:
            per.extend(_plan_native.per_byte(adj, new))  # the list below in C
        else:
            per.extend([1.0 / float(adj[a][b]["capacity"]) for a, b in new])
        if tls is None or tls.empty():
            free.extend([-math.inf] * len(new))
        else:
            free.extend(tls.last_changes(new))

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """Node path from ``src`` to ``dst``."""
        if src == dst:
            return (src,)
        if self._in_tree(src, dst):
            return self._tree.pair_path(src, dst)
        key = (src, dst)
        out = self._other.get(key)
        if out is None:
            out = self._other[key] = self.cache.pc.path(src, dst)
        return out
