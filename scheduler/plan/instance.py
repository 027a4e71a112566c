"""Planning instances: the input of ``mlfabric plan``, the ILP and the brute force (DESIGN §4).

An instance is one round of updates on a bandwidth graph, all for one server, with the
aggregator hops the planner may route them through (paper appendix 10.1). It is a JSON
document::

    {
      "topology": "two_tier.toml",
      "server": "s0",
      "aggregators": ["h3"],
      "slot_seconds": 0.01,
      "objective": "mean_completion",
      "updates": [
        {"id": "u1", "worker": "w1", "bytes": 4000000, "ready_at": 0.0}
      ]
    }

Fields:

``topology``
    A path to a topology TOML file (relative to the instance file; see
    :mod:`mlfabric.scheduler.core.graph` for its format) or the same content inline:
    ``{"hosts": [...], "switches": [...], "links": [{"a": "w1", "b": "tor", "gbps": 1.0}]}``.
    Links are full duplex with the given rate each way unless ``gbps_ba``/``mbps_ba`` gives
    the reverse rate.
``server``
    The host of the parameter server every update goes to.
``aggregators`` (optional, default ``[]``)
    Hosts that may sum updates on their way to the server (the ILP lets each make any
    number of aggregates; ``mlfabric plan --groups 1`` is the paper's one per aggregator).
``slot_seconds`` (optional)
    Length of one time slot of the ILP's time-indexed model. Default: the time one update
    of the median size takes on the server's ingress, divided by 4.
``objective`` (optional, default ``"mean_completion"``)
    ``"mean_completion"`` (asynchronous SGD: the mean time updates reach the server) or
    ``"makespan"`` (synchronous SGD: the time the last update reaches it).
``updates``
    One entry per update: ``id`` (unique string), ``worker`` (host where it is ready),
    ``bytes`` (positive integer) and ``ready_at`` (seconds, >= 0, default 0).

Invalid instances raise :class:`InstanceError` whose message names the field, e.g.
``updates[3].bytes: must be a positive integer``.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from mlfabric.scheduler.core.graph import (
    TopologyError,
    hosts,
    load_topology,
    parse_topology,
    path_links,
    shortest_path,
)
from mlfabric.scheduler.core.schedule import Link, Schedule, Update

__all__ = [
    "OBJECTIVES",
    "Instance",
    "InstanceError",
    "load_instance",
    "objective_of",
    "parse_instance",
    "two_tier_instance",
]

#: Objectives the planners minimise.
OBJECTIVES = ("mean_completion", "makespan")

_FIELDS = {"topology", "server", "aggregators", "slot_seconds", "objective", "updates", "name", "description"}
_UPDATE_FIELDS = {"id", "worker", "bytes", "ready_at"}


class InstanceError(ValueError):
    """An instance is malformed; the message names the offending field."""


@dataclass(frozen=True)
class Instance:
    """One planning instance: updates for one server on a bandwidth graph.

    Parameters
    ----------
    graph : networkx.DiGraph
        Bandwidth graph (:func:`mlfabric.scheduler.core.graph.parse_topology`).
    server : str
        Server host.
    aggregators : tuple of str
        Hosts that may aggregate updates on their way to the server.
    updates : tuple of Update
        The updates (``src`` the worker, ``dst`` the server).
    slot_seconds : float
        Slot length of the time-indexed ILP.
    objective : str
        ``"mean_completion"`` or ``"makespan"``.

    Examples
    --------
    >>> inst = parse_instance({
    ...     "topology": {"hosts": ["s0", "w1"], "links": [{"a": "w1", "b": "s0", "mbps": 8}]},
    ...     "server": "s0", "updates": [{"id": "u1", "worker": "w1", "bytes": 1000}]})
    >>> inst.direct_path("u1"), inst.slot_seconds
    (('w1', 's0'), 0.00025)
    """

    graph: nx.DiGraph
    server: str
    aggregators: tuple[str, ...]
    updates: tuple[Update, ...]
    slot_seconds: float
    objective: str = "mean_completion"
    _paths: dict[tuple[str, str], tuple[str, ...]] = field(
        default_factory=dict, repr=False, compare=False, hash=False
    )

    def path(self, src: str, dst: str) -> tuple[str, ...]:
        """The (hop-count shortest, deterministic) node path from ``src`` to ``dst``."""
        key = (src, dst)
        if key not in self._paths:
            self._paths[key] = tuple(shortest_path(self.graph, src, dst))
        return self._paths[key]

    def update(self, update_id: str) -> Update:
        """The update with id ``update_id``."""
        for u in self.updates:
            if u.update_id == update_id:
                return u
        raise KeyError(update_id)

    def direct_path(self, update_id: str) -> tuple[str, ...]:
        """Path of an update sent straight to the server."""
        return self.path(self.update(update_id).src, self.server)

    def routes(self, update_id: str) -> tuple[str | None, ...]:
        """Route choices of an update: ``None`` (direct) then each usable aggregator.

        An aggregator on the worker's own host or on the server's host is no hop and is left
        out.
        """
        src = self.update(update_id).src
        return (None, *(a for a in self.aggregators if a not in (src, self.server)))

    def capacity(self, link: Link) -> float:
        """Capacity (bytes/s) of a directed link."""
        return float(self.graph.edges[link]["capacity"])

    def path_rate(self, path: tuple[str, ...]) -> float:
        """Bottleneck capacity (bytes/s) of a path."""
        return min(self.capacity(link) for link in path_links(list(path)))


def _fail(where: str, message: str) -> InstanceError:
    return InstanceError(f"{where}: {message}")


def _positive_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _fail(where, f"must be a positive number, got {value!r}")
    return float(value)


def _host(graph: nx.DiGraph, value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(where, f"must be a host name, got {value!r}")
    if value not in set(hosts(graph)):
        raise _fail(where, f"'{value}' is not a host of the topology")
    return value


def _topology(value: Any, base: Path | None) -> nx.DiGraph:
    try:
        if isinstance(value, str):
            path = Path(value)
            if not path.is_absolute() and base is not None:
                path = base / path
            return load_topology(path)
        if isinstance(value, Mapping):
            return parse_topology(value)
    except TopologyError as exc:
        raise _fail("topology", str(exc)) from None
    raise _fail("topology", f"must be a path to a TOML file or a table, got {type(value).__name__}")


def _updates(graph: nx.DiGraph, server: str, value: Any) -> tuple[Update, ...]:
    if not isinstance(value, list) or not value:
        raise _fail("updates", "must be a non-empty list")
    seen: set[str] = set()
    out = []
    for i, item in enumerate(value):
        where = f"updates[{i}]"
        if not isinstance(item, Mapping):
            raise _fail(where, f"must be a table, got {item!r}")
        unknown = set(item) - _UPDATE_FIELDS
        if unknown:
            raise _fail(where, f"unknown field(s) {', '.join(sorted(unknown))}")
        uid = item.get("id")
        if not isinstance(uid, str) or not uid:
            raise _fail(f"{where}.id", f"must be a non-empty string, got {uid!r}")
        if uid in seen:
            raise _fail(f"{where}.id", f"'{uid}' is used twice")
        seen.add(uid)
        worker = _host(graph, item.get("worker"), f"{where}.worker")
        if worker == server:
            raise _fail(f"{where}.worker", f"'{worker}' is the server itself")
        size = item.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise _fail(f"{where}.bytes", f"must be a positive integer, got {size!r}")
        ready = item.get("ready_at", 0.0)
        if isinstance(ready, bool) or not isinstance(ready, int | float) or ready < 0:
            raise _fail(f"{where}.ready_at", f"must be a number >= 0, got {ready!r}")
        if not nx.has_path(graph, worker, server):
            raise _fail(f"{where}.worker", f"no path from '{worker}' to server '{server}'")
        out.append(Update(uid, worker, server, float(size), float(ready)))
    return tuple(out)


def parse_instance(data: Any, base: str | Path | None = None) -> Instance:
    """Validate a parsed JSON instance (see the module docstring for the format).

    Parameters
    ----------
    data : mapping
        The parsed JSON document.
    base : str or Path, optional
        Directory a relative ``topology`` path is resolved against.

    Returns
    -------
    Instance

    Raises
    ------
    InstanceError
        Naming the bad field, e.g. ``updates[3].bytes: must be a positive integer, got -1``.

    Examples
    --------
    >>> try:
    ...     parse_instance({"server": "s0", "topology": {"hosts": ["s0"]}, "updates": [{"id": "u"}]})
    ... except InstanceError as exc:
    ...     print(exc)
    updates[0].worker: must be a host name, got None
    """
    if not isinstance(data, Mapping):
        raise InstanceError(f"an instance must be a JSON object, got {type(data).__name__}")
    unknown = set(data) - _FIELDS
    if unknown:
        raise InstanceError(f"unknown field(s): {', '.join(sorted(unknown))}")
    for required in ("topology", "server", "updates"):
        if required not in data:
            raise _fail(required, "missing")
    graph = _topology(data["topology"], Path(base) if base is not None else None)
    server = _host(graph, data["server"], "server")
    aggregators = data.get("aggregators", [])
    if not isinstance(aggregators, list):
        raise _fail("aggregators", f"must be a list of host names, got {aggregators!r}")
    for i, a in enumerate(aggregators):
        _host(graph, a, f"aggregators[{i}]")
        if a == server:
            raise _fail(f"aggregators[{i}]", f"'{a}' is the server itself")
        if not nx.has_path(graph, a, server):
            raise _fail(f"aggregators[{i}]", f"no path from '{a}' to server '{server}'")
    if len(set(aggregators)) != len(aggregators):
        raise _fail("aggregators", "lists a host twice")
    objective = data.get("objective", "mean_completion")
    if objective not in OBJECTIVES:
        raise _fail("objective", f"must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    updates = _updates(graph, server, data["updates"])
    if "slot_seconds" in data:
        slot = _positive_number(data["slot_seconds"], "slot_seconds")
    else:
        ingress = max(float(c) for _, _, c in graph.in_edges(server, data="capacity"))
        slot = statistics.median(u.bytes for u in updates) / ingress / 4
    return Instance(graph, server, tuple(aggregators), updates, slot, objective)


def load_instance(path: str | Path) -> Instance:
    """Load and validate an instance JSON file; a relative topology path is resolved
    against the file's directory.

    Raises
    ------
    InstanceError
        If the file is missing, is not JSON or is invalid; the message starts with the file
        name.

    Examples
    --------
    >>> try:
    ...     load_instance("/nonexistent.json")
    ... except InstanceError as exc:
    ...     print(exc)
    /nonexistent.json: no such instance file
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InstanceError(f"{path}: no such instance file") from None
    except json.JSONDecodeError as exc:
        raise InstanceError(f"{path}: not valid JSON: {exc}") from None
    try:
        return parse_instance(data, base=path.parent)
    except InstanceError as exc:
        raise InstanceError(f"{path}: {exc}") from None


def two_tier_instance(
    rng: random.Random,
    workers: int,
    aggregators: int,
    *,
    racks: int = 4,
    gbps: float = 10.0,
    slot_seconds: float = 0.01,
    max_slots: int = 3,
    max_ready_slots: int = 3,
    objective: str = "mean_completion",
) -> dict[str, Any]:
    """A random instance on a two-tier graph (racks of hosts under ToRs, ToRs under a core).

    The server has a rack of its own; workers and aggregators are spread round-robin over
    the other racks. Every link (NICs and ToR uplinks) runs at ``gbps`` each way, so a rack's
    uplink and the server's ingress are the bottlenecks, and every update takes a whole
    number of slots (``1..max_slots``) at full rate and is ready at a slot boundary: the
    instance is slot-aligned, so the ILP's slot model loses nothing against the fluid plans.

    Parameters
    ----------
    rng : random.Random
        Seeded source of randomness.
    workers, aggregators : int
        How many of each (one update per worker).
    racks : int
        Racks of workers and aggregators.
    gbps : float
        Rate of every link, each way.
    slot_seconds : float
        Slot length of the instance.
    max_slots, max_ready_slots : int
        Largest update (in slots at full rate) and latest ready time (in slots).
    objective : str
        ``"mean_completion"`` or ``"makespan"``.

    Returns
    -------
    dict
        The instance as JSON data (topology inline); :func:`parse_instance` validates it.

    Examples
    --------
    >>> data = two_tier_instance(random.Random(1), 4, 2)
    >>> inst = parse_instance(data)
    >>> len(inst.updates), inst.aggregators, inst.path("w0", "s0")
    (4, ('a0', 'a1'), ('w0', 'tor0', 'core', 'tor_s', 's0'))
    """
    per_slot = gbps * 1e9 / 8 * slot_seconds
    if abs(per_slot - round(per_slot)) > 1e-6:
        raise ValueError(f"gbps * slot_seconds must be a whole number of bytes per slot, got {per_slot}")
    worker_names = [f"w{i}" for i in range(workers)]
    agg_names = [f"a{j}" for j in range(aggregators)]
    rack_of = {h: i % racks for i, h in enumerate(worker_names)}
    rack_of |= {a: j % racks for j, a in enumerate(agg_names)}
    links = [{"a": "s0", "b": "tor_s", "gbps": gbps}, {"a": "tor_s", "b": "core", "gbps": gbps}]
    links += [{"a": f"tor{r}", "b": "core", "gbps": gbps} for r in range(racks)]
    links += [{"a": h, "b": f"tor{r}", "gbps": gbps} for h, r in rack_of.items()]
    updates = [
        {
            "id": f"u{i}",
            "worker": w,
            "bytes": round(per_slot) * rng.randint(1, max_slots),
            "ready_at": slot_seconds * rng.randint(0, max_ready_slots),
        }
        for i, w in enumerate(worker_names)
    ]
    return {
        "topology": {
            "hosts": ["s0", *worker_names, *agg_names],
            "switches": ["core", "tor_s", *(f"tor{r}" for r in range(racks))],
            "links": links,
        },
        "server": "s0",
        "aggregators": agg_names,
        "slot_seconds": slot_seconds,
        "objective": objective,
        "updates": updates,
    }


def objective_of(instance: Instance, schedule: Schedule) -> float:
    """The instance's objective (seconds) for a plan: mean update completion or makespan.

    Examples
    --------
    >>> from mlfabric.scheduler.core.schedule import Transfer
    >>> inst = parse_instance({"topology": {"hosts": ["s", "w"], "links": [{"a": "w", "b": "s", "mbps": 8}]},
    ...                        "server": "s", "updates": [{"id": "u", "worker": "w", "bytes": 10}]})
    >>> plan = Schedule(transfers=(Transfer.at_rate("u", ("w", "s"), start=0, bytes=10, rate=5),))
    >>> objective_of(inst, plan)
    2.0
    """
    done = schedule.update_completion_times(list(instance.updates))
    times = [done[u.update_id] for u in instance.updates]
    return max(times) if instance.objective == "makespan" else sum(times) / len(times)
