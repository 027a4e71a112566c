"""The scheduler as a service: reload on SIGHUP, systemd status and watchdog (DESIGN §3).

``systemctl reload mlfabric-scheduler`` sends SIGHUP; the CLI re-reads the topology and
:meth:`~mlfabric.scheduler.service.core.SchedulerCore.replace_graph` swaps the bandwidth
graph of the running service without dropping any session: connected
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

from mlfabric.scheduler.core.graph import hosts
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.systemd import Notifier

__all__ = ["status_line", "supervise"]


def status_line(state: SchedulerState, policy: str) -> str:
    """One line for ``systemctl status``: policy, graph, daemons, pending and in-flight.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> status_line(SchedulerState(star(2, 8e9)), "stf")
    'policy stf; 2 hosts, 4 links; 0 daemons; 0 pending, 0 in flight'
    """
    s = state
    return (
        f"policy {policy}; {len(hosts(s.graph))} hosts, {s.graph.number_of_edges()} links; "
        f"{len(s.daemons)} daemons; {len(s.pending)} pending, {len(s.in_flight)} in flight"
    )


async def supervise(
    status: Callable[[], str], notifier: Notifier, watchdog: float | None, every: float = 5.0
) -> None:
    """Ping the watchdog and refresh ``STATUS=`` from the loop until cancelled.

    Parameters
    ----------
    status : callable
        ``status()`` -> the service's :func:`status_line` now.
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
        line = status()
        if line != last:
            notifier.status(line)
            last = line
        await asyncio.sleep(interval)
