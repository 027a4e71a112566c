"""The invariant checker every plan must pass (like networkx's ``validate_flows``).

:func:`check_schedule` verifies a :class:`~mlfabric.scheduler.core.schedule.Schedule` against
its bandwidth graph and updates:

1. every transfer follows links of the graph, its reservations lie on its path inside its
   ``[start, end]`` and carry its bytes over every link;
2. no link's reserved rate ever exceeds its capacity (network time-sharing, paper §3.1.1);
3. every update is delivered, dropped (Fig. 5) or aggregated (Fig. 6) exactly once, and
   every aggregate is delivered exactly once;
4. an aggregate leaves its aggregator only after all its members arrived, and is one
   update's size; a *pipelined* aggregate (``pipelined=``, cut-through:
   :mod:`~mlfabric.scheduler.policies.pipelined`) may leave while they arrive, but at no
   time has it forwarded a larger share of its bytes than any member has delivered to it;
5. no update is applied with a delay above ``tau_max`` (paper §5, DESIGN §4).

Violations raise :class:`ScheduleError` naming the update, link and time.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from mlfabric.scheduler.core.schedule import Aggregate, Link, Schedule, Transfer, Update

__all__ = ["CheckResult", "ScheduleError", "check_schedule"]


class ScheduleError(ValueError):
    """A schedule violates an invariant; the message names the update, link and time."""


@dataclass(frozen=True)
class CheckResult:
    """What the checker learned from a valid schedule.

    Attributes
    ----------
    delays : mapping of str to int
        Update id -> delay at apply time (server version then minus ``base_version``).
    arrivals : mapping of str to tuple of str
        Server -> payload ids in the order they are applied.
    """

    delays: Mapping[str, int]
    arrivals: Mapping[str, tuple[str, ...]]


def _per_server(value: int | Mapping[str, int] | None, server: str, default: int | None) -> int | None:
    if value is None or isinstance(value, int):
        return default if value is None else value
    return value.get(server, default)


def _check_transfer(graph: nx.DiGraph, t: Transfer, payload_bytes: float, rtol: float) -> None:
    who = f"transfer of '{t.payload_id}'"
    if not t.path or t.path[0] != t.src or t.path[-1] != t.dst:
        raise ScheduleError(f"{who}: path {t.path} does not run from {t.src} to {t.dst}")
    if t.end < t.start:
        raise ScheduleError(f"{who}: ends at t={t.end:g} before it starts at t={t.start:g}")
    if abs(t.bytes - payload_bytes) > rtol * max(1.0, payload_bytes):
        raise ScheduleError(f"{who}: moves {t.bytes:g} bytes, the payload has {payload_bytes:g}")
    links = t.links
    for link in links:
        if not graph.has_edge(*link):
            raise ScheduleError(f"{who}: link {link} is not in the bandwidth graph")
    carried: dict[Link, float] = dict.fromkeys(links, 0.0)
    slack = rtol * max(1.0, abs(t.end))
    for r in t.reservations:
        if r.link not in carried:
            raise ScheduleError(f"{who}: reserves link {r.link}, which is not on its path {t.path}")
        if r.rate < 0 or r.end < r.start:
            raise ScheduleError(
                f"{who}: bad reservation on {r.link}: rate {r.rate:g} over [{r.start:g}, {r.end:g}]"
            )
        if r.start < t.start - slack or r.end > t.end + slack:
            raise ScheduleError(
                f"{who}: reservation on {r.link} over [{r.start:g}, {r.end:g}] lies outside "
                f"the transfer's [{t.start:g}, {t.end:g}]"
            )
        carried[r.link] += r.rate * (r.end - r.start)
    for link, moved in carried.items():
        if abs(moved - t.bytes) > rtol * max(1.0, t.bytes):
            raise ScheduleError(f"{who}: link {link} carries {moved:g} of its {t.bytes:g} bytes")


def _share(t: Transfer, link: Link | None, at: float) -> float:
    """The share of ``t``'s bytes through ``link`` by time ``at`` (no link: all at ``t.end``)."""
    if link is None or t.bytes <= 0:
        return 1.0 if at >= t.end else 0.0
    moved = sum(
        r.rate * (min(at, r.end) - r.start) for r in t.reservations if r.link == link and at > r.start
    )
    return moved / t.bytes


def _check_streamed(out: Transfer, member: Transfer, rtol: float) -> None:
    """A pipelined aggregate's ``out`` never forwarded more of its bytes than ``member`` delivered.

    Both shares are piecewise linear in time, so comparing them at every breakpoint of either
    (a reservation's start or end) compares them everywhere.
    """
    first = out.links[0] if out.links else None
    last = member.links[-1] if member.links else None
    times = {out.start, out.end, member.start, member.end}
    times.update(x for r in out.reservations if r.link == first for x in (r.start, r.end))
    times.update(x for r in member.reservations if r.link == last for x in (r.start, r.end))
    for at in sorted(times):
        sent, got = _share(out, first, at), _share(member, last, at)
        if sent > got + rtol * max(1.0, abs(at)):
            raise ScheduleError(
                f"pipelined aggregate '{out.payload_id}' has forwarded {sent:.6g} of its bytes at t={at:g}, "
                f"member '{member.payload_id}' delivered {got:.6g}"
            )


def _check_capacity(
    graph: nx.DiGraph,
    transfers: Sequence[Transfer],
    capacity_profiles: Mapping[Link, Sequence[tuple[float, float]]],
    rtol: float,
) -> None:
    events: dict[Link, list[tuple[float, float, str]]] = defaultdict(list)
    for t in transfers:
        for r in t.reservations:
            if r.end > r.start and r.rate > 0:
                events[r.link].append((r.start, r.rate, t.payload_id))
                events[r.link].append((r.end, -r.rate, t.payload_id))
    for link, evs in events.items():
        profile = sorted(capacity_profiles.get(link, ()))
        static = float(graph.edges[link]["capacity"])
        times = sorted({e[0] for e in evs} | {p[0] for p in profile})
        evs.sort(key=lambda e: e[0])
        i, used, k = 0, 0.0, -1
        active: dict[str, float] = defaultdict(float)
        for time in times:
            while i < len(evs) and evs[i][0] <= time:
                used += evs[i][1]
                active[evs[i][2]] += evs[i][1]
                i += 1
            while k + 1 < len(profile) and profile[k + 1][0] <= time:
                k += 1
            cap = profile[k][1] if k >= 0 else static
            if used > cap * (1 + rtol) + rtol:
                who = ", ".join(sorted(p for p, rate in active.items() if rate > rtol))
                raise ScheduleError(
                    f"link {link} over capacity at t={time:g}: {used:g} B/s reserved of {cap:g} B/s by {who}"
                )


def check_schedule(
    graph: nx.DiGraph,
    schedule: Schedule,
    *,
    updates: Sequence[Update],
    tau_max: int | Mapping[str, int] | None = None,
    server_version: int | Mapping[str, int] = 0,
    capacity_profiles: Mapping[Link, Sequence[tuple[float, float]]] | None = None,
    rtol: float = 1e-6,
    pipelined: Collection[str] = (),
) -> CheckResult:
    """Verify ``schedule`` for ``updates`` on ``graph``; raise on the first violation.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph with ``capacity`` (bytes/s) on every link.
    schedule : Schedule
        The plan to check.
    updates : sequence of Update
        Every update the plan is for.
    tau_max : int or mapping, optional
        Delay bound, for all servers or per server; ``None`` or negative: unbounded.
    server_version : int or mapping
        Each server's model version before the schedule starts.
    capacity_profiles : mapping, optional
        For links whose capacity changes: ``link -> [(time, capacity), ...]``; before the
        first breakpoint the graph's capacity applies.
    rtol : float
        Relative tolerance for byte counts, rates and times.
    pipelined : collection of str
        Aggregates forwarded cut-through (their bytes leave as their members' arrive): each
        is checked by the share rule of 4. instead of waiting for its members.

    Returns
    -------
    CheckResult
        The applied delay of every delivered update and the arrival order per server.

    Raises
    ------
    ScheduleError
        Naming the update, aggregate, link and time of the violation.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.core.schedule import Transfer, Update
    >>> g = star(["ps", "w1"], 8.0)                    # 1 byte/s links
    >>> u = Update("u1", "w1", "ps", 2.0)
    >>> s = Schedule(transfers=(Transfer.at_rate("u1", ("w1", "sw", "ps"), start=0, bytes=2, rate=1),))
    >>> check_schedule(g, s, updates=[u]).delays
    {'u1': 0}
    >>> bad = Schedule(transfers=(Transfer.at_rate("u1", ("w1", "sw", "ps"), start=0, bytes=2, rate=2),))
    >>> try:
    ...     check_schedule(g, bad, updates=[u])
    ... except ScheduleError as exc:
    ...     print(exc)
    link ('w1', 'sw') over capacity at t=0: 2 B/s reserved of 1 B/s by u1
    """
    by_update: dict[str, Update] = {}
    for u in updates:
        if u.update_id in by_update:
            raise ScheduleError(f"update '{u.update_id}' is listed twice")
        by_update[u.update_id] = u
    by_aggregate: dict[str, Aggregate] = {}
    parent: dict[str, str] = {}
    for a in schedule.aggregates:
        if a.aggregate_id in by_update or a.aggregate_id in by_aggregate:
            raise ScheduleError(f"aggregate id '{a.aggregate_id}' is not unique")
        by_aggregate[a.aggregate_id] = a
    for a in schedule.aggregates:
        if not a.members:
            raise ScheduleError(f"aggregate '{a.aggregate_id}' has no members")
        for m in a.members:
            if m not in by_update and m not in by_aggregate:
                raise ScheduleError(f"aggregate '{a.aggregate_id}': unknown member '{m}'")
            if m in parent:
                raise ScheduleError(f"'{m}' is aggregated twice ('{parent[m]}' and '{a.aggregate_id}')")
            if m in schedule.drops:
                raise ScheduleError(f"'{m}' is both dropped and aggregated in '{a.aggregate_id}'")
            parent[m] = a.aggregate_id
    for d in schedule.drops:
        if d not in by_update:
            raise ScheduleError(f"dropped id '{d}' is not an update")

    def leaves(pid: str, seen: frozenset[str] = frozenset()) -> list[Update]:
        if pid in by_update:
            return [by_update[pid]]
        if pid in seen:
            raise ScheduleError(f"aggregate '{pid}' contains itself")
        return [u for m in by_aggregate[pid].members for u in leaves(m, seen | {pid})]

    size: dict[str, float] = {uid: u.bytes for uid, u in by_update.items()}
    server_of: dict[str, str] = {uid: u.server for uid, u in by_update.items()}
    dst_of: dict[str, str] = {uid: u.dst for uid, u in by_update.items()}
    for aid, a in by_aggregate.items():
        members = leaves(aid)
        servers = {u.server for u in members}
        if len(servers) != 1:
            raise ScheduleError(f"aggregate '{aid}' mixes updates for servers {sorted(servers)}")
        server_of[aid] = servers.pop()
        dst_of[aid] = a.dst or members[0].dst
        one = max(u.bytes for u in members)
        if abs(a.bytes - one) > rtol * max(1.0, one):
            raise ScheduleError(f"aggregate '{aid}' has {a.bytes:g} bytes, not one update's size ({one:g})")
        size[aid] = a.bytes

    deliveries: dict[str, Transfer] = {}
    for t in schedule.transfers:
        pid = t.payload_id
        if pid not in size:
            raise ScheduleError(f"transfer of unknown payload '{pid}'")
        if pid in schedule.drops:
            raise ScheduleError(f"update '{pid}' is dropped ({schedule.drops[pid]}) but has a transfer")
        _check_transfer(graph, t, size[pid], rtol)
        if t.replica:
            continue
        if pid in deliveries:
            raise ScheduleError(f"'{pid}' is delivered twice (t={deliveries[pid].end:g} and t={t.end:g})")
        deliveries[pid] = t
    for pid in size:
        if pid in schedule.drops:
            continue
        if pid not in deliveries:
            raise ScheduleError(f"'{pid}' is neither delivered, dropped nor aggregated")
        t = deliveries[pid]
        hop = by_aggregate[parent[pid]].aggregator if pid in parent else dst_of[pid]
        if t.dst != hop:
            raise ScheduleError(f"'{pid}' is delivered to {t.dst}, its next hop is {hop}")
        slack = rtol * max(1.0, abs(t.start))
        if pid in by_update:
            u = by_update[pid]
            if t.src != u.src or t.start < u.ready_at - slack:
                raise ScheduleError(
                    f"update '{pid}' leaves {t.src} at t={t.start:g}; "
                    f"it is ready at {u.src} at t={u.ready_at:g}"
                )
        else:
            a = by_aggregate[pid]
            if t.src != a.aggregator:
                raise ScheduleError(f"aggregate '{pid}' leaves {t.src}, not its aggregator {a.aggregator}")
            if pid in pipelined:
                for m in a.members:
                    _check_streamed(t, deliveries[m], rtol)
                continue
            for m in a.members:
                arrived = deliveries[m].end
                if t.start < arrived - slack:
                    raise ScheduleError(
                        f"aggregate '{pid}' leaves {a.aggregator} at t={t.start:g} before member '{m}' "
                        f"arrived at t={arrived:g}"
                    )

    _check_capacity(graph, schedule.transfers, capacity_profiles or {}, rtol)

    at_server: dict[str, list[str]] = defaultdict(list)
    if schedule.arrivals:
        expected = {pid for pid in deliveries if pid not in parent}
        if len(schedule.arrivals) != len(set(schedule.arrivals)) or set(schedule.arrivals) != expected:
            missing = sorted(expected - set(schedule.arrivals))
            extra = sorted(set(schedule.arrivals) - expected)
            raise ScheduleError(
                f"arrivals order is not the delivered payloads: missing {missing}, extra {extra}"
            )
        for pid in schedule.arrivals:
            at_server[server_of[pid]].append(pid)
        for server, order in at_server.items():
            for a_id, b_id in itertools.pairwise(order):
                if deliveries[b_id].end < deliveries[a_id].end - rtol * max(1.0, deliveries[a_id].end):
                    raise ScheduleError(
                        f"server {server}: '{b_id}' is listed after '{a_id}' but arrives earlier "
                        f"(t={deliveries[b_id].end:g} < t={deliveries[a_id].end:g})"
                    )
    else:
        order_ends = sorted((t.end, pid) for pid, t in deliveries.items() if pid not in parent)
        for _, pid in order_ends:
            at_server[server_of[pid]].append(pid)

    delays: dict[str, int] = {}
    for server, order in at_server.items():
        version = _per_server(server_version, server, 0) or 0
        bound = _per_server(tau_max, server, None)
        for pid in order:
            for u in leaves(pid):
                delay = version - u.base_version
                delays[u.update_id] = delay
                if bound is not None and bound >= 0 and delay > bound:
                    raise ScheduleError(
                        f"update '{u.update_id}' applied at server {server} at t={deliveries[pid].end:g} "
                        f"with delay {delay} > tau_max {bound} (version {version}, base {u.base_version})"
                    )
            version += 1
    return CheckResult(delays=delays, arrivals={s: tuple(o) for s, o in at_server.items()})
