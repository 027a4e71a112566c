"""The ``auto`` codec in the service: per (worker host, server) advice to the daemons (docs/compression.md).

For every job with ``Params(compression="auto")`` and each of its servers, each worker
host's pushes cross a path from that host to the server's host. :class:`CodecBook` computes
the path's bandwidth share from the estimator's graph (:func:`path_shares`) — once the hosts'
pushes have a measured rate, the path's links with the load those pushes offer
(:func:`path_uses`) — and the hosts' CPU load (``UpdateReady.cpu_load``), asks the pure
rule (:func:`~mlfabric.scheduler.core.codec_choice.choose_codec`, with a
:data:`CODEC_MARGIN`) which codec an update of the server's model size should travel with,
and returns a ``CodecAdvice`` directive for each (host, job, server) whose choice changed
since it was last sent (none at first: a host never advised pushes ``auto`` uncompressed, so
it is told only a codec; the service core executes the
:class:`~mlfabric.scheduler.service.effects.Effects`). The daemon hands the advice to the
worker processes (``RegisterReply``, ``PushAccepted``), whose ``auto`` pushes are encoded
with it. Every choice sent is noted in the state's recorder: the ``CODEC`` trace event (with
its inputs) and the ``mlfabric_codec_choices_total{codec}`` counter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import networkx as nx

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.codec_choice import (
    MEASURED_RATES,
    CodecChoice,
    CodecRate,
    LinkUse,
    choose_codec,
    is_auto,
    parse_auto,
)
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.model_routes import model_bytes
from mlfabric.scheduler.service.state import SchedulerState

__all__ = [
    "CODEC_MARGIN",
    "CODEC_REFRESH_INTERVAL",
    "PUSH_RATE_WINDOW",
    "CodecBook",
    "path_shares",
    "path_uses",
]

log = logging.getLogger(__name__)

#: the least time between two refreshes of every job's codec advice, s (a refresh is one BFS
#: per server and a pass over its worker hosts' paths)
CODEC_REFRESH_INTERVAL = 1.0

#: the least fraction of a push's uncompressed time a codec must save to be advised (its error
#: and the CPU it takes from training are not priced by the rule; on the testbed's uniform
#: 1 Gbit/s links int8 predicted to save 8-15 % was 0.96x uncompressed, docs/compression.md)
CODEC_MARGIN = 0.25

#: seconds of a host's recent pushes its push rate is measured over
PUSH_RATE_WINDOW = 10.0


def path_shares(graph: nx.DiGraph, paths: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Each path's bottleneck share: the least ``capacity / n`` over its links, ``n`` the paths on a link.

    Under time-sharing a transfer gets the whole residual of its bottleneck while it runs, but
    the hosts pushing to one server take turns on the links they share: on average each gets
    its share. A path of one node (the server's own host) has an infinite share.

    Parameters
    ----------
    graph : networkx.DiGraph
        Edges with ``capacity`` (bytes/s), e.g. the estimator's graph.
    paths : mapping of str to sequence of str
        Host -> its path (nodes) to the server's host.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e9)      # 1 GB/s links
    >>> path_shares(g, {"a": ["a", "sw", "ps"], "b": ["b", "sw", "ps"], "ps": ["ps"]})
    {'a': 500000000.0, 'b': 500000000.0, 'ps': inf}
    """
    users: dict[tuple[str, str], int] = {}
    for path in paths.values():
        for link in pairwise(path):
            users[link] = users.get(link, 0) + 1
    return {
        host: min((graph.edges[link]["capacity"] / users[link] for link in pairwise(path)), default=math.inf)
        for host, path in paths.items()
    }


def path_uses(
    graph: nx.DiGraph, paths: Mapping[str, Sequence[str]], offered: Mapping[str, float]
) -> dict[str, list[LinkUse]] | None:
    """Each path's links with the load the paths' hosts offer (None until every host's is measured).

    Parameters
    ----------
    graph : networkx.DiGraph
        Edges with ``capacity`` (bytes/s).
    paths : mapping of str to sequence of str
        Host -> its path (nodes) to the server's host.
    offered : mapping of str to float
        Host -> the uncompressed bytes/s its pushes offer (measured); a host of ``paths``
        missing here: not measured yet.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e9)      # 1 GB/s links
    >>> paths = {"a": ["a", "sw", "ps"], "b": ["b", "sw", "ps"]}
    >>> uses = path_uses(g, paths, {"a": 2e8, "b": 3e8})
    >>> [(u.users, u.utilisation) for u in uses["a"]]
    [(1, 0.2), (2, 0.5)]
    >>> path_uses(g, paths, {"a": 2e8}) is None
    True
    """
    if any(host not in offered for host in paths):
        return None
    users: dict[tuple[str, str], int] = {}
    load: dict[tuple[str, str], float] = {}
    for host, path in paths.items():
        for link in pairwise(path):
            users[link] = users.get(link, 0) + 1
            load[link] = load.get(link, 0.0) + offered[host]
    return {
        host: [
            LinkUse(graph.edges[link]["capacity"], users[link], load[link] / graph.edges[link]["capacity"])
            for link in pairwise(path)
        ]
        for host, path in paths.items()
    }


@dataclass
class CodecBook:
    """The codec advice sent to the daemons, and the advice now due (pure: returns Effects).

    Parameters
    ----------
    state : SchedulerState
        Jobs, servers, worker hosts, connected daemons; its recorder notes each choice sent.
    rates : mapping of str to CodecRate
        The codecs' measured rates, ratios and errors (default
        :data:`~mlfabric.scheduler.core.codec_choice.MEASURED_RATES`).
    must_sum : bool
        The policy aggregates (``stf+agg``, ``stf+tree``): a push may be summed at an
        aggregator, so only codecs it sums without decoding are chosen.
    margin : float
        The least fraction of the uncompressed time a codec must save (:data:`CODEC_MARGIN`).
    window : float
        Seconds of pushes a host's push rate is measured over (:meth:`note_ready`).

    Notes
    -----
    A path is judged as if saturated (each host on a link an equal share of it:
    :func:`path_shares`) until every worker host of the job has pushed twice within
    ``window``; then by the load measured on its links (:func:`path_uses`). The codecs' rates
    are divided by the load per core of the worker's host (encoding) and of the server's host
    (decoding; the worker's where the server's host announces no updates of its own).

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.service.records import JobParams, TensorSpec
    >>> g = star(["ps", "a", "b"], 100e9); g.edges["a", "sw"]["capacity"] = 25e6 / 8   # 25 Mbit/s
    >>> state = SchedulerState(g)
    >>> for i, h in enumerate(("ps", "a", "b")):
    ...     _ = state.connect(h, f"127.0.0.1:{9000 + i}")
    >>> model = (TensorSpec("w", "float32", (1_125_000,)),)          # 4.5 MB
    >>> _ = state.register_server("ps", "j", "ps0", model, JobParams(compression="auto"), 0)
    >>> for h in ("a", "b"):
    ...     _ = state.register_worker(h, "j", f"w{h}")
    >>> book = CodecBook(state)
    >>> [(h, d.codec_advice.codec) for h, d in book.refresh(g).directives]   # b: none, as unadvised
    [('a', 'int8')]
    >>> book.refresh(g).directives    # nothing changed: nothing sent
    []
    >>> g.edges["a", "sw"]["capacity"] = 100e9 / 8
    >>> [(h, d.codec_advice.codec) for h, d in book.refresh(g).directives]
    [('a', '')]
    >>> state.recorder.codec_choices
    {'int8': 1, 'none': 1}
    """

    state: SchedulerState
    rates: Mapping[str, CodecRate] = field(default_factory=lambda: dict(MEASURED_RATES))
    must_sum: bool = False
    interval: float = CODEC_REFRESH_INTERVAL
    margin: float = CODEC_MARGIN
    window: float = PUSH_RATE_WINDOW
    #: (host, job, server) -> the codec spec last sent there
    sent: dict[tuple[str, str, str], str] = field(default_factory=dict)
    _last: float = field(default=-math.inf, repr=False)
    #: the graph the cached paths were computed on, and server host -> host -> path to it
    _graph: nx.DiGraph | None = field(default=None, repr=False)
    _paths: dict[str, dict[str, list[str]]] = field(default_factory=dict, repr=False)
    #: (host, job, server) -> when its recent pushes were announced; host -> its CPU load per core.
    #: A tuple per pair (~100 bytes, not a ~600-byte deque), which the cyclic collector stops
    #: tracking: with 4,000 worker hosts and 8 servers, 32,000 of them (issue 24)
    _pushes: dict[tuple[str, str, str], tuple[float, ...]] = field(default_factory=dict, repr=False)
    _cpu: dict[str, float] = field(default_factory=dict, repr=False)

    def forget(self, host: str) -> None:
        """``host``'s daemon went away: what was sent to it is forgotten (a new session gets it again)."""
        self.sent = {key: codec for key, codec in self.sent.items() if key[0] != host}
        self._pushes = {key: times for key, times in self._pushes.items() if key[0] != host}

    def note_ready(self, host: str, job: str, server: str, cpu_load: float, now: float) -> None:
        """A worker on ``host`` announced an update to ``server`` of ``job`` at ``now``.

        ``cpu_load``: the host's load per core it stamped on the announcement (0: unknown).
        """
        times = self._pushes.get((host, job, server), ())
        cut, old = now - self.window, 0
        while old < len(times) and times[old] < cut:
            old += 1
        self._pushes[(host, job, server)] = (*times[old:], now)
        if cpu_load > 0 and math.isfinite(cpu_load):
            self._cpu[host] = cpu_load

    def push_rate(self, host: str, job: str, server: str) -> float | None:
        """Pushes per second from ``host`` to ``server`` of ``job`` lately (None: fewer than two).

        Examples
        --------
        >>> from mlfabric.scheduler.core.graph import star
        >>> book = CodecBook(SchedulerState(star(["ps", "a"], 1e9)))
        >>> for t in (0.0, 0.5, 1.0, 2.0):
        ...     book.note_ready("a", "j", "ps0", 3.0, t)
        >>> book.push_rate("a", "j", "ps0"), book.push_rate("b", "j", "ps0")
        (1.5, None)
        """
        times = self._pushes.get((host, job, server))
        if times is None or len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])

    def refresh_due(self, now: float, graph_of: Callable[[], nx.DiGraph]) -> Effects:
        """:meth:`refresh` on ``graph_of()`` if :attr:`interval` passed since the last one and a job
        is ``auto`` (else nothing, and the graph is not asked for: callers pass the estimator's
        ``estimated_graph``, a copy of the whole graph after each measurement)."""
        if now - self._last < self.interval:
            return Effects()
        self._last = now
        if not any(is_auto(j.params.compression) for j in self.state.jobs.values()) and not self.sent:
            return Effects()
        return self.refresh(graph_of())

    def refresh(self, graph: nx.DiGraph, hosts: Iterable[str] | None = None) -> Effects:
        """The advice for every (worker host, job, server) whose choice changed.

        Parameters
        ----------
        graph : networkx.DiGraph
            The capacities to choose by (the estimator's graph; same nodes as the state's).
        hosts : iterable of str, optional
            Only these worker hosts (a worker just registered there); default all, and the
            advice of hosts without workers any more is forgotten.
        """
        out = Effects()
        only = None if hosts is None else set(hosts)
        keep: dict[tuple[str, str, str], str] = {}
        for job in sorted(self.state.jobs):
            compression = self.state.jobs[job].params.compression
            if not is_auto(compression):
                continue  # its pushes name their codec
            try:
                auto = parse_auto(compression)
            except ValueError as exc:  # Params checks it; a daemon could still send a bad one
                log.warning("job %r: no codec advice: %s", job, exc)
                continue
            workers = {h for h in self.state.worker_hosts(job) if h in self.state.daemons}
            for role in self.state.servers(job):
                nbytes = model_bytes(role.model)
                if not workers or not nbytes or role.host not in graph:
                    continue
                everyone = self._paths_to(role.host)
                paths = {h: everyone[h] for h in workers if h in everyone}
                shares = path_shares(graph, paths)
                rates = {h: self.push_rate(h, job, role.name) for h in paths}
                uses = path_uses(graph, paths, {h: r * nbytes for h, r in rates.items() if r is not None})
                for host in sorted(paths if only is None else only & paths.keys()):
                    choice = choose_codec(
                        shares[host],
                        nbytes,
                        self.rates,
                        auto=auto,
                        must_sum=self.must_sum,
                        links=None if uses is None else uses[host],
                        cpu_load=cpu_loads(self._cpu, host, role.host),
                        margin=self.margin,
                    )
                    key = (host, job, role.name)
                    keep[key] = choice.codec
                    if self.sent.get(key, "") != choice.codec:  # never advised: none
                        out.send(host, pb.Directive(codec_advice=_advice(job, role.name, choice)))
                        self.state.recorder.codec_chosen(job, role.name, paths[host], choice)
        if only is None:
            self.sent = keep
        else:
            self.sent.update(keep)
        return out

    def _paths_to(self, server_host: str) -> dict[str, list[str]]:
        """Each host's path to ``server_host`` on the state's graph (kept until the graph is swapped)."""
        if self._graph is not self.state.graph:
            self._graph, self._paths = self.state.graph, {}
        paths = self._paths.get(server_host)
        if paths is None:
            back = nx.single_source_shortest_path(self.state.graph.reverse(copy=False), server_host)
            paths = self._paths[server_host] = {h: p[::-1] for h, p in back.items()}
        return paths


def cpu_loads(loads: Mapping[str, float], sender: str, receiver: str) -> tuple[float, float]:
    """The encoding and decoding hosts' load per core (the sender's for an unknown receiver).

    Examples
    --------
    >>> cpu_loads({"a": 3.0, "ps": 1.5}, "a", "ps"), cpu_loads({"a": 3.0}, "a", "ps")
    ((3.0, 1.5), (3.0, 3.0))
    >>> cpu_loads({}, "a", "ps")
    (0.0, 0.0)
    """
    mine = loads.get(sender, 0.0)
    return mine, loads.get(receiver, mine)


def _advice(job: str, server: str, choice: CodecChoice) -> pb.CodecAdvice:
    return pb.CodecAdvice(
        job=job,
        server=server,
        codec=choice.codec,
        bandwidth=choice.bandwidth if math.isfinite(choice.bandwidth) else 0.0,
        bytes=choice.nbytes,
        seconds=choice.seconds,
        seconds_none=choice.seconds_none,
    )
