"""Model relays: where each worker host's daemon fetches a server's model (docs/model-relays.md).

After a synchronous round every worker ``get``\\ s the new model. Fetched from the server's
daemon, N copies cross the server's link and every rack's uplink once per worker host behind
it. Instead the scheduler names, per (job, server), each worker host's *upstream*: the
server's host, or a *relay*, a worker host of the same rack that fetched the model and keeps
it in its daemon's cache (DESIGN §12). :func:`model_upstreams` is the choice, a pure
function of the bandwidth graph; :class:`ModelRouteBook` turns it into
``ModelRouteDirective``\\ s, sent only when a host's route changes (the service core executes
its :class:`~mlfabric.scheduler.service.effects.Effects`). Where that rule puts relays (a
shared uplink) and the model's size is known, :func:`model_routes` plans the whole relay tree
instead (:func:`~mlfabric.scheduler.policies.broadcast.plan_broadcast`: relays of relays) and
the daemons move the model down it in pieces (``chunk_bytes``), each relay forwarding a piece
while the next arrives.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.allreduce_model import nic_rate
from mlfabric.scheduler.policies.broadcast import plan_broadcast
from mlfabric.scheduler.policies.broadcast_model import pipeline_chunks
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.records import SchedulerError, ServerRole
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.wire.tensors import DTYPES

__all__ = ["ModelRouteBook", "ModelRoutes", "model_routes", "model_upstreams"]

log = logging.getLogger(__name__)

#: the least time between two refreshes of the model routes as roles come and go, s
ROUTE_REFRESH_INTERVAL = 0.1
#: what one more piece costs a daemon: it asks for pieces one GET at a time, each a round trip
#: not overlapped with the next (0.4-0.5 ms measured on loopback under load, with the daemons'
#: Python on both ends), so the chunk rule uses this instead of the planner's per-frame cost
PIECE_OVERHEAD_SECONDS = 1e-3
#: the most worker hosts of one server whose relay tree is planned whole (plan_broadcast: 17 ms
#: for 16 hosts, 36-82 ms for 32, 0.9-2 s for 256 on a loaded machine, on the scheduler's loop
#: at every refresh); beyond, each relay of the one-level rule feeds its group down a chain
MAX_PLANNED_HOSTS = 16


def model_upstreams(
    graph: nx.DiGraph,
    server_host: str,
    worker_hosts: Iterable[str],
    paths: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str]:
    """Each worker host's upstream for the model of a server on ``server_host``.

    The rule (one level of relays; docs/model-relays.md):

    1. Take the shortest paths from the server's host to every worker host (one BFS tree,
       so hosts under one switch share their path to it).
    2. Group the worker hosts by the switch they sit directly under on that path.
    3. A group of two or more hosts whose switch is reached from the server through a
       *switch-to-switch* link (a rack's uplink, shared by the group: not only the server's
       own NIC) gets one relay: the host of the group with the fastest NIC (the capacity of
       its link from the switch; ties: the first name in string order). The relay's
       upstream is the server's host; the others' upstream is the relay. One copy of the
       model then crosses the uplink.
    4. Every other worker host (alone behind its uplink, under the server's own switch, or
       with no path in the graph) fetches from the server's host directly.

    The server's own host is left out (its daemon answers from the server it hosts).

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (``scheduler/core/graph.py``: node ``kind``, edge ``capacity``).
    server_host : str
        The host of the server.
    worker_hosts : iterable of str
        Hosts with at least one worker of the server's job.
    paths : mapping, optional
        ``nx.single_source_shortest_path(graph, server_host)`` if the caller keeps it (it
        depends on the graph only); computed here if not given.

    Returns
    -------
    dict
        worker host -> upstream host (the server's host, or a relay host of its group).

    Examples
    --------
    Two racks of four behind 2:1 oversubscribed uplinks, the server ``h0`` in rack 0: rack 0
    fetches directly, rack 1 through one relay (``h4``: equal NICs, the first by name).

    >>> from mlfabric.scheduler.core.graph import star, two_tier
    >>> g = two_tier(2, 4, 1e9, oversubscription=2.0)
    >>> ups = model_upstreams(g, "h0", ["h1", "h2", "h4", "h5", "h6", "h7"])
    >>> {h: ups[h] for h in sorted(ups)}
    {'h1': 'h0', 'h2': 'h0', 'h4': 'h0', 'h5': 'h4', 'h6': 'h4', 'h7': 'h4'}

    A star has no shared link but the server's NIC: every host fetches directly.

    >>> model_upstreams(star(4, 1e9), "h0", ["h1", "h2", "h3"])
    {'h1': 'h0', 'h2': 'h0', 'h3': 'h0'}
    """
    workers = sorted(set(worker_hosts) - {server_host})
    out = dict.fromkeys(workers, server_host)
    if server_host not in graph:
        return out
    if paths is None:
        paths = nx.single_source_shortest_path(graph, server_host)
    groups: dict[str, list[str]] = {}
    for host in workers:
        path = paths.get(host)
        if path is None or len(path) < 4:  # no path, or under the server's own switch
            continue
        switch, above = path[-2], path[-3]
        kinds = graph.nodes[switch].get("kind"), graph.nodes[above].get("kind")
        if kinds == ("switch", "switch"):
            groups.setdefault(switch, []).append(host)
    for switch, members in groups.items():
        if len(members) < 2:
            continue
        relay = min(members, key=lambda h: (-graph.edges[switch, h]["capacity"], h))
        for host in members:
            if host != relay:
                out[host] = relay
    return out


@dataclass(frozen=True)
class ModelRoutes:
    """Where each worker host fetches a server's model, and in what pieces.

    Attributes
    ----------
    upstreams : dict
        Worker host -> the host it fetches from (the server's host or a relay).
    chunk_bytes : int
        Bytes per piece (0: whole, store-and-forward).
    """

    upstreams: dict[str, str]
    chunk_bytes: int = 0


def model_bytes(specs: Iterable[Any]) -> int:
    """The size of a model from its tensor specs (``name``, ``dtype``, ``shape``); 0 if unknown.

    Examples
    --------
    >>> from mlfabric.scheduler.service.records import TensorSpec
    >>> model_bytes([TensorSpec("w", "float32", (4, 4)), TensorSpec("b", "float64", (3,))])
    88
    >>> model_bytes([TensorSpec("w", "bfloat16", (4,))])   # the wire's dtypes, bfloat16 too
    8
    >>> model_bytes([TensorSpec("w", "", (4,))])   # unknown: 0 (the routes' one-level rule)
    0
    """
    total = 0
    for t in specs:
        dtype = DTYPES.get(t.dtype)
        if dtype is None or any(d < 0 for d in t.shape):  # not a wire dtype (forged): size unknown
            return 0
        total += math.prod(t.shape) * dtype.itemsize
    return total


def model_routes(
    graph: nx.DiGraph,
    server_host: str,
    worker_hosts: Iterable[str],
    nbytes: int,
    paths: Mapping[str, Sequence[str]] | None = None,
) -> ModelRoutes:
    """Each worker host's upstream for a server's model of ``nbytes``, relays of relays where they pay.

    Where :func:`model_upstreams` (one level) finds no relay — a star, hosts alone behind
    their uplinks — that is the answer, whole. Where it puts relays (a shared uplink) and
    the model's size is known, the relay tree of
    :func:`~mlfabric.scheduler.policies.broadcast.plan_broadcast` over the hosts in the graph
    (up to :data:`MAX_PLANNED_HOSTS`; beyond, each relay's group of the one-level rule as a
    chain from the relay: the planner's cost grows too fast for the scheduler's loop) replaces
    it: one copy per subtree behind a bottleneck, fanned out inside it down a chain or a heap,
    moved in pieces (``chunk_bytes``) so that a relay forwards a piece while the next one
    arrives. The piece count is the planner's chunk
    rule (:func:`~mlfabric.scheduler.policies.broadcast_model.pipeline_chunks`: two hops at
    the hosts' median NIC rate to fill, :data:`PIECE_OVERHEAD_SECONDS` per piece): many
    pieces on slow links, few large ones on fast links (one: whole, ``chunk_bytes`` 0). Hosts
    outside the graph fetch from the server's host.

    Parameters
    ----------
    graph, server_host, worker_hosts, paths
        As for :func:`model_upstreams`.
    nbytes : int
        The model's size (0: unknown, the one-level rule).

    Returns
    -------
    ModelRoutes

    Examples
    --------
    Two racks of four under 4:1 uplinks, the server outside them (its link as fast as an
    uplink): one copy leaves the server and runs down a chain through both racks, in pieces.

    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 4, 100e6, oversubscription=4.0)   # 100 Mbit/s NICs (bytes/s in the graph)
    >>> g.add_edge("ps", "core", capacity=12.5e6); g.add_edge("core", "ps", capacity=12.5e6)
    >>> g.nodes["ps"]["kind"] = "host"
    >>> hosts = [f"h{i}" for i in range(8)]
    >>> r = model_routes(g, "ps", hosts, 4_500_000)
    >>> sum(up == "ps" for up in r.upstreams.values()), r.upstreams["h4"], r.chunk_bytes
    (1, 'h3', 166667)
    >>> model_routes(g, "ps", hosts, 0).chunk_bytes   # size unknown: one level, whole
    0
    """
    ups = model_upstreams(graph, server_host, worker_hosts, paths)
    if nbytes <= 0 or all(u == server_host for u in ups.values()):
        return ModelRoutes(ups)
    receivers = [h for h in ups if h in graph and graph.nodes[h].get("kind") == "host"]
    if len(receivers) < 2:
        return ModelRoutes(ups)
    median = statistics.median(nic_rate(graph, h) for h in receivers)
    chunks = pipeline_chunks(nbytes, 2.0 / median, PIECE_OVERHEAD_SECONDS)
    if chunks < 2:
        return ModelRoutes(ups)  # one piece: whole, and the one-level rule
    if len(receivers) > MAX_PLANNED_HOSTS:
        return ModelRoutes(_chains(graph, server_host, ups), -(-nbytes // chunks))
    plan = plan_broadcast(graph, server_host, receivers, float(nbytes), chunks=chunks)
    return ModelRoutes(ups | plan.parents(), -(-nbytes // chunks))


def _chains(graph: nx.DiGraph, server_host: str, ups: Mapping[str, str]) -> dict[str, str]:
    """Each relay's group of :func:`model_upstreams` as a chain from the relay, fastest NICs first.

    A chain in pieces moves the model to its last host in about one transfer plus a piece per
    hop, where the relay sending a copy to each host of its group takes one transfer per host.
    O(hosts).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> g = two_tier(2, 3, 1e9, oversubscription=3.0)
    >>> _chains(g, "h0", {"h1": "h0", "h2": "h0", "h3": "h0", "h4": "h3", "h5": "h3"})
    {'h1': 'h0', 'h2': 'h0', 'h3': 'h0', 'h4': 'h3', 'h5': 'h4'}
    """
    groups: dict[str, list[str]] = {}
    for host, up in ups.items():
        if up != server_host:
            groups.setdefault(up, []).append(host)
    out = dict(ups)
    for relay, members in groups.items():
        members.sort(key=lambda h: (-nic_rate(graph, h), h))
        for parent, child in zip([relay, *members], members, strict=False):
            out[child] = parent
    return out


@dataclass
class ModelRouteBook:
    """The model routes sent to the daemons, and the ones now due (pure: returns Effects).

    :meth:`refresh` recomputes every job's routes from the connected worker hosts and servers
    and returns a ``ModelRouteDirective`` for each (host, job, server) whose route changed
    since it was last sent (a host that fetches directly, and was never told otherwise, gets
    none: without a route a daemon fetches from the server's daemon). A daemon whose session
    ended has no workers any more, so its routes are forgotten at the next refresh and a new
    session gets them again once its workers register; the hosts that fetched through a relay
    whose daemon went away get new routes at that refresh.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import two_tier
    >>> from mlfabric.scheduler.service.records import JobParams
    >>> state = SchedulerState(two_tier(2, 2, 1e9, oversubscription=2.0))
    >>> for i in range(4):
    ...     _ = state.connect(f"h{i}", f"127.0.0.1:{9000 + i}")
    >>> _ = state.register_server("h0", "j", "ps", (), JobParams(), 0)
    >>> for h in ("h2", "h3"):
    ...     _ = state.register_worker(h, "j", f"w{h}")
    >>> book = ModelRouteBook(state)
    >>> [(h, d.model_route.upstream_host) for h, d in book.refresh().directives]
    [('h3', 'h2')]
    >>> book.refresh().directives  # nothing changed: nothing sent
    []
    """

    state: SchedulerState
    #: (host, job, server) -> the route last sent there: upstream host and address, server host
    #: and address, chunk bytes (a directive is built only when it changes)
    sent: dict[tuple[str, str, str], tuple[str, str, str, str, int]] = field(default_factory=dict)
    #: the graph the cached paths were computed on, and server host -> its BFS paths
    _graph: nx.DiGraph | None = field(default=None, repr=False)
    _paths: dict[str, dict[str, list[str]]] = field(default_factory=dict, repr=False)
    #: the least time between two coalesced refreshes (:meth:`changed`), s
    interval: float = ROUTE_REFRESH_INTERVAL
    #: when the coalesced refresh is due (None: nothing changed since the last), and the last one
    _due: float | None = field(default=None, repr=False)
    _last: float = field(default=-math.inf, repr=False)

    def changed(self, now: float) -> float:
        """Roles or daemons changed at ``now``: one refresh is due, at most every :attr:`interval`.

        A refresh recomputes every job's routes (O(hosts)); refreshing once per registration
        makes a storm of N (every daemon reconnecting to a restarted scheduler) cost O(N^2).
        Returns when the refresh is due (:meth:`refresh_due` does it then).

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> book = ModelRouteBook(SchedulerState(star(["ps", "a"], 1e9)), interval=0.1)
        >>> book.changed(5.0), book.changed(5.01), book.refresh_due(5.0).directives, book.due_at()
        (5.0, 5.0, [], None)
        >>> book.changed(5.02), book.refresh_due(5.05).directives, book.due_at()
        (5.1, [], 5.1)
        >>> book.refresh_due(5.1).directives, book.due_at()
        ([], None)
        """
        if self._due is None:
            self._due = max(now, self._last + self.interval)
        return self._due

    def due_at(self) -> float | None:
        """When the coalesced refresh is due; None if none is."""
        return self._due

    def refresh_due(self, now: float) -> Effects:
        """:meth:`refresh` if one is due by ``now`` (else nothing to do)."""
        if self._due is None or now < self._due:
            return Effects()
        self._due, self._last = None, now
        return self.refresh()

    def refresh(self) -> Effects:
        """The directives for every route that changed (new workers, servers, relays gone).

        A daemon without a route fetches from the server's daemon, so a direct route is sent
        only to a host that was sent another route before (a relay of its had gone).
        """
        out = Effects()
        due: dict[_Key, _Route] = {}
        for job in sorted(self.state.jobs):
            hosts = {h for h in self.state.worker_hosts(job) if h in self.state.daemons}
            for server in self.state.servers(job):
                due.update(self._routes(job, server, hosts))
        sent = {}
        for key, route in sorted(due.items()):
            before = self.sent.get(key)
            if before is None and route[0] == route[2] and not route[4]:
                continue  # direct and whole, as without a route
            if before != route:
                directive = pb.ModelRouteDirective(
                    job=key[1],
                    server=key[2],
                    upstream_host=route[0],
                    upstream_address=route[1],
                    server_host=route[2],
                    server_address=route[3],
                    chunk_bytes=route[4],
                )
                out.send(key[0], pb.Directive(model_route=directive))
            sent[key] = route
        self.sent = sent
        return out

    def _paths_from(self, server_host: str) -> dict[str, list[str]]:
        """The BFS paths from ``server_host`` on the state's graph (kept until the graph is swapped)."""
        if self._graph is not self.state.graph:
            self._graph, self._paths = self.state.graph, {}
        paths = self._paths.get(server_host)
        if paths is None:
            paths = nx.single_source_shortest_path(self.state.graph, server_host)
            self._paths[server_host] = paths
        return paths

    def _routes(self, job: str, role: ServerRole, hosts: set[str]) -> dict[_Key, _Route]:
        server, server_host = role.name, role.host
        try:
            server_address = self.state.address(server_host)
        except SchedulerError:
            return {}  # the server's daemon is away: its workers learn the new server later
        graph, address = self.state.graph, self.state.address
        paths = self._paths_from(server_host) if server_host in graph else None
        routes = model_routes(graph, server_host, hosts, model_bytes(role.model), paths)
        chunk = routes.chunk_bytes
        return {
            (h, job, server): (u, address(u), server_host, server_address, chunk)
            for h, u in routes.upstreams.items()
        }


_Key = tuple[str, str, str]  # host, job, server
_Route = tuple[str, str, str, str, int]  # upstream host and address, server host and address, chunk bytes
