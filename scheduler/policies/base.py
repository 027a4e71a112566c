"""The policy interface between the scheduler service and the scheduling algorithms.

A policy is an object with no I/O: :meth:`Policy.decide` maps a :class:`Snapshot` of the
scheduler's state and the updates not yet released to a :class:`Decision` — which updates
go (to which next hop, after which transfers), and which are dropped (with a reason).
The service calls it after each batch of ready notifications and releases the sends as
their ``after`` transfers finish (or nearly finish, so a bottleneck never idles on
control latency). Every call sees *all* pending updates, so later arrivals can be
ordered ahead of earlier ones that have not started yet.

The policies are built by name, with the re-plan trigger the service and the simulator
run them with, by :func:`mlfabric.scheduler.policies.registry.make_policy`; decisions are
adopted and released by :class:`mlfabric.scheduler.policies.runner.DecisionRunner`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # only in annotations: importing this module stays light (CLI --help)
    import networkx as nx

__all__ = [
    "Decision",
    "Drop",
    "InFlight",
    "PendingUpdate",
    "PlannedAggregate",
    "Policy",
    "ReplicaSend",
    "ReplicaView",
    "RoundSpec",
    "Send",
    "Snapshot",
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
    #: announced again after its server failed over (``UpdateReady.resent``): it may be
    #: applied already, so it goes whole to the server at once (:class:`DecisionRunner
    #: <mlfabric.scheduler.policies.runner.DecisionRunner>`), never aggregated or dropped
    resent: bool = False
    #: the codec its payload travels with (``UpdateReady.codec``; "": none), for the trace
    codec: str = ""


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
class ReplicaView:
    """A server's replica as a policy sees it (docs/replication.md).

    ``log`` lists the entries the server applied that the replica has not acknowledged, as
    ``(update_id, version, norm)`` in version order; ``directed`` is the version up to which
    forwarding was already ordered; ``blocked`` says an update waits at the server because
    applying it would break ``div_max`` (``<= 0``: chain replication).
    """

    job: str
    server: str
    server_host: str
    replica_host: str
    div_max: float
    replica_version: int
    directed: int
    log: tuple[tuple[str, int, float], ...] = ()
    blocked: bool = False


@dataclass(frozen=True)
class RoundSpec:
    """A synchronous server's rounds as a policy sees them (issue 23, docs/rounds.md).

    Every round of the server (the updates computed from one model version) takes one
    update from each of ``members`` (worker -> its host), so a policy planning a round's
    first updates knows who is still to come and where from.
    """

    members: Mapping[str, str]


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
    #: hosts that may be aggregator hops now (daemon connected and willing); ``None``: any host
    aggregators: frozenset[str] | None = None
    #: (job, server) -> its replica's state, for servers that have one (replication)
    replicas: Mapping[ServerKey, ReplicaView] = field(default_factory=dict)
    #: aggregates planned and not yet forwarded, members as they stand (set by the runner);
    #: a policy may list one again with more members (they join it before it leaves)
    gathering: tuple[PlannedAggregate, ...] = ()
    #: (job, server) -> its round membership, for servers of synchronous jobs
    rounds: Mapping[ServerKey, RoundSpec] = field(default_factory=dict)
    #: a number its producer changes whenever it changes a capacity of ``graph`` in place, so a
    #: policy may skip re-reading the capacities of the graph object it saw last with the same
    #: number (the simulator keeps one); ``None``: not kept, every decision reads them
    graph_version: int | None = None


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
    in ``after`` is (nearly) done, along ``path`` — and not before ``hold_until``: a
    synchronous round's aggregate waits that long for members expected later (listed
    again with them when they come), then leaves with those it has.

    ``chunk_bytes > 0`` makes it *pipelined* (cut-through,
    :mod:`~mlfabric.scheduler.policies.pipelined`): it may leave once every member has
    started arriving, and forwards chunk ``i`` of its sum (``chunk_bytes`` each) as soon as
    chunk ``i`` of every member is in; 0 (the default) is store-and-forward.
    """

    aggregate_id: str
    aggregator: str
    members: tuple[str, ...]
    bytes: float
    dst: str
    after: tuple[str, ...] = ()
    path: tuple[str, ...] = ()
    hold_until: float = 0.0
    chunk_bytes: int = 0


@dataclass(frozen=True)
class ReplicaSend:
    """Copy ``update_id`` (an update or an aggregate) from ``src`` to the replica host ``replica``.

    Replication with bounded divergence (paper §4, Fig. 3): every payload applied at a
    server must also reach the server's replica, sent from wherever it already is, along
    ``path``, once every transfer in ``after`` is (nearly) done. The copy does not count
    as the payload's delivery: the push resolves when the server applies it.
    """

    update_id: str
    src: str
    replica: str
    path: tuple[str, ...]
    after: tuple[str, ...] = ()
    expected_start: float = 0.0
    expected_end: float = 0.0


@dataclass(frozen=True)
class Decision:
    """A policy's answer about the pending updates it was given.

    Attributes
    ----------
    sends : tuple of Send
        Updates to move, in the policy's order (to their server or to an aggregator).
    drops : tuple of Drop
        Updates not to move; their pushes resolve DROPPED with the reason.
    aggregates : tuple of PlannedAggregate
        Sums to make at aggregator hops; ids unique across the decisions of one run.
    replicas : tuple of ReplicaSend
        Copies to send to replica servers
        (:class:`~mlfabric.scheduler.policies.replication.ReplicationPolicy`).

    Pending updates in none of ``sends`` and ``drops`` are *undecided* (a bounded-horizon
    policy plans only the head of its order); they are offered again at the next decision.
    """

    sends: tuple[Send, ...] = ()
    drops: tuple[Drop, ...] = ()
    aggregates: tuple[PlannedAggregate, ...] = ()
    replicas: tuple[ReplicaSend, ...] = ()


class Policy(Protocol):
    """The interface every scheduling policy implements (pure: no I/O, no clock, no globals)."""

    name: str

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        """Decide what to do with ``pending`` given ``snapshot``."""
        ...


def describe_decision(decision: Decision, now: float) -> list[str]:
    """One line per send and aggregate of ``decision`` (for a DEBUG log of a synchronous round).

    Examples
    --------
    >>> d = Decision(sends=[Send("u1", "ps", ("w1", "sw", "ps"), after=("u0",))])
    >>> describe_decision(d, 0.0)
    ["send u1 -> ps after ['u0']"]
    """
    lines = [
        f"send {s.update_id} -> {s.path[-1] if s.path else s.next_hop} after {list(s.after)}"
        for s in decision.sends
    ]
    lines += [
        f"aggregate {a.aggregate_id} at {a.aggregator} members {list(a.members)} after {list(a.after)} "
        f"hold {a.hold_until - now:.3f}"
        for a in decision.aggregates
    ]
    return lines
