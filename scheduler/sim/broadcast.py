"""The model down the trees, executed in the fluid network (issue 23, ``docs/broadcast.md``).

A :class:`~mlfabric.scheduler.policies.broadcast.BroadcastPlan` becomes flows: each chunk of
each tree edge is one flow over the edge's path. A tree edge carries one chunk at a time: chunk
``i`` leaves the parent once the parent has it and chunk ``i - 1`` is in at the child (what the
planner's estimate assumes). A relay therefore forwards chunk ``i`` to its children as soon as
it is in, and its children's streams share its egress NIC max-min fairly with everything else;
a host has the model when its last chunk is in.

:class:`BroadcastExecution` runs one plan through a ``start_flow`` callable (the simulator's
flows, or a test's); :class:`TreeBroadcast` plans a simulator's broadcasts (kept per set of
receivers and link capacities) and starts their executions
(:meth:`~mlfabric.scheduler.sim.engine.Simulator.broadcast_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.policies.broadcast import BroadcastPlan, plan_broadcast

__all__ = ["BroadcastExecution", "StartFlow", "TreeBroadcast"]

#: ``start_flow(name, path, nbytes, arrived)``: start a flow of ``nbytes`` over the node path
#: ``path``; call ``arrived()`` once its last byte is in at the path's end.
StartFlow = Callable[[str, tuple[str, ...], float, Callable[[], None]], None]


class BroadcastExecution:
    """One broadcast plan executed as chunk flows.

    Parameters
    ----------
    plan : BroadcastPlan
        The tree, its paths and the chunk count.
    start_flow : StartFlow
        Starts one chunk's flow (the simulator's network).
    on_complete : callable
        ``on_complete(host)``, once per host of ``receivers`` when its last chunk is in.
    receivers : collection of str, optional
        The hosts to report (default: every host of the plan; relays that only forward are
        left out by passing the receivers).

    Examples
    --------
    A fake network where a flow arrives when the test says so:

    >>> from mlfabric.scheduler.policies.broadcast import BroadcastEdge
    >>> plan = BroadcastPlan("s", 2.0, 2, (BroadcastEdge("s", "a", ("s", "a"), 1.0),
    ...                                   BroadcastEdge("a", "b", ("a", "b"), 1.5)))
    >>> flows, done = [], []
    >>> run = BroadcastExecution(plan, lambda n, p, b, arrived: flows.append((n, arrived)), done.append)
    >>> run.start(); [n for n, _ in flows]
    ['s>a#0']
    >>> flows.pop(0)[1](); [n for n, _ in flows]          # chunk 0 in at a: a forwards it
    ['s>a#1', 'a>b#0']
    >>> for _ in range(3): flows.pop(0)[1]()
    >>> done, run.done
    (['a', 'b'], True)
    """

    def __init__(
        self,
        plan: BroadcastPlan,
        start_flow: StartFlow,
        on_complete: Callable[[str], None],
        receivers: Collection[str] | None = None,
    ) -> None:
        self.plan = plan
        self._start_flow = start_flow
        self._on_complete = on_complete
        self._report = set(plan.hosts if receivers is None else receivers)
        self._have = {plan.source: plan.chunks, **dict.fromkeys(plan.hosts, 0)}
        self._out: dict[str, list[int]] = {}  # parent -> indices of its edges
        for i, e in enumerate(plan.edges):
            self._out.setdefault(e.parent, []).append(i)
        self._sent = [0] * len(plan.edges)
        self._busy = [False] * len(plan.edges)
        self._left = len(plan.edges)

    @property
    def done(self) -> bool:
        """Every host of the plan has the whole model."""
        return self._left == 0

    def start(self) -> None:
        """Start the source's streams."""
        for i in self._out.get(self.plan.source, []):
            self._send(i)

    def _send(self, i: int) -> None:
        """Start edge ``i``'s next chunk if it is idle and its parent has that chunk."""
        e = self.plan.edges[i]
        chunk = self._sent[i]
        if self._busy[i] or chunk >= self.plan.chunks or self._have[e.parent] <= chunk:
            return
        self._sent[i] = chunk + 1
        self._busy[i] = True
        name = f"{e.parent}>{e.child}#{chunk}"
        self._start_flow(name, e.path, self.plan.chunk_bytes, lambda: self._arrived(i))

    def _arrived(self, i: int) -> None:
        child = self.plan.edges[i].child
        self._busy[i] = False
        self._have[child] += 1
        self._send(i)
        for j in self._out.get(child, []):
            self._send(j)
        if self._have[child] == self.plan.chunks:
            self._left -= 1
            if child in self._report:
                self._on_complete(child)


class TreeBroadcast:
    """A simulator's model broadcasts down planned relay trees.

    Plans are made with :func:`~mlfabric.scheduler.policies.broadcast.plan_broadcast` and kept
    per set of receivers and link capacities (a bandwidth change plans afresh).

    Parameters
    ----------
    source : str
        The server's host.
    nbytes : float
        The model's size.
    chunks : int, optional
        Override the chunk rule.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["ps", "a", "b"], 8e6)
    >>> tb = TreeBroadcast("ps", 1e6)
    >>> tb.plan(g, ["a", "b"]) is tb.plan(g, ["a", "b"])
    True
    """

    def __init__(self, source: str, nbytes: float, chunks: int | None = None) -> None:
        self.source = source
        self.nbytes = nbytes
        self.chunks = chunks
        self._plans: dict[tuple[tuple[str, ...], tuple[float, ...]], BroadcastPlan] = {}

    def plan(
        self, graph: nx.DiGraph, receivers: Sequence[str], paths: PathCache | None = None
    ) -> BroadcastPlan:
        """The plan for ``receivers`` on ``graph``'s current capacities (kept)."""
        key = (tuple(receivers), tuple(float(c) for _, _, c in graph.edges(data="capacity")))
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_broadcast(
                graph, self.source, list(receivers), self.nbytes, chunks=self.chunks, paths=paths
            )
            self._plans[key] = plan
        return plan

    def send(
        self,
        graph: nx.DiGraph,
        receivers: Sequence[str],
        start_flow: StartFlow,
        on_complete: Callable[[str], None],
        paths: PathCache | None = None,
    ) -> BroadcastExecution:
        """Plan (or reuse the plan) and start the broadcast; ``on_complete(receiver)`` as each has it."""
        run = BroadcastExecution(self.plan(graph, receivers, paths), start_flow, on_complete, receivers)
        run.start()
        return run
