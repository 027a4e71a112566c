"""Plain-data transfer plans: what every planner produces and the checker verifies.

A :class:`Schedule` is the output of every offline planner (STF, fair, aggregation groups,
the ILP, brute force) and the input of :func:`mlfabric.scheduler.core.checker.check_schedule`.
It says, for a set of :class:`Update` s, which are dropped (paper §5, Fig. 5), which are
summed into an :class:`Aggregate` at an aggregator hop (Fig. 6), and for every payload
that moves, one :class:`Transfer`: its path and the rate it reserves on each link of the
path over time (network time-sharing, §3.1.1; the blue region of Fig. 4b).

Everything here is a frozen dataclass or a tuple: plans are values, never mutated.

Conventions
-----------
* A *link* is a directed edge ``(u, v)`` of the bandwidth graph; rates are bytes/s.
* A *payload* is an update (``payload_id == update_id``) or an aggregate
  (``payload_id == aggregate_id``). Payload ids are unique across both.
* A payload's *next hop* is the aggregator of the aggregate containing it, or else its
  server host (``Update.dst``; for an aggregate, ``Aggregate.dst``).
* Transfers with ``replica=True`` copy a payload to a replica (Fig. 3); they use links
  (capacity is checked) but do not count as the payload's delivery.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [
    "Aggregate",
    "Link",
    "Reservation",
    "Schedule",
    "Transfer",
    "TransferTimes",
    "Update",
    "aggregate_id",
    "is_aggregate_id",
]

Link = tuple[str, str]


def aggregate_id(scope: str, index: int = 0) -> str:
    """The payload id of the ``index``-th aggregate made in ``scope``.

    The one spelling of aggregate ids in plans, decisions, the wire and the daemons:
    ``agg:<scope>:<index>``. ``scope`` is what makes the id unique where it is used (a
    server, an aggregator host, a planner's run).

    Parameters
    ----------
    scope : str
        Server, aggregator or planner name.
    index : int
        Counter within ``scope``.

    Examples
    --------
    >>> aggregate_id("ps", 3)
    'agg:ps:3'
    >>> is_aggregate_id(aggregate_id("a1")), is_aggregate_id("h1/7")
    (True, False)
    """
    return f"agg:{scope}:{index}"


def is_aggregate_id(payload_id: str) -> bool:
    """True if ``payload_id`` names an aggregate (made by :func:`aggregate_id`)."""
    return payload_id.startswith("agg:")


@dataclass(frozen=True)
class Update:
    """One worker's push to one server (DESIGN §2).

    Parameters
    ----------
    update_id : str
        Unique id (also its payload id).
    src : str
        The worker's host, where the update is ready.
    dst : str
        The server's host.
    bytes : float
        Size of the update.
    ready_at : float
        Time (s) at which the update is ready to leave ``src``.
    norm : float
        Norm of the update (for the replication divergence, Fig. 3).
    base_version : int
        Model version the update was computed from (its delay is measured against it).
    server : str
        Key of the server (shard) whose version counter it advances; defaults to ``dst``.

    Examples
    --------
    >>> Update("u1", "w1", "ps", 30e6).server
    'ps'
    """

    update_id: str
    src: str
    dst: str
    bytes: float
    ready_at: float = 0.0
    norm: float = 0.0
    base_version: int = 0
    server: str = ""

    def __post_init__(self) -> None:
        if not self.server:
            object.__setattr__(self, "server", self.dst)


class Reservation(NamedTuple):
    """``rate`` bytes/s reserved on ``link`` over ``[start, end)``."""

    link: Link
    start: float
    end: float
    rate: float


@dataclass(frozen=True)
class Transfer:
    """One movement of a payload from ``src`` to ``dst`` over ``path``.

    Parameters
    ----------
    payload_id : str
        An update id or an aggregate id.
    src, dst : str
        First and last node of ``path``.
    path : tuple of str
        Node path; its links are ``zip(path, path[1:])``.
    start, end : float
        When the first byte leaves and the last byte arrives.
    bytes : float
        Bytes moved.
    reservations : tuple of Reservation
        The rate reserved on each link of the path over time. On every link of the path
        the reserved rate integrates to ``bytes``.
    replica : bool
        A copy to a replica (paper Fig. 3), not the payload's delivery.

    Examples
    --------
    >>> t = Transfer.at_rate("u1", ("w1", "sw", "ps"), start=0.0, bytes=10.0, rate=5.0)
    >>> t.end, len(t.reservations)
    (2.0, 2)
    """

    payload_id: str
    src: str
    dst: str
    path: tuple[str, ...]
    start: float
    end: float
    bytes: float
    reservations: tuple[Reservation, ...] = ()
    replica: bool = False

    @property
    def links(self) -> tuple[Link, ...]:
        """The directed links of :attr:`path`."""
        return tuple(itertools.pairwise(self.path))

    @classmethod
    def at_rate(
        cls,
        payload_id: str,
        path: Sequence[str],
        *,
        start: float,
        bytes: float,
        rate: float,
        replica: bool = False,
    ) -> Transfer:
        """A transfer at a constant ``rate`` on every link of ``path`` from ``start``.

        Parameters
        ----------
        payload_id : str
            Update or aggregate id.
        path : sequence of str
            Node path, at least two nodes.
        start : float
            Start time (s).
        bytes : float
            Bytes to move.
        rate : float
            Bytes/s, > 0.
        replica : bool
            Whether this is a copy to a replica.

        Returns
        -------
        Transfer
            Ending at ``start + bytes / rate``.

        Examples
        --------
        >>> Transfer.at_rate("g", ("a", "b"), start=1.0, bytes=4.0, rate=2.0).end
        3.0
        """
        if rate <= 0:
            raise ValueError(f"transfer {payload_id}: rate must be > 0, got {rate}")
        path = tuple(path)
        end = start + bytes / rate
        links = tuple(itertools.pairwise(path))
        return cls(
            payload_id=payload_id,
            src=path[0],
            dst=path[-1],
            path=path,
            start=start,
            end=end,
            bytes=bytes,
            reservations=tuple(Reservation(link, start, end, rate) for link in links),
            replica=replica,
        )


class TransferTimes(NamedTuple):
    """A planned :class:`Transfer`'s path and times, without its reservations.

    What a decision needs of a transfer (its ``after``, its expected start and end): the
    light output of a planner run for a policy, which executes its plan and does not check
    it (the reservations are made in the planner's timelines all the same). Fields as
    :class:`Transfer`'s.

    Examples
    --------
    >>> t = Transfer.at_rate("u1", ("w1", "sw", "ps"), start=0.0, bytes=10.0, rate=5.0)
    >>> TransferTimes.of(t)[3:6]
    (('w1', 'sw', 'ps'), 0.0, 2.0)
    """

    payload_id: str
    src: str
    dst: str
    path: tuple[str, ...]
    start: float
    end: float
    bytes: float
    replica: bool = False

    @classmethod
    def of(cls, t: Transfer) -> TransferTimes:
        """``t``'s path and times."""
        return cls(t.payload_id, t.src, t.dst, t.path, t.start, t.end, t.bytes, t.replica)


@dataclass(frozen=True)
class Aggregate:
    """The sum of several payloads made at ``aggregator`` and forwarded to ``dst`` (Fig. 6).

    Parameters
    ----------
    aggregate_id : str
        Unique payload id of the aggregate.
    aggregator : str
        Host where the members are summed.
    members : tuple of str
        Payload ids summed (updates, or aggregates for a deeper tree).
    bytes : float
        Size of the aggregate: one update's size.
    dst : str
        Server host the aggregate goes to; ``""`` means the members' server host.

    Examples
    --------
    >>> Aggregate("a1", "w9", ("u4", "u5"), 30e6).members
    ('u4', 'u5')
    """

    aggregate_id: str
    aggregator: str
    members: tuple[str, ...]
    bytes: float
    dst: str = ""


@dataclass(frozen=True)
class Schedule:
    """A complete plan for a set of updates.

    Parameters
    ----------
    transfers : tuple of Transfer
        Every movement of every payload (and replica copies).
    drops : mapping of str to str
        Update id -> reason it is not sent (Fig. 5 preemptive dropping).
    aggregates : tuple of Aggregate
        Aggregates made at aggregator hops (Fig. 6).
    arrivals : tuple of str
        Payload ids in the order they are applied at their servers (optional; the
        checker derives it from transfer end times when empty and otherwise verifies it).

    Examples
    --------
    >>> s = Schedule(transfers=(Transfer.at_rate("u", ("w", "ps"), start=0, bytes=1, rate=1),))
    >>> s.completion_times()
    {'u': 1.0}
    """

    transfers: tuple[Transfer, ...] = ()
    drops: Mapping[str, str] = field(default_factory=dict)
    aggregates: tuple[Aggregate, ...] = ()
    arrivals: tuple[str, ...] = ()

    @classmethod
    def aggregated(cls, transfers: Sequence[Transfer], aggregates: Sequence[Aggregate]) -> Schedule:
        """A plan of direct sends and aggregates, ``arrivals`` in order of arrival at the servers.

        The payloads that arrive are those not summed into an aggregate (direct updates and
        the aggregates themselves), ordered by the end of their transfer.

        Examples
        --------
        >>> ins = Transfer.at_rate("u", ("w", "x"), start=0, bytes=1, rate=1)
        >>> out = Transfer.at_rate("agg", ("x", "ps"), start=1, bytes=1, rate=1)
        >>> direct = Transfer.at_rate("v", ("w2", "ps"), start=0, bytes=1, rate=2)
        >>> Schedule.aggregated([ins, out, direct], [Aggregate("agg", "x", ("u",), 1, "ps")]).arrivals
        ('v', 'agg')
        """
        summed = {m for a in aggregates for m in a.members}
        done = sorted((t for t in transfers if t.payload_id not in summed), key=lambda t: t.end)
        return cls(
            transfers=tuple(transfers),
            aggregates=tuple(aggregates),
            arrivals=tuple(t.payload_id for t in done),
        )

    def delivery(self, payload_id: str) -> Transfer | None:
        """The (non-replica) transfer of ``payload_id``, or ``None``."""
        for t in self.transfers:
            if t.payload_id == payload_id and not t.replica:
                return t
        return None

    def completion_times(self) -> dict[str, float]:
        """Payload id -> end of its (non-replica) transfer(s), the latest if several."""
        out: dict[str, float] = {}
        for t in self.transfers:
            if not t.replica:
                out[t.payload_id] = max(out.get(t.payload_id, t.end), t.end)
        return out

    def update_completion_times(self, updates: Sequence[Update]) -> dict[str, float]:
        """Update id -> time its content reaches its server, directly or inside an aggregate.

        Dropped updates are left out.

        Examples
        --------
        >>> u = Update("u", "w", "ps", 1.0)
        >>> s = Schedule(transfers=(Transfer.at_rate("u", ("w", "ps"), start=0, bytes=1, rate=2),))
        >>> s.update_completion_times([u])
        {'u': 0.5}
        """
        done = self.completion_times()
        parent = {m: a.aggregate_id for a in self.aggregates for m in a.members}
        out: dict[str, float] = {}
        for u in updates:
            if u.update_id in self.drops:
                continue
            pid = u.update_id
            while pid in parent:
                pid = parent[pid]
            if pid in done:
                out[u.update_id] = done[pid]
        return out

    def makespan(self) -> float:
        """Latest end of any non-replica transfer (0 for an empty schedule)."""
        return max((t.end for t in self.transfers if not t.replica), default=0.0)
