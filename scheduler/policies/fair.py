"""The network-agnostic baseline policy ``fair`` (DESIGN §4).

Every ready update is sent at once, straight to its server's host; the transport (TCP,
or max-min fair sharing in the simulator) shares the bottleneck among them.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlfabric.scheduler.core.graph import shortest_path
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Send, Snapshot

__all__ = ["FairPolicy"]


class FairPolicy:
    """Send every ready update at once, to its server, along its shortest path.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> u = PendingUpdate("h1/1", "j", "ps", "w", "h1", "h0", 10, 1.0, 0, 0.0)
    >>> d = FairPolicy().decide(Snapshot(now=0.0, graph=star(2, 8e9)), [u])
    >>> d.sends[0].next_hop, d.sends[0].path
    ('h0', ('h1', 'sw', 'h0'))
    """

    name = "fair"

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """One send per pending update, in the order given, expected to start now."""
        sends = tuple(
            Send(
                update_id=u.update_id,
                next_hop=u.dst_host,
                path=tuple(shortest_path(snapshot.graph, u.src_host, u.dst_host)),
                expected_start=snapshot.now,
                expected_end=snapshot.now,
            )
            for u in pending
        )
        return Decision(sends=sends)
