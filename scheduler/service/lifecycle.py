"""The scheduler as a service: reload on SIGHUP, systemd status and watchdog (DESIGN §3).

``systemctl reload mlfabric-scheduler`` sends SIGHUP; :func:`reload_topology` then swaps
the bandwidth graph of the running service without dropping any session: connected
daemons, registered roles, pending and in-flight updates stay; new decisions use the new
graph and a fresh estimator (the old estimates belong to the old links). A topology that
no longer holds the host of a connected daemon is refused and the old graph kept.

:func:`supervise` is the task that keeps systemd informed: a ``STATUS=`` line with the
daemons, pending and in-flight counts, and ``WATCHDOG=1`` from the event loop itself (a
stuck loop misses its pings and systemd restarts the unit, ``WatchdogSec=``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mlfabric.scheduler.core.graph import hosts
from mlfabric.systemd import Notifier

__all__ = ["reload_topology", "status_line", "supervise"]


def reload_topology(core: Any, graph: Any, make_estimator: Callable[[Any], Any]) -> None:
    """Make ``graph`` the service's bandwidth graph, keeping every session and update.

    Parameters
    ----------
    core : SchedulerCore
        The running service.
    graph : networkx.DiGraph
        The new bandwidth graph.
    make_estimator : callable
        ``make_estimator(graph)``: the estimator for the new graph. When the service's
        estimator wraps another (``inner``, as :class:`~.metrics.MeteredEstimator`), the
        inner one is replaced so the counters go on.

    Raises
    ------
    ValueError
        A connected daemon's host is not a host of ``graph`` (nothing is changed).

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.state import SchedulerState
    >>> core = SimpleNamespace(state=SchedulerState(star(2, 8e9)), estimator=None)
    >>> _ = core.state.connect("h0", "127.0.0.1:9")
    >>> reload_topology(core, star(3, 8e9), lambda g: "estimator")
    >>> sorted(hosts(core.state.graph)), core.estimator
    (['h0', 'h1', 'h2'], 'estimator')
    >>> reload_topology(core, star(["x"], 8e9), lambda g: None)
    Traceback (most recent call last):
    ...
    ValueError: the new topology lacks the hosts of connected daemons: h0 (kept the old one)
    """
    core.state.replace_graph(graph)
    estimator = make_estimator(graph)
    if hasattr(core.estimator, "inner"):
        core.estimator.inner = estimator
    else:
        core.estimator = estimator


def status_line(core: Any) -> str:
    """One line for ``systemctl status``: policy, graph, daemons, pending and in-flight.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.state import SchedulerState
    >>> core = SimpleNamespace(state=SchedulerState(star(2, 8e9)), policy=SimpleNamespace(name="stf"))
    >>> status_line(core)
    'policy stf; 2 hosts, 4 links; 0 daemons; 0 pending, 0 in flight'
    """
    s = core.state
    return (
        f"policy {core.policy.name}; {len(hosts(s.graph))} hosts, {s.graph.number_of_edges()} links; "
        f"{len(s.daemons)} daemons; {len(s.pending)} pending, {len(s.in_flight)} in flight"
    )


async def supervise(core: Any, notifier: Notifier, watchdog: float | None, every: float = 5.0) -> None:
    """Ping the watchdog and refresh ``STATUS=`` from the loop until cancelled.

    Parameters
    ----------
    core : SchedulerCore
        The running service (for :func:`status_line`).
    notifier : Notifier
        Where the messages go (a no-op outside systemd).
    watchdog : float or None
        Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec=``); None: no watchdog.
    every : float
        Longest interval between status refreshes.
    """
    interval = min(every, watchdog) if watchdog else every
    last = ""
    while True:
        if watchdog:
            notifier.watchdog()
        line = status_line(core)
        if line != last:
            notifier.status(line)
            last = line
        await asyncio.sleep(interval)
