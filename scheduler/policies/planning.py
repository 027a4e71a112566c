"""What the planning policies share: pending updates as core updates, the aggregator pool, and
the transfers in flight reserved on the link timelines (DESIGN §4).

:class:`~mlfabric.scheduler.policies.stf.STFPolicy`,
:class:`~mlfabric.scheduler.policies.aggregation.AggregationPolicy` and
:class:`~mlfabric.scheduler.policies.tree_policy.TreePolicy` plan the same inputs; these
helpers turn a :class:`~mlfabric.scheduler.policies.base.Snapshot` and its pending updates
into what the planners of :mod:`mlfabric.scheduler.core` take.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import operator
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import hosts
from mlfabric.scheduler.core.records import instances
from mlfabric.scheduler.core.schedule import Link, Schedule, Update, aggregate_id
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.base import InFlight, PendingUpdate

__all__ = [
    "aggregator_pool",
    "collector_paused",
    "core_updates",
    "name_aggregates",
    "reserve_in_flight",
    "run_scope",
    "server_key",
]

#: a transfer in flight as a decision reports it: (update id, links, expected end)
Busy = tuple[str, tuple[Link, ...], float]


def server_key(job: str, server: str) -> str:
    """The string naming a (job, server) pair in plans: ``"job/server"``.

    Examples
    --------
    >>> server_key("j", "ps0")
    'j/ps0'
    """
    return f"{job}/{server}"


def core_updates(pending: Iterable[PendingUpdate]) -> list[Update]:
    """The pending updates as the planners' :class:`~mlfabric.scheduler.core.schedule.Update`.

    Each keeps its id, hosts, size, ready time, norm and base version; its server is named
    by :func:`server_key`.

    Examples
    --------
    >>> p = PendingUpdate("u1", "j", "ps0", "w1", "h1", "h0", 10, 1.0, 3, 0.5)
    >>> u = core_updates([p])[0]
    >>> u.update_id, u.src, u.dst, u.server, u.base_version
    ('u1', 'h1', 'h0', 'j/ps0', 3)
    """
    rows = [
        (
            p.update_id,
            p.src_host,
            p.dst_host,
            p.bytes,
            p.ready_at,
            p.norm,
            p.base_version,
            server_key(p.job, p.server),
        )
        for p in pending
    ]
    return instances(Update, rows)


def aggregator_pool(
    graph: nx.DiGraph,
    configured: Sequence[str] | None,
    servers: Collection[str],
    allowed: Collection[str] | None,
) -> tuple[str, ...]:
    """The hosts a plan may gather aggregates at.

    Parameters
    ----------
    graph : networkx.DiGraph
        The topology.
    configured : sequence of str or None
        The policy's aggregator hosts; None or empty means every host that is not a server's.
    servers : collection of str
        The hosts of the servers of the pending updates.
    allowed : collection of str or None
        The hosts whose daemons can aggregate now (``Snapshot.aggregators``); None: all.

    Returns
    -------
    tuple of str
        ``configured`` (or the non-server hosts), in order, kept to ``allowed``.

    Examples
    --------
    >>> g = nx.DiGraph()
    >>> g.add_node("h0", kind="host"); g.add_node("h1", kind="host"); g.add_node("h2", kind="host")
    >>> aggregator_pool(g, (), {"h0"}, None)
    ('h1', 'h2')
    >>> aggregator_pool(g, ("h2", "h1"), {"h0"}, {"h1"})
    ('h1',)
    """
    pool = tuple(configured or ()) or tuple(h for h in hosts(graph) if h not in servers)
    if allowed is not None:
        pool = tuple(h for h in pool if h in allowed)
    return pool


def reserve_in_flight(
    graph: nx.DiGraph, in_flight: Iterable[InFlight], now: float, servers: Collection[str] = ()
) -> tuple[Timelines, list[Busy], dict[str, float]]:
    """Link timelines from ``now`` with the transfers in flight reserved until their expected end.

    A transfer with no links, no finite end, or a link the graph no longer has reserves
    nothing. Transfers are reserved in order of (expected end, update id).

    Parameters
    ----------
    graph : networkx.DiGraph
        The topology (estimated capacities).
    in_flight : iterable of InFlight
        The transfers under way.
    now : float
        The time the timelines start.
    servers : collection of str
        Server hosts whose ingress end is wanted.

    Returns
    -------
    tuple
        The timelines; the reserved transfers as (update id, links, end); and for each host
        of ``servers`` that a reserved transfer ends at, the latest end.

    Examples
    --------
    >>> from mlfabric.scheduler.policies.base import InFlight
    >>> g = nx.DiGraph()
    >>> g.add_edge("h1", "h0", capacity=1e9)
    >>> f = InFlight("u1", "j", "ps0", ("h1", "h0"), 10, 0.0, 2.0)
    >>> tls, busy, until = reserve_in_flight(g, [f], 1.0, {"h0"})
    >>> busy, until
    ([('u1', (('h1', 'h0'),), 2.0)], {'h0': 2.0})
    """
    tls = Timelines(graph, start=now)
    busy: list[Busy] = []
    until: dict[str, float] = {}
    reserve = tls.reserve_until
    in_order = sorted(in_flight, key=_BY_END)
    for f, links, end in _reservations(in_order, now, graph._succ):
        reserve(links, now, end, who=f.update_id)
        busy.append((f.update_id, links, end))
        if f.path[-1] in servers:
            until[f.path[-1]] = max(until.get(f.path[-1], now), end)
    return tls, busy, until


#: reserve_in_flight's order: (expected end, update id)
_BY_END = operator.attrgetter("expected_end", "update_id")


def _reservations(
    in_flight: Iterable[InFlight], now: float, succ: Mapping[str, Mapping[str, object]]
) -> Iterator[tuple[InFlight, tuple[Link, ...], float]]:
    """Each transfer :func:`reserve_in_flight` reserves, with its links and end, in turn.

    Nothing for a transfer with no finite end, no links, or a link the graph no longer has
    (``succ``: the graph's adjacency, ``graph.has_edge`` without a call per link, issue 24).
    """
    for f in in_flight:
        end = f.expected_end
        if now > end:  # max(expected_end, now)
            end = now
        if math.isinf(end):
            continue
        links = tuple(itertools.pairwise(f.path))
        if not links:
            continue
        for a, b in links:
            if b not in succ.get(a, ()):
                break  # a link the graph no longer has
        else:
            yield f, links, end


def run_scope(server: str, scope: str) -> str:
    """The scope of a policy run's aggregate ids for ``server``: ``<server>.<scope>``, or ``server``.

    Examples
    --------
    >>> run_scope("ps", "7f3a"), run_scope("ps", "")
    ('ps.7f3a', 'ps')
    """
    return f"{server}.{scope}" if scope else server


def name_aggregates(schedule: Schedule, scope: str, first: int) -> dict[str, str]:
    """The aggregate ids a policy run gives a plan's aggregates, numbered from ``first`` in order.

    Parameters
    ----------
    schedule : Schedule
        The plan; its aggregates' ids are the planner's own.
    scope : str
        The policy run's scope (:func:`run_scope`).
    first : int
        The number of the first aggregate; the caller counts on by ``len(schedule.aggregates)``.

    Returns
    -------
    dict
        The planner's aggregate id -> ``agg:<server host>[.<scope>]:<n>``.

    Examples
    --------
    >>> from mlfabric.scheduler.core.schedule import Aggregate
    >>> plan = Schedule(aggregates=(Aggregate("g1", "h2", ("u1", "u2"), 1e6, "h0"),))
    >>> name_aggregates(plan, "7f3a", 4)
    {'g1': 'agg:h0.7f3a:4'}
    """
    return {
        a.aggregate_id: aggregate_id(run_scope(a.dst, scope), first + i)
        for i, a in enumerate(schedule.aggregates)
    }


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (planning makes no reference cycles).

    A full collection walks the caller's whole heap: about a quarter of a 1,024-worker
    decision's CPU time was spent in collections triggered by the planner's short-lived
    objects (``experiments/bench_trees.py``). Acyclic objects are still freed at once.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
