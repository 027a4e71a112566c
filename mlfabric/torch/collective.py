"""All-reduce plans executed inside the training processes, over a torch process group.

The scheduler plans an all-reduce from the bandwidth graph (``scheduler/policies/allreduce.py``);
where the participants share a ``torch.distributed`` process group, the plan runs here, in the
processes themselves, instead of through the daemons (docs/allreduce.md): the bytes go once
from process to process (gloo's TCP pairs, or NCCL's), with no copy into a memfd, no daemon
hop and no per-chunk scheduler or daemon round trip. Two executors:

- :func:`native_allreduce`: the process group's own collective (gloo's ring on CPU, NCCL on
  GPU), where the planner's model says it is at least as fast as mlfabric's best tree (a
  uniform graph);
- :func:`tree_allreduce`: mlfabric's reduction tree, pipelined in chunks through the group's
  point-to-point operations: each participant sums its children's partial sums into its own
  contribution chunk by chunk and sends each chunk up as soon as it is summed; the root's
  finished chunks go down the tree, and every participant forwards the result chunks it gets
  to its children as they arrive.

Every call first agrees on what runs (:func:`agree`): one small ``all_gather`` of each
participant's operation signature (name and tensor layout) and plan epoch, so that a
participant whose tensors differ is named (``allreduce_mismatch``) rather than deadlocking
the group, and a new plan is adopted by every participant at the same call.

Examples
--------
A two-level tree over four ranks (rank 0 the root, 1 and 2 its children, 3 under 1)::

    plan = RankPlan.tree({0: None, 1: 0, 2: 0, 3: 1}, chunk_bytes=1 << 20)
    total = tree_allreduce(flat, plan, rank, group)      # every rank: the element-wise sum
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Agreement",
    "RankPlan",
    "agree",
    "describe_all",
    "native_allreduce",
    "signature",
    "tree_allreduce",
]

#: Chunks in flight per child (receives posted ahead of the sum).
WINDOW = 4
#: Tags of one operation: chunk ``k`` of the reduce phase is ``base + k``, of the broadcast
#: ``base + _PHASE + k``; operations take turns through ``_OPS`` bases.
_PHASE = 1 << 19
_OPS = 1 << 9


@dataclass(frozen=True)
class RankPlan:
    """An all-reduce plan over process-group ranks.

    Attributes
    ----------
    kind : str
        ``"native"`` (the group's own collective) or ``"tree"``.
    parent : mapping
        rank -> its parent rank (None at the root); empty for ``"native"``.
    chunk_bytes : int
        Bytes per pipelined chunk of a tree.
    epoch : int
        The plan's number: a new plan for the same operation has a higher one.
    description : str
        The plan's line for logs and ``handle.plan``.
    children : mapping
        rank -> its children, in the order their chunks are summed.

    Examples
    --------
    >>> p = RankPlan.tree({0: None, 1: 0, 2: 1}, chunk_bytes=4096)
    >>> p.root, p.children[0], p.children[1], p.children[2]
    (0, (1,), (2,), ())
    >>> RankPlan.native().kind
    'native'
    """

    kind: str
    parent: Mapping[int, int | None] = field(default_factory=dict)
    chunk_bytes: int = 1 << 20
    epoch: int = 0
    description: str = ""
    children: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def native(cls, *, epoch: int = 0, description: str = "native collective") -> RankPlan:
        """The process group's own all-reduce."""
        return cls("native", epoch=epoch, description=description)

    @classmethod
    def tree(
        cls,
        parent: Mapping[int, int | None],
        *,
        chunk_bytes: int,
        epoch: int = 0,
        description: str = "",
        children: Mapping[int, Sequence[int]] | None = None,
    ) -> RankPlan:
        """A reduction tree given by every rank's parent (children in rank order unless given).

        Raises
        ------
        ValueError
            Not exactly one root, a parent that is not a rank of the tree, or a cycle.
        """
        roots = [r for r, p in parent.items() if p is None]
        if len(roots) != 1:
            raise ValueError(f"a tree needs exactly one root, got {sorted(roots)}")
        for r, p in parent.items():
            if p is not None and p not in parent:
                raise ValueError(f"rank {r}'s parent {p} is not in the tree")
            seen = {r}
            while p is not None:
                if p in seen:
                    raise ValueError(f"the tree has a cycle through rank {p}")
                seen.add(p)
                p = parent[p]
        kids: dict[int, tuple[int, ...]] = {}
        for r in parent:
            given = None if children is None else children.get(r)
            kids[r] = (
                tuple(given) if given is not None else tuple(sorted(c for c, p in parent.items() if p == r))
            )
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        return cls("tree", dict(parent), chunk_bytes, epoch, description, kids)

    @property
    def root(self) -> int:
        """The rank where the sum is complete (trees only)."""
        return next(r for r, p in self.parent.items() if p is None)


def signature(name: str, tensors: Sequence[tuple[str, str, Sequence[int]]]) -> int:
    """A 62-bit fingerprint of an operation: its name and its tensors' names, dtypes and shapes.

    Examples
    --------
    >>> a = signature("grads", [("w", "float32", (2, 3))])
    >>> a == signature("grads", [("w", "float32", (2, 3))])
    True
    >>> a == signature("grads", [("w", "float32", (3, 2))])
    False
    """
    text = name + "\0" + "\0".join(f"{n}:{d}:{tuple(int(x) for x in s)}" for n, d, s in tensors)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2


@dataclass(frozen=True)
class Agreement:
    """What every participant contributed to :func:`agree`.

    Attributes
    ----------
    signatures : tuple of int
        Per rank, its operation's :func:`signature`.
    epochs : tuple of int
        Per rank, the newest plan epoch it holds (-1: none).
    oldest : tuple of int
        Per rank, the oldest plan epoch it still holds (-1: none).
    """

    signatures: tuple[int, ...]
    epochs: tuple[int, ...]
    oldest: tuple[int, ...] = ()

    def mismatched(self) -> list[int]:
        """Ranks whose signature differs from the most common one (ties: the lowest rank's).

        Examples
        --------
        >>> Agreement((7, 7, 9), (0, 0, 0)).mismatched()
        [2]
        >>> Agreement((7, 7), (0, 1)).mismatched()
        []
        """
        counts: dict[int, int] = {}
        for s in self.signatures:
            counts[s] = counts.get(s, 0) + 1
        common = max(counts, key=lambda s: (counts[s], -self.signatures.index(s)))
        return [r for r, s in enumerate(self.signatures) if s != common]

    def epoch(self) -> int:
        """The newest plan every rank holds (the lowest of the ranks' newest; -1: one has none)."""
        return min(self.epochs)


def agree(sig: int, epoch: int, group: Any, *, oldest: int = -1) -> Agreement:
    """Gather every rank's operation signature and newest and oldest plan epochs at the group's
    first rank, which broadcasts the table (three int64 per rank).

    Collective: every rank of ``group`` calls it once per operation, in the same order. Every
    rank gets the same :class:`Agreement`, so every rank decides alike from it. A gather and a
    broadcast take two message latencies where gloo's ``all_gather`` takes one per rank.
    """
    world = dist.get_world_size(group)
    first = dist.get_global_rank(group, 0)
    mine = torch.tensor([sig, epoch, oldest], dtype=torch.int64)
    table = torch.empty(3 * world, dtype=torch.int64)
    parts = [table[3 * r : 3 * r + 3] for r in range(world)] if dist.get_rank(group) == 0 else None
    dist.gather(mine, parts, dst=first, group=group)
    dist.broadcast(table, src=first, group=group)
    rows = table.view(world, 3).tolist()
    return Agreement(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows))


#: Bytes of each rank's description in :func:`describe_all` (longer ones are cut).
DESCRIPTION_BYTES = 512


def describe_all(text: str, group: Any) -> list[str]:
    """All-gather a short text from every rank (collective; used to name a mismatch's both sides).

    Each text is cut to :data:`DESCRIPTION_BYTES` bytes of UTF-8.
    """
    raw = text.encode()[:DESCRIPTION_BYTES]
    mine = torch.zeros(DESCRIPTION_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty(DESCRIPTION_BYTES, dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in out]


def native_allreduce(flat: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum ``flat`` over the group with the group's own collective, in place; returns ``flat``."""
    dist.all_reduce(flat, group=group)
    return flat


def _chunks(n: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(s, min(n, s + per_chunk)) for s in range(0, n, per_chunk)] or [(0, 0)]


def tree_allreduce(
    flat: torch.Tensor,
    plan: RankPlan,
    rank: int,
    group: Any,
    *,
    op_index: int = 0,
    window: int = WINDOW,
) -> torch.Tensor:
    """Sum a 1-D tensor over the ranks of ``plan``'s tree; every rank gets the sum.

    ``flat`` (contiguous, 1-D) is summed into in place at inner ranks and the root (it holds the
    rank's contribution, then partial sums); the result is returned (``flat`` itself at the
    root, a new tensor elsewhere). Chunks move as soon as they are summed, so chunk ``k + 1``
    climbs while chunk ``k`` is summed higher up and chunk ``k - 1`` comes down.

    Parameters
    ----------
    flat : torch.Tensor
        This rank's contribution, 1-D and contiguous; the same dtype and length at every rank.
    plan : RankPlan
        A ``"tree"`` plan over the group's ranks (``group`` ranks, not global ones).
    rank : int
        This process's rank in ``group``.
    group : ProcessGroup
        The process group whose point-to-point operations carry the chunks.
    op_index : int
        The operation's number (tags of successive operations differ).
    window : int
        Chunks in flight per child.

    Returns
    -------
    torch.Tensor
        The sum, 1-D, ``flat``'s dtype and length.

    Raises
    ------
    RuntimeError
        The group failed (a peer went away, or its timeout passed).
    """
    if plan.kind != "tree" or rank not in plan.parent:
        raise ValueError(f"rank {rank} is not in the plan's tree ({plan.description or plan.kind})")
    per_chunk = max(1, plan.chunk_bytes // flat.element_size())
    bounds = _chunks(flat.numel(), per_chunk)
    parent, children = plan.parent[rank], plan.children[rank]
    base = (op_index % _OPS) * (2 * _PHASE)
    if base + 2 * _PHASE > (1 << 31) - 1 or len(bounds) >= _PHASE:
        raise ValueError(f"too many chunks for one operation: {len(bounds)}")
    out = flat if parent is None else torch.empty_like(flat)
    # result chunks from the parent: posted at once, each forwarded to the children on arrival
    arriving: list[Any] = []
    if parent is not None:
        arriving = [
            dist.irecv(out[a:b], src=parent, group=group, tag=base + _PHASE + k)
            for k, (a, b) in enumerate(bounds)
        ]
    sends: list[Any] = []
    forwarder: threading.Thread | None = None
    failure: list[BaseException] = []

    def forward() -> None:
        """Forward each result chunk to the children as it arrives (a thread: gloo's works
        report completion only through ``wait``)."""
        try:
            for k, work in enumerate(arriving):
                work.wait()
                a, b = bounds[k]
                for c in children:
                    sends.append(dist.isend(out[a:b], dst=c, group=group, tag=base + _PHASE + k))
        except RuntimeError as exc:  # the group failed: raised by the caller's thread below
            failure.append(exc)

    if arriving and children:
        forwarder = threading.Thread(target=forward, name="mlfabric-tree-forward", daemon=True)
        forwarder.start()
    slots = min(window, len(bounds))
    staging = {c: [torch.empty(per_chunk, dtype=flat.dtype) for _ in range(slots)] for c in children}
    pending: dict[int, list[Any]] = {c: [] for c in children}

    def post(c: int, k: int) -> None:
        a, b = bounds[k]
        buf = staging[c][k % slots][: b - a]
        pending[c].append(dist.irecv(buf, src=c, group=group, tag=base + k))

    for c in children:
        for k in range(slots):
            post(c, k)
    up: list[Any] = []
    for k, (a, b) in enumerate(bounds):
        for c in children:
            pending[c][k].wait()
            flat[a:b].add_(staging[c][k % slots][: b - a])
            if k + slots < len(bounds):
                post(c, k + slots)
        if parent is not None:
            up.append(dist.isend(flat[a:b], dst=parent, group=group, tag=base + k))
        else:
            for c in children:
                sends.append(dist.isend(flat[a:b], dst=c, group=group, tag=base + _PHASE + k))
    for w in up:
        w.wait()
    if forwarder is not None:
        forwarder.join()
        if failure:
            raise failure[0]
    else:
        for work in arriving:
            work.wait()
    for w in sends:
        w.wait()
    return out
