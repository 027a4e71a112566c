"""Replication with bounded divergence (paper §4, Fig. 3; DESIGN §4).

Every update applied at a server ``S`` must also reach ``S``'s replica ``R``. Instead of
chain replication (``S`` forwards to ``R`` and waits), the scheduler sends each update to
``R`` from wherever it already is, as background traffic off ``S``'s bottleneck, and keeps
the *divergence* — the sum of the norms of the updates applied at ``S`` and not yet at
``R`` — within ``div_max``:

* every update applied at ``S`` and not yet at ``R`` (nor on its way) is sent to ``R`` now,
  largest norm first (the most divergence removed per transfer);
* updates waiting to be applied at ``S`` are applied in order while the divergence stays
  within ``div_max``; the first that would break the bound is *held*, with every update
  behind it (arrival order is kept), and is sent to ``R`` ahead of its application — once
  it is at ``R`` applying it adds nothing;
* as the divergence nears ``div_max`` (``urgency`` of it) or anything is held, replica
  transfers win priority over other traffic.

If ``S`` fails, ``R`` is promoted; the model lost is bounded by ``div_max``.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from mlfabric.scheduler.core.graph import TopologyError, shortest_path
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, ReplicaSend, ReplicaView, Snapshot

__all__ = ["ReplicationDecision", "ReplicationPolicy", "divergence", "plan_replication"]


def divergence(applied: Mapping[str, float], at_replica: Collection[str]) -> float:
    """Sum of the norms of updates applied at the server and not yet at its replica (Fig. 3).

    Examples
    --------
    >>> divergence({"u1": 1.0, "u2": 2.5}, {"u1"})
    2.5
    """
    return sum(norm for uid, norm in applied.items() if uid not in at_replica)


@dataclass(frozen=True)
class ReplicationDecision:
    """What to do now for one server and its replica.

    Attributes
    ----------
    send_now : tuple of str
        Updates to send to the replica now, in priority order.
    apply_now : tuple of str
        Waiting updates the server may apply now, in order.
    hold : tuple of str
        Waiting updates the server must not apply yet (the bound would break).
    divergence : float
        Divergence now.
    divergence_after : float
        Divergence once ``apply_now`` are applied, before any replica transfer lands.
    urgent : bool
        Replica transfers should win priority over other traffic.
    """

    send_now: tuple[str, ...]
    apply_now: tuple[str, ...]
    hold: tuple[str, ...]
    divergence: float
    divergence_after: float
    urgent: bool


def plan_replication(
    applied: Mapping[str, float],
    at_replica: Collection[str],
    *,
    div_max: float,
    to_apply: Sequence[tuple[str, float]] = (),
    in_flight: Collection[str] = (),
    urgency: float = 0.5,
) -> ReplicationDecision:
    """Decide replica transfers and which applications may proceed (Fig. 3).

    Parameters
    ----------
    applied : mapping of str to float
        Updates applied at the server -> their norms.
    at_replica : collection of str
        Updates the replica has.
    div_max : float
        Divergence bound (>= 0).
    to_apply : sequence of (str, float)
        Updates arrived at the server and waiting to be applied, in order, with norms.
    in_flight : collection of str
        Updates already on their way to the replica.
    urgency : float
        Fraction of ``div_max`` from which replica transfers are urgent.

    Returns
    -------
    ReplicationDecision

    Raises
    ------
    ValueError
        If ``div_max`` is negative or the divergence already exceeds it.

    Examples
    --------
    >>> waiting = [("u2", 0.5), ("u3", 1.0), ("u4", 0.1)]
    >>> d = plan_replication({"u1": 2.0}, set(), div_max=3.0, to_apply=waiting)
    >>> d.apply_now, d.hold, d.send_now, d.divergence_after, d.urgent
    (('u2',), ('u3', 'u4'), ('u1', 'u2', 'u3', 'u4'), 2.5, True)
    """
    if div_max < 0:
        raise ValueError(f"div_max must be >= 0, got {div_max}")
    have = set(at_replica)
    now_div = divergence(applied, have)
    if now_div > div_max * (1 + 1e-12):
        raise ValueError(f"divergence {now_div:g} already exceeds div_max {div_max:g}")
    div = now_div
    apply_now: list[str] = []
    hold: list[str] = []
    for uid, norm in to_apply:
        add = 0.0 if uid in have else norm
        if not hold and div + add <= div_max:
            apply_now.append(uid)
            div += add
        else:
            hold.append(uid)
    moving = set(in_flight) | have
    lagging = sorted(
        ((uid, norm) for uid, norm in applied.items() if uid not in moving),
        key=lambda item: (-item[1], item[0]),
    )
    send = [uid for uid, _ in lagging]
    send += [uid for uid in apply_now if uid not in moving]
    send += [uid for uid in hold if uid not in moving]
    return ReplicationDecision(
        send_now=tuple(send),
        apply_now=tuple(apply_now),
        hold=tuple(hold),
        divergence=now_div,
        divergence_after=div,
        urgent=bool(hold) or div >= urgency * div_max,
    )


class ReplicationPolicy:
    """Decide replica transfers for every server with a replica (paper Fig. 3, as executed).

    The entries a server applied and its replica lacks sit in the server daemon's log; this
    policy says when they move (:class:`~mlfabric.scheduler.policies.base.ReplicaSend`, from
    the server's host, in version order since the replica applies them in the server's order):

    * **urgent** — chain replication (``div_max <= 0``), a server waiting for its replica
      (``blocked``), a divergence at ``urgency`` x ``div_max`` or more, or one that the next
      pending update of that server would push past ``div_max``: every lagging entry goes now;
    * **spare bandwidth** — no transfer in flight and no pending update would share a
      (directed) link with the server -> replica path: every lagging entry goes now
      (background traffic: pushes *into* the server's host do not compete with copies *out*
      of it);
    * otherwise the entries wait (the divergence stays within ``div_max``).

    Pure: runs on the snapshot's replica views (``ReplicaView``).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> view = ReplicaView("j", "ps", "h0", "h1", 3.0, 0, 0, (("u1", 1, 1.0),))
    >>> snap = Snapshot(0.0, star(["h0", "h1", "h2"], 1e9), replicas={("j", "ps"): view})
    >>> [r.update_id for r in ReplicationPolicy().decide(snap, ()).replicas]  # idle links: spare
    ['u1']
    >>> busy = PendingUpdate("h2/1", "j", "ps", "w", "h2", "h0", 8, 2.5, 0, 0.0)
    >>> ReplicationPolicy().decide(snap, [busy]).replicas   # 1.0 + 2.5 would exceed 3.0: urgent
    (ReplicaSend(update_id='u1', src='h0', replica='h1', path=('h0', 'sw', 'h1'), after=(), \
expected_start=0.0, expected_end=0.0),)
    >>> other = PendingUpdate("h2/2", "j2", "ps2", "w", "h2", "h1", 8, 0.1, 0, 0.0)  # into h1
    >>> ReplicationPolicy().decide(snap, [other]).replicas  # within the bound, sw -> h1 busy: wait
    ()
    """

    name = "replication"

    def __init__(self, urgency: float = 0.5) -> None:
        self.urgency = urgency

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """The replica sends to make now (only ``Decision.replicas`` is set)."""
        sends: list[ReplicaSend] = []
        for key, view in sorted(snapshot.replicas.items()):
            lagging = [(uid, v) for uid, v, _ in view.log if v > max(view.directed, view.replica_version)]
            if not lagging:
                continue
            waiting = [p for p in pending if (p.job, p.server) == key]
            path = _path(snapshot, view.server_host, view.replica_host)
            if not (self._urgent(view, waiting) or self._spare(snapshot, path, pending)):
                continue
            sends += [ReplicaSend(uid, view.server_host, view.replica_host, path) for uid, _ in lagging]
        return Decision(replicas=tuple(sends))

    def _urgent(self, view: ReplicaView, waiting: Sequence[PendingUpdate]) -> bool:
        if view.div_max <= 0 or view.blocked:
            return True
        div = sum(norm for _, v, norm in view.log if v > view.replica_version)
        nxt = min(waiting, key=lambda p: p.ready_at).norm if waiting else 0.0
        return div >= self.urgency * view.div_max or div + nxt > view.div_max

    @staticmethod
    def _spare(snapshot: Snapshot, path: tuple[str, ...], pending: Sequence[PendingUpdate]) -> bool:
        """No transfer in flight, and no pending update, would share a (directed) link with ``path``."""
        links = set(itertools.pairwise(path))
        if any(links.intersection(itertools.pairwise(f.path)) for f in snapshot.in_flight):
            return False
        routes = {(p.src_host, p.dst_host) for p in pending}
        return not any(links.intersection(itertools.pairwise(_path(snapshot, a, b))) for a, b in routes)


def _path(snapshot: Snapshot, src: str, dst: str) -> tuple[str, ...]:
    try:
        return tuple(shortest_path(snapshot.graph, src, dst))
    except TopologyError:
        return (src, dst)
