"""Exhaustive enumeration of tiny instances: the ILP's check (DESIGN §4).

:func:`brute_force` enumerates, for a tiny instance, every route of every update (direct, or
via one aggregator; one aggregate per aggregator, as in the ILP of appendix 10.1) and every
order in which the payloads (first legs and aggregates) take the network. Each order is
played as a list schedule under network time-sharing (paper §3.1.1): the next payload takes
the whole residual bandwidth of its path from the time it is ready on
(:meth:`~mlfabric.scheduler.core.timeline.Timelines.reserve`, the ``ten`` of Fig. 4b); an
aggregate is ready when its last member arrived. The best plan is the optimum of the
fluid, time-shared model; on slot-aligned instances (every update a whole number of slots
on every link, ready at slot boundaries) it equals the ILP's optimum with ``groups=1``
(``tests/plan/test_plan_ilp.py`` checks this on random tiny instances).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from mlfabric.scheduler.core.graph import path_links
from mlfabric.scheduler.core.schedule import Aggregate, Link, Schedule, Transfer, aggregate_id
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.plan.instance import Instance

__all__ = ["BruteForceResult", "brute_force"]

Route = str | None


@dataclass(frozen=True)
class BruteForceResult:
    """The best plan found by :func:`brute_force`.

    Attributes
    ----------
    schedule : Schedule
        The optimal list schedule.
    objective : float
        Its objective (s): mean completion or makespan.
    routes : dict
        Update id -> aggregator or ``None`` (direct).
    order : tuple of str
        Payload ids in the order they took the network.
    explored : int
        Partial orders expanded (a measure of the search effort).
    """

    schedule: Schedule
    objective: float
    routes: dict[str, Route]
    order: tuple[str, ...]
    explored: int


@dataclass
class _Search:
    instance: Instance
    routes: dict[str, Route]
    payloads: dict[str, tuple[list[Link], float, tuple[str, ...]]]  # links, bytes, members
    lower: dict[str, float]  # payload -> lower bound on the end of the payload
    duration: dict[str, float]  # payload -> time at its path's full rate
    best: float
    best_plan: tuple[tuple[str, ...], list[Transfer]] | None = None
    explored: int = 0


def _route_plans(instance: Instance, routes: dict[str, Route]) -> _Search:
    payloads: dict[str, tuple[list[Link], float, tuple[str, ...]]] = {}
    lower: dict[str, float] = {}
    duration: dict[str, float] = {}
    members: dict[str, list[str]] = {}
    for u in instance.updates:
        hop = routes[u.update_id] or instance.server
        links = path_links(list(instance.path(u.src, hop)))
        payloads[u.update_id] = (links, u.bytes, ())
        duration[u.update_id] = u.bytes / instance.path_rate(instance.path(u.src, hop))
        lower[u.update_id] = u.ready_at + duration[u.update_id]
        if routes[u.update_id] is not None:
            members.setdefault(hop, []).append(u.update_id)
    for a, mem in members.items():
        path = instance.path(a, instance.server)
        size = max(payloads[m][1] for m in mem)
        aid = aggregate_id(a)
        payloads[aid] = (path_links(list(path)), size, tuple(mem))
        duration[aid] = size / instance.path_rate(path)
        lower[aid] = max(lower[m] for m in mem) + duration[aid]
    return _Search(instance, routes, payloads, lower, duration, math.inf)


def _cost(search: _Search, ends: dict[str, float]) -> float:
    """Objective with ``ends`` for finished payloads and lower bounds for the others."""
    makespan = search.instance.objective == "makespan"
    total = 0.0
    for pid, (_, _, mem) in search.payloads.items():
        if pid in search.routes and search.routes[pid] is not None:
            continue  # counted through its aggregate
        end = ends.get(pid, search.lower[pid])
        if pid not in ends and mem:
            end = max(end, max(ends.get(m, search.lower[m]) for m in mem) + search.duration[pid])
        total = max(total, end) if makespan else total + end * max(1, len(mem))
    return total if makespan else total / len(search.instance.updates)


def _dfs(
    search: _Search, tls: Timelines, order: list[str], transfers: list[Transfer], ends: dict[str, float]
) -> None:
    search.explored += 1
    if len(order) == len(search.payloads):
        cost = _cost(search, ends)
        if cost < search.best - 1e-12:
            search.best = cost
            search.best_plan = (tuple(order), list(transfers))
        return
    if _cost(search, ends) >= search.best - 1e-12:
        return
    for pid, (links, size, mem) in search.payloads.items():
        if pid in ends or any(m not in ends for m in mem):
            continue
        ready = max(ends[m] for m in mem) if mem else search.instance.update(pid).ready_at
        branch = tls.copy()
        sent = branch.transfer(pid, (links[0][0], *(v for _, v in links)), size, ready)
        order.append(pid)
        transfers.append(sent)
        ends[pid] = sent.end
        _dfs(search, branch, order, transfers, ends)
        del ends[pid]
        transfers.pop()
        order.pop()


def brute_force(instance: Instance, *, max_updates: int = 7) -> BruteForceResult:
    """Optimal routes and order of a tiny instance by exhaustive search (with bounding).

    Parameters
    ----------
    instance : Instance
        At most ``max_updates`` updates.
    max_updates : int
        Guard against exponential blow-up.

    Returns
    -------
    BruteForceResult

    Examples
    --------
    Two updates sharing the server's ingress: the smaller first (shortest transfer first).

    >>> from mlfabric.scheduler.plan.instance import parse_instance
    >>> inst = parse_instance({
    ...     "topology": {"hosts": ["s", "w1", "w2"], "switches": ["sw"],
    ...                  "links": [{"a": h, "b": "sw", "mbps": 8} for h in ("s", "w1", "w2")]},
    ...     "server": "s", "updates": [{"id": "a", "worker": "w1", "bytes": 2000000},
    ...                                {"id": "b", "worker": "w2", "bytes": 1000000}]})
    >>> r = brute_force(inst)
    >>> r.order, r.objective
    (('b', 'a'), 2.0)
    """
    if len(instance.updates) > max_updates:
        raise ValueError(f"brute force is for at most {max_updates} updates, got {len(instance.updates)}")
    ids = [u.update_id for u in instance.updates]
    best: _Search | None = None
    explored = 0
    for choice in itertools.product(*(instance.routes(uid) for uid in ids)):
        search = _route_plans(instance, dict(zip(ids, choice, strict=True)))
        if best is not None:
            search.best = best.best
            if _cost(search, {}) >= search.best - 1e-12:
                continue
        _dfs(search, Timelines(instance.graph), [], [], {})
        explored += search.explored
        if search.best_plan is not None:
            best = search
    assert best is not None and best.best_plan is not None
    order, transfers = best.best_plan
    aggregates = tuple(
        Aggregate(pid, best.routes[mem[0]] or instance.server, mem, size, instance.server)
        for pid, (_, size, mem) in best.payloads.items()
        if mem
    )
    schedule = Schedule(transfers=tuple(transfers), aggregates=aggregates)
    return BruteForceResult(schedule, best.best, best.routes, order, explored)
