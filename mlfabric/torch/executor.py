"""Running a group's all-reduces in its training processes, with plans kept between calls.

:class:`GroupExecutor` is what an :class:`~mlfabric.allreduce.AllreduceGroup` joined with a
``process_group`` uses instead of its daemon (docs/allreduce.md, "Through the process group"):

1. The first call of an operation (its name and tensor layout) asks the scheduler for a plan
   through the daemon (``plan_source``; the scheduler checks that every participant agrees,
   as for any all-reduce, and plans from the bandwidth graph for the process group:
   ``scheduler/policies/allreduce.py``, ``PROCESS_GROUP``). The plan is kept.
2. Every later call runs the kept plan at once: no daemon, no scheduler round trip. The
   participants first agree in one small ``all_gather`` (:func:`~.collective.agree`): a
   participant whose tensors differ fails the call for everyone with ``allreduce_mismatch``
   naming it, and a plan the scheduler pushed since (the bandwidth graph changed enough to
   change it: :meth:`GroupExecutor.on_plan`) is used once every participant holds it.
3. The plan runs as the group's own collective (``"native"``) or as mlfabric's tree through
   the group's point-to-point operations (``"tree"``), on one thread, in call order (DDP
   launches its buckets in the same order at every rank).

Errors (:class:`~mlfabric.localclient.MlfabricError`): ``allreduce_mismatch``,
``allreduce_peer_lost`` (a peer's process went away: the group is broken from then on),
``allreduce_timeout`` (the group's timeout passed), and the scheduler's codes for a plan request.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlfabric import tensors as tcodec
from mlfabric.allreduce import AllreduceHandle
from mlfabric.localclient import MlfabricError
from mlfabric.torch.collective import (
    RankPlan,
    agree,
    describe_all,
    native_allreduce,
    signature,
    tree_allreduce,
)

__all__ = ["GroupExecutor", "PlanCache", "PlanSource"]

#: ``plan_source(name, layouts, signature, rank) -> RankPlan``: ask the scheduler for the plan
#: of an operation (blocks; raises :class:`MlfabricError`).
PlanSource = Callable[[str, Sequence[tcodec.Layout], int, int], RankPlan]


class PlanCache:
    """The plans of a participant's operations, by (name, signature) and epoch (thread-safe).

    Parameters
    ----------
    keep : int
        Epochs kept per operation (older ones are forgotten).

    Examples
    --------
    >>> cache = PlanCache(keep=2)
    >>> for e in (0, 1, 2):
    ...     cache.add("g", 7, RankPlan.native(epoch=e))
    >>> cache.newest("g", 7), cache.oldest("g", 7), cache.get("g", 7, 0)
    (2, 1, None)
    >>> cache.newest("g", 8)
    -1
    """

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._plans: dict[tuple[str, int], collections.OrderedDict[int, RankPlan]] = {}

    def add(self, name: str, sig: int, plan: RankPlan) -> None:
        """Keep ``plan`` (by its epoch) for the operation."""
        with self._lock:
            plans = self._plans.setdefault((name, sig), collections.OrderedDict())
            plans[plan.epoch] = plan
            for epoch in sorted(plans)[: max(0, len(plans) - self._keep)]:
                del plans[epoch]

    def get(self, name: str, sig: int, epoch: int) -> RankPlan | None:
        """The plan of that epoch, or None."""
        with self._lock:
            plans = self._plans.get((name, sig))
            return None if plans is None else plans.get(epoch)

    def newest(self, name: str, sig: int) -> int:
        """The newest epoch held (-1: none)."""
        with self._lock:
            plans = self._plans.get((name, sig))
            return max(plans) if plans else -1

    def oldest(self, name: str, sig: int) -> int:
        """The oldest epoch held (-1: none)."""
        with self._lock:
            plans = self._plans.get((name, sig))
            return min(plans) if plans else -1


@dataclass
class _Op:
    name: str
    tensors: Mapping[str, Any]
    inplace: bool
    handle: AllreduceHandle
    trusted: bool = False


#: A ``trusted`` operation (every rank's tensors agree by construction, as DDP's buckets do)
#: runs the per-call agreement only on every this many calls of its name (and when its
#: tensors change): a newer plan is adopted at the next such call.
AGREE_EVERY = 16


def _error_code(exc: BaseException) -> str:
    text = str(exc).lower()
    return "allreduce_timeout" if "timed out" in text or "timeout" in text else "allreduce_peer_lost"


class GroupExecutor:
    """One participant's all-reduces, run over a process group (see the module docstring).

    Parameters
    ----------
    group : ProcessGroup
        The participants' group (its ranks are the all-reduce's participants); the executor
        runs on a group of its own over the same ranks, made by :meth:`start`.
    plan_source : PlanSource
        Asks the scheduler for an operation's plan.
    timeout : float
        Seconds any collective or point-to-point operation may wait (the own group's timeout).

    Notes
    -----
    No I/O in the constructor. :meth:`start` is collective: every rank of the default group
    calls it (``torch.distributed.new_group``), in the same order as its other group creations.
    """

    def __init__(self, group: Any, plan_source: PlanSource, *, timeout: float) -> None:
        self._given = group
        self._plan_source = plan_source
        #: seconds any operation of the executor's group may wait
        self.timeout = timeout
        self.plans = PlanCache()
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        self._ops = itertools.count()
        self._broken: MlfabricError | None = None
        #: plans asked of the scheduler (one per operation, unless the group's plans diverge)
        self.plan_requests = 0
        #: per operation name, its calls so far; per (name, signature), the plan agreed last
        self._calls: dict[str, int] = {}
        self._agreed: dict[tuple[str, int], RankPlan] = {}
        self.rank = -1
        self.world_size = 0

    def start(self) -> None:
        """Make the executor's own group (collective) and start its thread."""
        ranks = dist.get_process_group_ranks(self._given)
        self._group = dist.new_group(
            ranks=ranks,
            backend=dist.get_backend(self._given),
            timeout=datetime.timedelta(seconds=self.timeout),
        )
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self._thread = threading.Thread(target=self._run, name="mlfabric-allreduce", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the operations queued, then stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def on_plan(self, name: str, sig: int, plan: RankPlan) -> None:
        """A plan pushed by the scheduler (a newer epoch): used once every rank holds it."""
        self.plans.add(name, sig, plan)

    def submit(
        self,
        name: str,
        tensors: Mapping[str, Any],
        *,
        seq: int,
        inplace: bool = False,
        trusted: bool = False,
    ) -> AllreduceHandle:
        """Queue an all-reduce of ``tensors``; the handle resolves with the sums.

        ``inplace``: torch tensors may be summed into (a DDP bucket). ``trusted``: the caller
        guarantees that every rank's tensors of this name agree (DDP checks its model's
        parameters across ranks and builds the same buckets everywhere), so the per-call
        agreement runs only every :data:`AGREE_EVERY` calls; a rank whose tensors still differ
        would make gloo's own all-reduce abort its process, so never pass it for anything else.
        """
        as_torch = any(tcodec._is_torch(v) for v in tensors.values())
        handle = AllreduceHandle(name, seq, as_torch, lambda failed: None)
        self._queue.put(_Op(name, tensors, inplace, handle, trusted))
        return handle

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while (op := self._queue.get()) is not None:
            try:
                result, plan = self._allreduce(op)
            except MlfabricError as exc:
                op.handle._finish(None, exc, "")
            except (tcodec.TensorError, ValueError, TypeError) as exc:
                op.handle._finish(None, MlfabricError(f"all-reduce {op.name!r}: {exc}", "bad_tensor"), "")
            else:
                op.handle._finish(result, None, plan.description)

    def _allreduce(self, op: _Op) -> tuple[dict[str, Any], RankPlan]:
        if self._broken is not None:
            raise self._broken
        layouts, _ = tcodec.plan_layout(op.tensors)
        sig = signature(op.name, [(x.name, x.dtype, x.shape) for x in layouts])
        calls = self._calls.get(op.name, 0)
        self._calls[op.name] = calls + 1
        try:
            plan = self._agreed.get((op.name, sig)) if op.trusted and calls % AGREE_EVERY else None
            if plan is None:
                plan = self._agreed_plan(op.name, sig, layouts)
                self._agreed[(op.name, sig)] = plan
            return self._execute(op, layouts, plan), plan
        except RuntimeError as exc:
            if isinstance(exc, MlfabricError):
                raise
            self._broken = MlfabricError(
                f"all-reduce {op.name!r}: the process group failed: {exc}", _error_code(exc)
            )
            raise self._broken from exc

    def _agreed_plan(self, name: str, sig: int, layouts: Sequence[tcodec.Layout]) -> RankPlan:
        newest, oldest = self.plans.newest(name, sig), self.plans.oldest(name, sig)
        agreement = agree(sig, newest, self._group, oldest=oldest)
        wrong = agreement.mismatched()
        if wrong:
            mine = f"{name!r}: " + ", ".join(f"{x.name!r} {x.dtype} {x.shape}" for x in layouts)
            seen = describe_all(mine, self._group)  # every rank takes this branch alike
            first = wrong[0]
            other = next(r for r in range(len(seen)) if r not in wrong)
            sides = f"rank {first} has {seen[first]}, rank {other} has {seen[other]}"
            raise MlfabricError(
                f"all-reduce {name!r}: the operation or tensors of rank(s) {wrong} of the process group "
                f"differ from the other ranks': {sides}",
                "allreduce_mismatch",
            )
        epoch = agreement.epoch()
        if epoch >= 0 and epoch >= max(agreement.oldest):
            plan = self.plans.get(name, sig, epoch)
            if plan is not None:
                return plan
        self.plan_requests += 1
        plan = self._plan_source(name, layouts, sig, self.rank)  # every rank asks: the same data
        self.plans.add(name, sig, plan)
        return plan

    def _execute(self, op: _Op, layouts: Sequence[tcodec.Layout], plan: RankPlan) -> dict[str, Any]:
        by_dtype: dict[str, list[tcodec.Layout]] = {}
        for x in layouts:
            by_dtype.setdefault(x.dtype, []).append(x)
        out: dict[str, Any] = {}
        for dtype, group in by_dtype.items():
            parts = [_as_torch(op.tensors[x.name], dtype) for x in group]
            if len(parts) == 1 and op.inplace and parts[0].is_contiguous():
                flat = parts[0].view(-1)
            else:
                flat = torch.cat([p.reshape(-1) for p in parts])
            if plan.kind == "tree" and self.world_size > 1:
                total = tree_allreduce(flat, plan, self.rank, self._group, op_index=next(self._ops))
            else:
                total = native_allreduce(flat, self._group)
            pos = 0
            for x, p in zip(group, parts, strict=True):
                n = p.numel()
                value = total[pos : pos + n].view(p.shape)
                pos += n
                out[x.name] = value if op.handle._as_torch else _to_numpy(value, dtype)
        return {x.name: out[x.name] for x in layouts}


def _as_torch(value: Any, dtype: str) -> torch.Tensor:
    """A CPU torch tensor of ``value`` (numpy arrays shared, bfloat16 words reinterpreted)."""
    if tcodec._is_torch(value):
        return value.detach()
    arr = np.ascontiguousarray(value)
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _to_numpy(value: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return value.contiguous().view(torch.int16).numpy().view(np.uint16)
    return value.contiguous().numpy()
