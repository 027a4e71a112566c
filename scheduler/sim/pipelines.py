"""Pipelined (cut-through) aggregates in the fluid network (``mlfabric simulate --pipelined-aggregates``).

A store-and-forward aggregate (the default) leaves its aggregator once every member arrived
whole. A pipelined one (``PlannedAggregate.chunk_bytes > 0``,
:mod:`~mlfabric.scheduler.policies.pipelined`) forwards chunk ``i`` of its sum as soon as chunk
``i`` of every member is in. The simulator plays it with a fluid approximation:

* the aggregate may leave once every member has *started* arriving (the simulator reports a
  member of a pipelined aggregate to the runner when its transfer starts, not when it ends);
* its *body*, all but its last chunk, is a flow whose rate is capped by the rate of its
  slowest member still moving (0 while a member that is itself a pipelined aggregate waits
  for its own members), so, having started after them, it never forwarded more than a member
  delivered. The caps are re-read after every event of the simulation (they are constant
  between events, like every rate of the fluid model);
* its *tail*, the last chunk, moves once every member is in whole: it cannot finish before
  its last member finished plus one chunk's time on its path;

and otherwise it shares links max-min with every other flow. The tail is a flow of the same
id that waits at rate 0 (a cap of 0) until then, so to the scheduler the aggregate is one
transfer in flight from its start to its end.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlfabric.scheduler.sim.fluid import FluidNetwork

__all__ = ["Pipelines"]


@dataclass
class _Pipe:
    members: tuple[str, ...]
    links: tuple[tuple[str, str], ...]
    chunk: float  # the tail's bytes
    tail: bool = False  # the body is through; the tail's flow is in the network


class Pipelines:
    """The pipelined aggregates of one run, moving in ``net``.

    Parameters
    ----------
    net : FluidNetwork
        The simulator's network (flow ids: the payload ids).
    on_rate : callable, optional
        The network's ``on_rate``, told of a body's end (its rate 0 while the tail waits).

    Examples
    --------
    An aggregate of 2 bytes (1-byte chunks) on its own 1 byte/s link, fed by a member moving
    at 0.5 byte/s for 4 s: its body (1 byte) moves at 0.5 byte/s, its tail waits for the
    member (t = 4), then takes 1 s.

    >>> net = FluidNetwork({("w", "x"): 0.5, ("x", "ps"): 1.0})
    >>> net.add("m", [("w", "x")], 2.0)
    >>> p = Pipelines(net)
    >>> p.start("agg", ("m",), [("x", "ps")], 2.0, 1.0); p.refresh()
    >>> net.rate("agg"), net.next_completion()
    (0.5, 2.0)
    >>> net.advance_to(2.0), p.ended("agg"), net.rate("agg")
    (['agg'], True, 0.0)
    >>> net.advance_to(4.0), p.ended("m"), net.next_completion()
    (['m'], False, 5.0)
    """

    def __init__(
        self,
        net: FluidNetwork[tuple[str, str], str],
        on_rate: Callable[[str, float, float], None] | None = None,
    ) -> None:
        self.net = net
        self.on_rate = on_rate
        self._pipes: dict[str, _Pipe] = {}  # in order of start: members before their aggregates

    def __bool__(self) -> bool:
        """Whether a pipelined aggregate is moving."""
        return bool(self._pipes)

    def start(
        self,
        aggregate_id: str,
        members: Sequence[str],
        links: Sequence[tuple[str, str]],
        nbytes: float,
        chunk: float,
    ) -> None:
        """Start the aggregate's body now (every member has started arriving)."""
        tail = min(float(chunk), float(nbytes))
        self._pipes[aggregate_id] = _Pipe(tuple(members), tuple(links), tail)
        self.net.add(aggregate_id, links, float(nbytes) - tail)

    def _rate(self, member: str) -> float | None:
        """The rate ``member``'s bytes arrive at (``None``: all in)."""
        return self.net.rate(member) if member in self.net else None

    def refresh(self) -> None:
        """Cap each body at its slowest moving member's rate; let waiting tails go once all is in."""
        if not self._pipes:
            return
        for aid, p in self._pipes.items():
            if aid not in self.net:
                continue  # ended at this instant, its ended() to come
            rates = [r for r in map(self._rate, p.members) if r is not None]
            if p.tail:
                if not rates:
                    self.net.set_cap(aid, math.inf)
                continue
            self.net.set_cap(aid, min(rates, default=math.inf))

    def ended(self, flow: str) -> bool:
        """``flow`` left the network: True if it was a body (its tail now waits in the network)."""
        p = self._pipes.get(flow)
        if p is None or p.tail:
            self._pipes.pop(flow, None)
            self.refresh()
            return False
        p.tail = True
        if self.on_rate is not None:
            self.on_rate(flow, self.net.now, 0.0)
        self.net.add(flow, p.links, p.chunk, cap=0.0)
        self.refresh()
        return True
