"""Shortest transfer first ordering with preemptive dropping (paper §5 Fig. 4, Fig. 5; DESIGN §4).

:func:`plan_stf` orders ready updates by ``ten(g)`` — the time each would end if started
when ready, given the residual bandwidth of its path — taking the smallest, reserving the
path residual for it (network time-sharing, §3.1.1: on its bottleneck it takes all that is
left), and repeating. An update whose expected delay (server version − base version + the
number of payloads ordered to arrive at its server before it) exceeds ``tau_max`` is dropped
at that point instead of reserved (Fig. 5), and the rest are ordered without it.

Reservations only lower residual bandwidth, so ``ten`` values only grow and a lazy min-heap
applies: pop the smallest key, recompute it, accept it if it is still no larger than the
next key. Updates that provably share one ``ten`` function — same ready time, same links
after their first, and an untouched first link of equal capacity (a host's NIC) — form a
*class* whose members are ordered by size alone, so only each class's head sits in the heap.
Ties break on (ten, bytes, ready time, update id): equal transfers go first come, first
served, and the plan is deterministic.

:class:`STFPolicy` wraps the planner as the service's ``stf`` policy.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache, TopologyError
from mlfabric.scheduler.core.schedule import Link, Schedule, Update
from mlfabric.scheduler.core.timeline import Timelines
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Snapshot
from mlfabric.scheduler.policies.convert import schedule_to_decision, times_to_decision
from mlfabric.scheduler.policies.planning import collector_paused, core_updates, server_key
from mlfabric.scheduler.policies.stf_book import STFBook
from mlfabric.scheduler.policies.stf_planner import Planner, drop_reason

__all__ = ["STFPolicy", "drop_reason", "plan_stf", "server_key"]


def plan_stf(
    graph: nx.DiGraph,
    updates: Sequence[Update],
    *,
    now: float = 0.0,
    timelines: Timelines | None = None,
    paths: PathCache | None = None,
    tau_max: int | Mapping[str, int] | None = None,
    server_version: int | Mapping[str, int] = 0,
    ahead: Mapping[str, int] | None = None,
    limit: int | None = None,
) -> Schedule:
    """Shortest-transfer-first plan of ``updates`` with preemptive drops (Fig. 4a, Fig. 5).

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (capacities in bytes/s).
    updates : sequence of Update
        Updates to order; none may start before ``max(ready_at, now)``.
    now : float
        Planning time.
    timelines : Timelines, optional
        Residual bandwidth to plan on (e.g. with transfers in flight already reserved);
        reserved further in place. A fresh one from ``graph`` by default.
    paths : PathCache, optional
        Path cache for ``graph``'s topology.
    tau_max : int or mapping, optional
        Delay bound, for every server or per ``Update.server``; ``None``/negative: none.
    server_version : int or mapping
        Each server's current model version.
    ahead : mapping, optional
        Server -> payloads already ordered to arrive there first (in flight).
    limit : int, optional
        Plan only the first ``limit`` transfers of the STF order (a *partial* plan: the
        updates not reached are neither planned nor dropped, so it is not checkable as a
        whole). Default: plan everything.

    Returns
    -------
    Schedule
        Transfers in STF order (``arrivals`` is that order) and the drops with reasons.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)                        # 1 MB/s NICs
    >>> us = [Update("big", "a", "ps", 3e6), Update("small", "b", "ps", 1e6)]
    >>> s = plan_stf(g, us)
    >>> s.arrivals, s.completion_times()
    (('small', 'big'), {'small': 1.0, 'big': 4.0})
    """
    tls = timelines if timelines is not None else Timelines(graph, start=now)
    pc = paths if paths is not None else PathCache(graph)
    planner = Planner(tls, now, tau_max, server_version, ahead)
    # The planner breaks ties on the id it is given. Plan under ids that rank by
    # (ready_at, update_id), so equal transfers go first come, first served: tie-breaking
    # on the callers' ids alone would starve the workers whose ids sort last.
    ids = [u.update_id for u in updates]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"update '{dup}' is listed twice")
    ranked = sorted(updates, key=lambda u: (u.ready_at, u.update_id))
    width = len(str(len(ranked)))
    real = {f"{rank:0{width}d}": u.update_id for rank, u in enumerate(ranked)}
    planner.names = real
    for alias, u in zip(real, ranked, strict=True):
        planner.by_id[alias] = u  # the planner never reads an update's own id
        try:
            planner.links_of[alias] = pc.links(u.src, u.dst)
        except TopologyError as exc:
            planner.drops[alias] = f"no route: {exc}"
            continue
        planner.add(alias, exact=False)
    planner.run(limit)
    transfers = tuple(planner.transfers)
    drops = {real[uid]: reason for uid, reason in planner.drops.items()}
    return Schedule(transfers=transfers, drops=drops, arrivals=tuple(t.payload_id for t in transfers))


class STFPolicy:
    """The ``stf`` policy: STF order with network time-sharing and tau_max drops (§3.1.1, §5).

    In-flight transfers keep their paths until their expected end; the pending updates are
    planned with :func:`plan_stf` on what is left. Each send's ``after`` names the
    transfers (in flight or planned) that end on one of its links exactly when it is planned
    to start — the transfer(s) it follows on its bottleneck — so the dispatcher releases it
    when they finish (one at a time per bottleneck).

    Parameters
    ----------
    horizon : int, optional
        Plan only the first ``horizon`` sends of the STF order per decision (they are the
        same as in the full order; the rest stay pending, undecided). This bounds the
        decision time on a large backlog, but the caller must then decide again before
        the plan runs out. Default: plan every pending update.
    incremental : bool
        Keep the pending updates' paths, ranks and classes between decisions
        (:class:`~mlfabric.scheduler.policies.stf_book.STFBook`, DESIGN §8) instead of
        planning from scratch with :func:`plan_stf`; the decisions are the same. Default True.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)
    >>> mk = lambda uid, host, size: PendingUpdate(uid, "j", "s", host, host, "ps", size, 1.0, 0, 0.0)
    >>> d = STFPolicy().decide(Snapshot(now=0.0, graph=g), [mk("big", "a", 3e6), mk("small", "b", 1e6)])
    >>> [(s.update_id, s.after, s.expected_end) for s in d.sends]
    [('small', (), 1.0), ('big', ('small',), 4.0)]
    """

    name = "stf"

    def __init__(self, horizon: int | None = None, *, incremental: bool = True) -> None:
        if horizon is not None and horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.horizon = horizon
        self.incremental = incremental
        self._paths: PathCache | None = None
        self._book = STFBook()

    def _path_cache(self, graph: nx.DiGraph) -> PathCache:
        if self._paths is None or not self._paths.same_topology(graph):
            self._paths = PathCache(graph)
        return self._paths

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Order, time and drop ``pending`` given ``snapshot`` (see the class docstring).

        Parameters
        ----------
        snapshot : Snapshot
            Time, graph (estimated capacities), in-flight transfers, versions, tau_max.
        pending : sequence of PendingUpdate
            Every update not yet released.

        Returns
        -------
        Decision
            Sends in STF order with ``after`` and expected times; drops with reasons.
        """
        with collector_paused():  # the cyclic collector: see planning.collector_paused (issue 24)
            return self._decide(snapshot, pending)

    def _decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        now = snapshot.now
        graph = snapshot.graph
        tls = Timelines(graph, start=now)
        busy: list[tuple[str, tuple[Link, ...], float]] = []
        ahead: Counter[str] = Counter()
        for f in sorted(snapshot.in_flight, key=lambda f: (f.expected_end, f.update_id)):
            links = tuple(itertools.pairwise(f.path))
            end = max(f.expected_end, now)
            if links and not all(graph.has_edge(*link) for link in links):
                continue  # the topology changed under it; it no longer reserves anything
            tls.reserve_until(links, now, end, who=f.update_id)
            busy.append((f.update_id, links, end))
            ahead[server_key(f.job, f.server)] += 1
        tau: dict[str, int] = {}
        versions: dict[str, int] = {}
        if self.incremental:
            book = self._book
            book.sync(graph, now, pending, snapshot.graph_version)
            for job, server, key in book.servers():
                tau[key] = snapshot.tau_max.get(job, -1)
                versions[key] = snapshot.server_versions.get((job, server), 0)
            touched = {link for _, links, _ in busy for link in links}
            times, drops = book.plan_times(  # (tls is dropped after: the timelines it made need not be kept)
                tls, now, tau, versions, ahead, touched=touched, limit=self.horizon, keep_timelines=False
            )
            return times_to_decision(times, drops, busy=busy)
        updates = core_updates(pending)
        for p in pending:
            key = server_key(p.job, p.server)
            tau[key] = snapshot.tau_max.get(p.job, -1)
            versions[key] = snapshot.server_versions.get((p.job, p.server), 0)
        plan = plan_stf(
            graph,
            updates,
            now=now,
            timelines=tls,
            paths=self._path_cache(graph),
            tau_max=tau,
            server_version=versions,
            ahead=ahead,
            limit=self.horizon,
        )
        return schedule_to_decision(plan, busy=busy)
