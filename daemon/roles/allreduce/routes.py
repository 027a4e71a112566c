"""Where each chunk of an all-reduce comes from and goes, for a tree or a ring (docs/allreduce.md).

A directive places one participant in the operation's plan. :func:`routing` turns it into the
payload's chunks and, per chunk, a :class:`Route`: whose partial sums it sums (``children``),
where it sends its partial sum (``parent``; none at the chunk's root), whom the result comes
from (``source``; none at the root) and whom it forwards the result to (``forward``).

- **tree**: one route for every chunk (the directive's parent and children); chunks of
  :func:`~mlfabric.daemon.roles.allreduce.chunks.split_chunks`.
- **ring** of ``N`` participants ``ring[0..N-1]``, this one at position ``i``: the payload is
  cut into ``N`` segments, each into chunks (:func:`~mlfabric.daemon.roles.allreduce.chunks.
  split_segments`). Segment ``k`` is a chain along the ring: it starts at ``ring[k]`` (a leaf:
  its own contribution), is summed at each next participant, and is complete at its root
  ``ring[k-1]`` after ``N-1`` hops (reduce-scatter); the root sends it on, and every
  participant forwards it to the next until ``ring[k-2]`` (all-gather: ``N-1`` hops). So a
  participant only ever sends to ``ring[i+1]`` and receives from ``ring[i-1]``, every segment
  starts at once at a different participant (every link busy from the first step), and each
  moves ``2 (N-1)/N`` of the payload over each ring hop.

Each chunk's reduce path visits every participant exactly once (a tree's edges, or the ring
from ``k`` to ``k-1``), which the daemon's ``summed`` checks enforce at run time. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlfabric.daemon.roles.allreduce.chunks import Chunk, split_chunks, split_segments
from mlfabric.wire.tensors import Layout

__all__ = ["Route", "Routing", "routing"]


@dataclass(frozen=True)
class Route:
    """One chunk's neighbours at this participant.

    Attributes
    ----------
    children : tuple of str
        Participants whose partial sums of the chunk come here (empty: a leaf, whose partial
        sum is its own contribution).
    parent : AllreducePeer or None
        Where the partial sum goes (None: the root, where the chunk's sum is complete).
    source : str or None
        The participant the chunk's result comes from (None at the root).
    forward : tuple of AllreducePeer
        Where the chunk's result goes on to.
    """

    children: tuple[str, ...]
    parent: Any
    source: str | None
    forward: tuple[Any, ...]


@dataclass(frozen=True)
class Routing:
    """The chunks of one participant's part and each one's route.

    Attributes
    ----------
    chunks : list of Chunk
        The payload's chunks (indices from 0, in payload order).
    segment_of : list of int
        Each chunk's segment (all 0 for a tree).
    routes : list of Route
        One per segment.
    peers : dict
        participant -> AllreducePeer of every peer this participant sends to.
    kind : str
        ``"tree"`` or ``"ring"``.
    """

    chunks: list[Chunk]
    segment_of: list[int]
    routes: list[Route]
    peers: dict[str, Any]
    kind: str

    def route(self, index: int) -> Route:
        """Chunk ``index``'s route."""
        return self.routes[self.segment_of[index]]


def routing(directive: Any, layouts: Sequence[Layout], payload_bytes: int) -> Routing:
    """The chunks and routes of ``directive`` (an ``AllreduceDirective``).

    Parameters
    ----------
    directive : AllreduceDirective
        ``ring`` set: a ring in that order; otherwise the tree's ``parent``/``children``.
    layouts : sequence of Layout
        The payload's tensors.
    payload_bytes : int
        The payload's size.

    Returns
    -------
    Routing

    Raises
    ------
    ValueError
        A ring that does not hold this participant exactly once, or whose length is not the
        world size, or a participant listed twice in it.

    Examples
    --------
    >>> from mlfabric.proto.v1 import control_pb2 as pb
    >>> ring = [pb.AllreducePeer(participant=p) for p in ("a", "b", "c")]
    >>> d = pb.AllreduceDirective(participant="b", ring=ring, chunk_bytes=8, world_size=3)
    >>> r = routing(d, [Layout("x", "float64", (3,), 0, 24)], 24)
    >>> [(s.children, s.parent and s.parent.participant, s.source,
    ...   [f.participant for f in s.forward]) for s in r.routes]
    [(('a',), 'c', 'a', []), ((), 'c', 'a', ['c']), (('a',), None, None, ['c'])]
    """
    chunk_bytes = max(1, int(directive.chunk_bytes))
    me = directive.participant
    if not directive.ring:
        parent = directive.parent if directive.parent.participant else None
        children = tuple(c.participant for c in directive.children)
        source = parent.participant if parent is not None else None
        route = Route(children, parent, source, tuple(directive.children))
        peers = {c.participant: c for c in directive.children}
        if parent is not None:
            peers[parent.participant] = parent
        chunks = split_chunks(layouts, payload_bytes, chunk_bytes)
        return Routing(chunks, [0] * len(chunks), [route], peers, "tree")
    names = [p.participant for p in directive.ring]
    n = len(names)
    if names.count(me) != 1 or len(set(names)) != n:
        raise ValueError(f"ring {names} does not hold participant {me!r} exactly once")
    if n != directive.world_size:
        raise ValueError(f"ring of {n} participants for world size {directive.world_size}")
    i = names.index(me)
    left, right = directive.ring[(i - 1) % n], directive.ring[(i + 1) % n]
    routes = []
    for k in range(n):
        root = (k - 1) % n
        routes.append(
            Route(
                children=() if i == k else (left.participant,),
                parent=None if i == root else right,
                source=None if i == root else left.participant,
                forward=() if (i + 1) % n == root else (right,),
            )
        )
    chunks, segment_of = split_segments(layouts, payload_bytes, n, chunk_bytes)
    peers = {right.participant: right} if n > 1 else {}
    return Routing(chunks, segment_of, routes, peers, "ring")
