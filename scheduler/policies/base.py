"""The policy interface between the scheduler service and the scheduling algorithms.

A policy is an object with no I/O: :meth:`Policy.decide` maps a :class:`Snapshot` of the
scheduler's state and the updates not yet released to a :class:`Decision` — which updates
go (to which next hop, after which transfers), and which are dropped (with a reason).
The service calls it after each batch of ready notifications and releases the sends as
their ``after`` transfers finish (or nearly finish, so a bottleneck never idles on
control latency). Every call sees *all* pending updates, so later arrivals can be
ordered ahead of earlier ones that have not started yet.

Policies are registered in :data:`POLICIES` by name (``fair``, ``stf``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import networkx as nx

__all__ = [
    "POLICIES",
    "Decision",
    "Drop",
    "FairPolicy",
    "InFlight",
    "PendingUpdate",
    "PlannedAggregate",
    "Policy",
    "Send",
    "Snapshot",
    "make_policy",
]

ServerKey = tuple[str, str]  # (job, server)


@dataclass(frozen=True)
class PendingUpdate:
    """An update that is ready at ``src_host`` and has not been released yet."""

    update_id: str
    job: str
    server: str
    worker: str
    src_host: str
    dst_host: str
    bytes: int
    norm: float
    base_version: int
    ready_at: float


@dataclass(frozen=True)
class InFlight:
    """A released transfer the scheduler has not yet seen reported done."""

    update_id: str
    job: str
    server: str
    path: tuple[str, ...]
    bytes: int
    started_at: float
    expected_end: float


@dataclass(frozen=True)
class Snapshot:
    """What a policy may look at. Capacities in ``graph`` are the current estimates."""

    now: float
    graph: nx.DiGraph
    in_flight: tuple[InFlight, ...] = ()
    #: (job, server) -> the server's model version as last reported
    server_versions: Mapping[ServerKey, int] = field(default_factory=dict)
    #: job -> tau_max (< 0: unbounded)
    tau_max: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Send:
    """Release ``update_id`` to ``next_hop`` once every transfer in ``after`` is (nearly) done."""

    update_id: str
    next_hop: str
    path: tuple[str, ...]
    after: tuple[str, ...] = ()
    expected_start: float = 0.0
    expected_end: float = 0.0


@dataclass(frozen=True)
class Drop:
    """Do not move ``update_id``; its push resolves DROPPED with ``reason``."""

    update_id: str
    reason: str


@dataclass(frozen=True)
class PlannedAggregate:
    """Sum ``members`` at ``aggregator`` and forward the sum (one update's size) to ``dst``.

    The members are sent to ``aggregator`` by the decision's sends (whose ``next_hop``
    is the aggregator); the aggregate leaves once every member is in and every transfer
    in ``after`` is (nearly) done, along ``path``.
    """

    aggregate_id: str
    aggregator: str
    members: tuple[str, ...]
    bytes: float
    dst: str
    after: tuple[str, ...] = ()
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """A policy's answer: sends in the policy's order, drops, and aggregates to make."""

    sends: tuple[Send, ...] = ()
    drops: tuple[Drop, ...] = ()
    aggregates: tuple[PlannedAggregate, ...] = ()


class Policy(Protocol):
    """The interface every scheduling policy implements (pure: no I/O, no clock, no globals)."""

    name: str

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Decide what to do with ``pending`` given ``snapshot``."""
        ...


class FairPolicy:
    """The network-agnostic baseline (DESIGN §4 ``fair``): send every ready update at once.

    Every update goes straight to its server's host; TCP shares the bottleneck.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> u = PendingUpdate("h1/1", "j", "ps", "w", "h1", "h0", 10, 1.0, 0, 0.0)
    >>> FairPolicy().decide(Snapshot(now=0.0, graph=star(2, 8e9)), [u]).sends[0].next_hop
    'h0'
    """

    name = "fair"

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        from mlfabric.scheduler.core.graph import shortest_path

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


def _stf() -> Policy:
    from mlfabric.scheduler.policies.stf import STFPolicy

    return STFPolicy()


#: policy name -> factory
POLICIES: dict[str, Callable[[], Policy]] = {
    "fair": FairPolicy,
    "stf": _stf,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name; raises ``ValueError`` naming the known policies."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))})") from None
    return factory()
