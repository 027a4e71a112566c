"""The scheduler's side of all-reduce: collecting readiness, planning the tree or ring, failing cleanly.

:class:`AllreduceBook` is pure (times are arguments; directives are returned as
:class:`~mlfabric.scheduler.service.effects.Effects` the service core executes). Each operation
is keyed ``(job, name, seq)``:

1. ``AllreduceReady`` from each participant's daemon. The first fixes the operation's world
   size and tensors; a later one that disagrees (another world size, tensor names, dtypes or
   shapes), or a participant announced twice, aborts the operation at every participant with
   ``allreduce_mismatch`` naming both sides. More participants than the world size: the same.
2. Once ``world_size`` participants are in, :func:`~mlfabric.scheduler.policies.allreduce.
   plan_allreduce` chooses a tree or a ring from the bandwidth graph (current estimates) and
   each participant's daemon gets its ``AllreduceDirective`` (its parent and children, or the
   whole ring).
3. ``AllreduceDone`` from each daemon: ok (the operation is forgotten once every participant
   finished) or failed, which aborts the operation at every other participant
   (``AllreduceAbort`` with the failing participant's code and reason).
4. A daemon whose stream ends aborts every operation it takes part in
   (``allreduce_peer_lost``), announced or planned. An operation that never completes is failed
   by the participants' daemons at their deadline (their ``AllreduceDone``), so the scheduler
   needs no timer; a participant arriving at an operation already aborted gets the abort at once.

Operations of a process group (``plan_only``: the participants' processes run the plan over
their ``torch.distributed`` group, docs/allreduce.md) are agreed the same way, planned for the
process group (participants in process-rank order, :data:`~mlfabric.scheduler.policies.
allreduce.PROCESS_GROUP`: the group's own collective, or a tree where it wins) and finished
once the plans are out. The plan is **kept** per operation (job, name and tensor layout: its
``signature``) with an epoch: the processes run it on every later call without asking, and
:meth:`AllreduceBook.replan` (as the bandwidth estimates move) plans each kept operation
again and pushes the new plan (a higher epoch, ``seq`` 0) only when it differs.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.policies.allreduce import (
    PROCESS_GROUP,
    AllreducePlan,
    native_seconds,
    plan_allreduce,
    tree_seconds,
)
from mlfabric.scheduler.service.effects import Effects

__all__ = ["AllreduceBook"]

log = logging.getLogger("mlfabric.scheduler")
OpKey = tuple[str, str, int]


@dataclass
class _Op:
    key: OpKey
    world_size: int
    tensors: list[tuple[str, str, tuple[int, ...]]]
    nbytes: int
    first_at: float
    ready: dict[str, str] = field(default_factory=dict)  # participant -> host
    planned: bool = False
    done: set[str] = field(default_factory=set)
    #: a process group runs it: participant -> process rank, and the operation's signature
    plan_only: bool = False
    ranks: dict[str, int] = field(default_factory=dict)
    signature: int = 0

    def label(self) -> str:
        job, name, seq = self.key
        return f"all-reduce {name!r}#{seq} of job {job!r}"


def _spec(m: pb.AllreduceReady) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(t.name, t.dtype, tuple(int(d) for d in t.shape)) for t in m.tensors]


#: Seconds between two re-plannings of the kept process-group plans.
REPLAN_INTERVAL = 1.0
#: A kept plan is replaced only by one the model says is faster by more than this fraction.
REPLAN_GAIN = 0.05


@dataclass
class _Kept:
    """A process-group operation's plan, kept for its later calls."""

    hosts: dict[str, str]  # participant -> host
    ranks: dict[str, int]  # participant -> process rank
    nbytes: int
    world_size: int
    plan: AllreducePlan
    epoch: int


def _directive(
    key: OpKey, participant: str, plan: AllreducePlan, world_size: int, describe: str, **extra: Any
) -> pb.AllreduceDirective:
    """The ``AllreduceDirective`` of ``participant`` in operation ``key`` (``extra``: the
    executor's fields: a ring or tree position, or the process group's plan)."""
    job, name, seq = key
    return pb.AllreduceDirective(
        job=job,
        name=name,
        seq=seq,
        participant=participant,
        chunk_bytes=plan.chunk_bytes,
        world_size=world_size,
        plan=describe,
        **extra,
    )


def _shape(plan: AllreducePlan) -> tuple[object, ...]:
    """What the processes run: the kind, and a tree's parents and chunk."""
    if plan.kind == "native":
        return (plan.kind,)
    return (plan.kind, sorted(plan.parent.items()), plan.chunk_bytes)


class AllreduceBook:
    """All-reduce operations between their first readiness and their last participant's end.

    Parameters
    ----------
    graph : callable
        ``graph()`` -> the bandwidth graph to plan on (current estimates).
    address : callable
        ``address(host)`` -> the data-plane address of ``host``'s daemon.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> book = AllreduceBook(lambda: star(["a", "b"], 8e9), lambda h: f"127.0.0.1:{ord(h)}")
    >>> def ready(p, seq, shape):
    ...     t = pb.TensorSpec(name="w", dtype="float64", shape=shape)
    ...     return pb.AllreduceReady(job="j", name="g", seq=seq, participant=p, world_size=2,
    ...                              tensors=[t], bytes=8 * shape[0])
    >>> book.ready("a", ready("pa", 1, [2]), 0.0).directives
    []
    >>> sorted(h for h, d in book.ready("b", ready("pb", 1, [2]), 0.1).directives)
    ['a', 'b']
    >>> _ = book.ready("a", ready("pa", 2, [2]), 0.2)
    >>> [d.allreduce_abort.code for _, d in book.ready("b", ready("pb", 2, [3]), 0.3).directives]
    ['allreduce_mismatch', 'allreduce_mismatch']
    """

    def __init__(self, graph: Callable[[], nx.DiGraph], address: Callable[[str], str]) -> None:
        self._graph = graph
        self._address = address
        self.ops: dict[OpKey, _Op] = {}
        #: aborted operations: key -> (code, reason), so a late participant is told at once
        self.aborted: collections.OrderedDict[OpKey, tuple[str, str]] = collections.OrderedDict()
        #: process-group plans kept per (job, name, signature)
        self.kept: dict[tuple[str, str, int], _Kept] = {}
        #: plans made, by (executor, kind): what the metric ``mlfabric_allreduce_plans_total`` counts
        self.plans: collections.Counter[tuple[str, str]] = collections.Counter()
        self._replanned_at = -math.inf

    def ready(self, host: str, m: pb.AllreduceReady, now: float) -> Effects:
        """``AllreduceReady`` from ``host``; the directives (or aborts) it leads to."""
        key: OpKey = (m.job, m.name, int(m.seq))
        gone = self.aborted.get(key)
        if gone is not None:
            return Effects([(host, self._abort_directive(key, *gone))])
        op = self.ops.get(key)
        if op is None:
            op = self.ops[key] = _Op(key, int(m.world_size), _spec(m), int(m.bytes), now)
            op.plan_only, op.signature = m.plan_only, int(m.signature)
        problem = self._mismatch(op, host, m)
        if problem is not None:
            out = self.abort(key, "allreduce_mismatch", problem)
            if host not in {h for h, _ in out.directives}:  # the announcer (announced twice: its host too)
                out.send(host, self._abort_directive(key, "allreduce_mismatch", problem))
            return out
        op.ready[m.participant] = host
        op.ranks[m.participant] = int(m.process_rank)
        if len(op.ready) < op.world_size:
            return Effects()
        return self._plan_group(op) if op.plan_only else self._plan(op)

    def _mismatch(self, op: _Op, host: str, m: pb.AllreduceReady) -> str | None:
        label, who = op.label(), f"participant {m.participant!r} on host {host!r}"
        first = next(iter(op.ready), None)
        if m.participant in op.ready:
            return f"{label}: {who} announced twice (already on host {op.ready[m.participant]!r})"
        if op.planned or len(op.ready) >= op.world_size:
            return f"{label}: {who} is one more than the world size {op.world_size}"
        if int(m.world_size) != op.world_size:
            return (
                f"{label}: {who} says world size {m.world_size}, participant {first!r} said {op.world_size}"
            )
        if m.plan_only != op.plan_only:
            how = "through a process group" if m.plan_only else "through the daemons"
            return f"{label}: {who} runs it {how}, participant {first!r} does not"
        if op.plan_only and (not 0 <= m.process_rank < op.world_size or m.process_rank in op.ranks.values()):
            taken = sorted(op.ranks.values())
            return (
                f"{label}: {who} says process rank {m.process_rank} "
                f"(world size {op.world_size}, ranks taken: {taken})"
            )
        spec = _spec(m)
        if spec != op.tensors:
            mine, theirs = dict((n, (d, s)) for n, d, s in spec), dict((n, (d, s)) for n, d, s in op.tensors)
            diff = [
                f"{n!r}: {mine.get(n, 'missing')} vs {theirs.get(n, 'missing')}"
                for n in sorted(set(mine) | set(theirs))
                if mine.get(n) != theirs.get(n)
            ] or ["tensor order differs"]
            return (
                f"{label}: {who}'s tensors differ from participant {first!r}'s "
                f"(name: (dtype, shape) here vs there): {'; '.join(diff)}"
            )
        return None

    def _plan(self, op: _Op) -> Effects:
        try:
            plan = plan_allreduce(self._graph(), sorted(op.ready.items()), op.nbytes)
        except ValueError as exc:
            return self.abort(op.key, "allreduce_failed", f"{op.label()}: cannot plan: {exc}")
        op.planned = True
        self.plans["daemons", plan.kind] += 1
        describe = plan.describe(op.ready)
        log.info("%s: %s", op.label(), describe)

        def peer(p: str | None) -> pb.AllreducePeer:
            if p is None:
                return pb.AllreducePeer()
            return pb.AllreducePeer(participant=p, host=op.ready[p], data_address=self._address(op.ready[p]))

        out = Effects()
        ring = [peer(p) for p in plan.ring] if plan.kind == "ring" else []
        for p, host in sorted(op.ready.items()):
            d = _directive(op.key, p, plan, op.world_size, describe)
            if ring:  # every participant gets the whole ring and finds its place in it
                d.ring.extend(ring)
            else:
                d.parent.CopyFrom(peer(plan.parent[p]))
                d.children.extend(peer(c) for c in plan.children[p])
            out.send(host, pb.Directive(allreduce=d))
        return out

    def _plan_group(self, op: _Op) -> Effects:
        """Plan a process-group operation (participants in rank order), keep it, send it out."""
        job, name, _ = op.key
        kept = self.kept.get((job, name, op.signature))
        try:
            plan = self._group_plan(op.ready, op.ranks, op.nbytes)
        except ValueError as exc:
            return self.abort(op.key, "allreduce_failed", f"{op.label()}: cannot plan: {exc}")
        if kept is not None and kept.hosts == op.ready and kept.ranks == op.ranks:
            if _shape(kept.plan) != _shape(plan):
                kept.plan, kept.epoch = plan, kept.epoch + 1
        else:
            epoch = 0 if kept is None else kept.epoch + 1
            kept = _Kept(dict(op.ready), dict(op.ranks), op.nbytes, op.world_size, plan, epoch)
            self.kept[(job, name, op.signature)] = kept
        del self.ops[op.key]  # the processes run it: nothing more to hear about
        self.plans["process_group", kept.plan.kind] += 1
        log.info("%s (process group, epoch %d): %s", op.label(), kept.epoch, kept.plan.describe(op.ready))
        return self._group_directives(op.key, op.signature, kept)

    def _group_plan(self, hosts: dict[str, str], ranks: dict[str, int], nbytes: int) -> AllreducePlan:
        order = sorted(hosts, key=ranks.__getitem__)
        return plan_allreduce(self._graph(), [(p, hosts[p]) for p in order], nbytes, executor=PROCESS_GROUP)

    def _group_directives(self, key: OpKey, signature: int, kept: _Kept) -> Effects:
        plan, ranks = kept.plan, kept.ranks
        parents = [-1] * kept.world_size
        if plan.kind == "tree":
            for p, q in plan.parent.items():
                parents[ranks[p]] = -1 if q is None else ranks[q]
        out = Effects()
        for p, host in sorted(kept.hosts.items()):
            d = _directive(
                key,
                p,
                plan,
                kept.world_size,
                plan.describe(kept.hosts),
                executor_kind=plan.kind,
                epoch=kept.epoch,
                parent_ranks=parents if plan.kind == "tree" else [],
                model_seconds=plan.seconds,
                signature=signature,
            )
            out.send(host, pb.Directive(allreduce=d))
        return out

    def replan(self, now: float, *, force: bool = False) -> Effects:
        """Plan the kept process-group operations again on the current estimates (at most once per
        :data:`REPLAN_INTERVAL` unless ``force``: a new topology); push each plan that changed and
        is faster by :data:`REPLAN_GAIN`."""
        if not self.kept or (now - self._replanned_at < REPLAN_INTERVAL and not force):
            return Effects()
        self._replanned_at = now
        out = Effects()
        for (job, name, signature), kept in self.kept.items():
            try:
                plan = self._group_plan(kept.hosts, kept.ranks, kept.nbytes)
            except ValueError:
                continue  # a host left the graph: the next call asks and fails there
            if _shape(plan) == _shape(kept.plan):
                kept.plan = plan  # the same plan; its model time moved
                continue
            current = self._group_plan_seconds(kept)
            if plan.seconds < current * (1 - REPLAN_GAIN):
                kept.plan, kept.epoch = plan, kept.epoch + 1
                self.plans["process_group", plan.kind] += 1
                log.info(
                    "all-reduce %r of job %r: new plan (epoch %d): %s",
                    name,
                    job,
                    kept.epoch,
                    plan.describe(kept.hosts),
                )
                out += self._group_directives((job, name, 0), signature, kept)
        return out

    def _group_plan_seconds(self, kept: _Kept) -> float:
        """The kept plan's time on the current estimates."""
        order = [kept.hosts[p] for p in sorted(kept.hosts, key=kept.ranks.__getitem__)]
        graph, plan = self._graph(), kept.plan
        if plan.kind == "native":
            return native_seconds(graph, order, kept.nbytes, PROCESS_GROUP)
        chunk = plan.chunk_bytes
        return tree_seconds(graph, plan.parent, kept.hosts, kept.nbytes, chunk, executor=PROCESS_GROUP)

    def host_left(self, host: str) -> None:
        """Forget the kept plans with a participant on ``host`` (its daemon went away)."""
        for key in [k for k, kept in self.kept.items() if host in kept.hosts.values()]:
            del self.kept[key]

    def done(self, host: str, m: pb.AllreduceDone) -> Effects:
        """``AllreduceDone`` from ``host``: forget the operation when all are done, abort on a failure."""
        key: OpKey = (m.job, m.name, int(m.seq))
        op = self.ops.get(key)
        if op is None:
            return Effects()
        if not m.ok:
            return self.abort(key, m.code or "allreduce_failed", m.reason, skip=m.participant)
        op.done.add(m.participant)
        if op.done >= set(op.ready) and len(op.done) >= op.world_size:
            del self.ops[key]
        return Effects()

    def host_lost(self, host: str) -> Effects:
        """The daemon of ``host`` went away: abort every operation with a participant there."""
        self.host_left(host)
        out = Effects()
        for key, op in list(self.ops.items()):
            lost = sorted(p for p, h in op.ready.items() if h == host and p not in op.done)
            if lost:
                reason = f"{op.label()}: the daemon of host {host!r} (participants {lost}) disconnected"
                out += self.abort(key, "allreduce_peer_lost", reason, skip_host=host)
        return out

    def abort(self, key: OpKey, code: str, reason: str, *, skip: str = "", skip_host: str = "") -> Effects:
        """Abort ``key`` at every participant but ``skip`` (and those on ``skip_host``)."""
        op = self.ops.pop(key, None)
        self.aborted[key] = (code, reason)
        while len(self.aborted) > 4096:
            self.aborted.popitem(last=False)
        if op is None:
            return Effects()
        log.info("%s aborted: %s", op.label(), reason)
        directive = self._abort_directive(key, code, reason)
        hosts = sorted({h for p, h in op.ready.items() if p != skip and h != skip_host and p not in op.done})
        return Effects([(h, directive) for h in hosts])

    @staticmethod
    def _abort_directive(key: OpKey, code: str, reason: str) -> pb.Directive:
        job, name, seq = key
        return pb.Directive(
            allreduce_abort=pb.AllreduceAbort(job=job, name=name, seq=seq, reason=reason, code=code)
        )
