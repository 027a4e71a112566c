"""A DistributedOptimizer for mlfabric's parameter-server path (the Horovod/BytePS idiom).

A PyTorch script switches to mlfabric by wrapping its optimizer::

    opt = mlfabric.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), worker=worker
    )
    opt.pull()                       # start from the servers' model
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # each group's update is pushed as backward produces it
        opt.step()                        # waits for this step's verdicts, loads the servers' model

**The model on the servers.** The parameters are split into *groups* (:func:`plan_groups`:
consecutive parameters, at most ``group_bytes`` each); group ``i`` is the whole model of its
own server ``"<prefix>.<i>"`` (a push carries every tensor of its server's model, named as
``named_parameters`` names them). :class:`GroupServers` registers those servers (the server
role, e.g. rank 0 under torchrun); both sides derive the groups from the same names and
shapes.

**What is pushed: the parameter delta, not the gradient.** The server applies an update by
subtracting it (``model[k] -= update[k]``, :mod:`mlfabric.server`'s default). The optimizer
runs the wrapped optimizer on the worker's copy of the group (the servers' model as last
pulled) and pushes ``before - after``: exactly what the user's ``step`` would have applied,
with its learning rate, momentum, Adam moments, weight decay, and whatever the user did to
the gradients first. The wrapped optimizer's state stays on the worker.

**Wait-free backprop** (``wait_free=True``, Poseidon): a gradient hook
(``register_post_accumulate_grad_hook``) sees a group's last gradient accumulate, runs the
wrapped optimizer on that group alone, and hands the delta to a background sender, which
stages it (CUDA: :mod:`mlfabric.torch.staging`) and pushes it while backward goes on to the
earlier layers. A group's update is then fixed before ``step()``; anything that changes the
gradients after backward — ``clip_grad_norm_``, ``GradScaler.unscale_`` — must run with
``wait_free=False``, where ``step()`` runs the wrapped optimizer once over all groups and then
pushes them all (still concurrently). ``step()`` refuses (``RuntimeError``, naming the group) a
gradient changed after its group was pushed, rather than let the server apply a different
update than the user's step would have.

**The step.** ``step()`` waits for its pushes' verdicts, then loads the servers' model into
the parameters: ``mode="async"``: each server's current model (the freshest; a push older
than ``tau_max`` is DROPPED by the server); ``mode="sync"`` (servers with
``Params(sync_workers=N)``): the round's model, ``get(min_version=<the round's version>)``.
**Pipelined pulls** (``pipeline=True``, the default): each group's model is fetched as soon as
its own push's verdict is in, on a small pool of threads, while the other groups' pushes are
still on their way (a push goes up the worker's link, a model comes down it); ``step()`` then
only copies the fetched models into the parameters (on the training thread: nothing changes
a parameter while backward may still read it). ``pipeline=False`` fetches the groups one
after another once every verdict is in.
A DROPPED push raises :class:`~mlfabric.MlfabricError` (code ``dropped``) after the model
was loaded, unless ``on_drop="count"``; an UNKNOWN one always raises (code ``unknown``).
Bad input and exactly-once are :meth:`mlfabric.Worker.push`'s.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from mlfabric.localclient import APPLIED, DROPPED, MlfabricError, PushHandle, PushResult
from mlfabric.torch.groups import GROUP_BYTES, GroupServers, _groups_of, _named, plan_groups, server_name
from mlfabric.torch.staging import Stager, default_stager, has_device_tensors

__all__ = [
    "GROUP_BYTES",
    "PULL_THREADS",
    "DistributedOptimizer",
    "GroupServers",
    "plan_groups",
    "server_name",
]

#: Threads fetching the groups' models at most (``pipeline=True``).
PULL_THREADS = 4

#: a group's verdict and its model (or the error fetching it)
_Fetched = tuple[PushResult, dict[str, Any] | BaseException]


class DistributedOptimizer:
    """Wraps a ``torch.optim.Optimizer``: its updates go to mlfabric's servers (module docstring).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The wrapped optimizer, over the parameters of ``named_parameters``.
    named_parameters : iterable of (name, tensor)
        Names the tensors on the servers (``model.named_parameters()``).
    worker : mlfabric.Worker
        From :func:`mlfabric.register_as_worker` (or :meth:`mlfabric.torch.Context.register_worker`).
    mode : {"async", "sync"}
        What ``step()`` loads: each server's current model, or the round's.
    prefix, group_bytes :
        The servers' names and the grouping, as :class:`GroupServers` was given them.
    wait_free : bool
        Push each group from its gradient hook during backward (True), or all of them in
        ``step()`` (False: needed for gradient clipping and GradScaler).
    backward_passes_per_step : int
        Backward passes accumulated into the gradients before a group is ready (wait-free).
    on_drop : {"raise", "count"}
        A DROPPED push raises in ``step()``, or is counted in :attr:`dropped`.
    pipeline : bool
        Fetch each group's model as soon as its verdict is in, while the other groups' pushes
        go on (True), or all groups one after another after the last verdict (False).
    timeout : float
        Seconds a step waits for a verdict, and for a model.
    stager : Stager, optional
        Device staging of CUDA updates (default :func:`mlfabric.torch.staging.default_stager`).

    Attributes
    ----------
    optimizer : torch.optim.Optimizer
    steps : int
        Steps that pushed (``state_dict`` keeps it).
    pushed, applied, dropped : int
        Pushes made, and how they resolved.
    last_results : list of PushResult
        The verdicts of the last step, by group.
    last_overlap : float
        The fraction of the last step's communication hidden behind backward: from its first
        push to the last verdict, the part before ``step()`` was called (0 without wait-free).
    hidden_seconds, comm_seconds : float
        Those two spans summed over the steps (their ratio: the overall fraction hidden).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Any]],
        worker: Any,
        *,
        mode: str = "async",
        prefix: str = "ps",
        group_bytes: int = GROUP_BYTES,
        wait_free: bool = True,
        backward_passes_per_step: int = 1,
        on_drop: str = "raise",
        pipeline: bool = True,
        timeout: float = 120.0,
        stager: Stager | None = None,
    ) -> None:
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")
        if on_drop not in ("raise", "count"):
            raise ValueError(f"on_drop must be 'raise' or 'count', got {on_drop!r}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be 1 or more, got {backward_passes_per_step}")
        named = [(n, p) for n, p in _named(named_parameters)]
        known = {id(p) for group in optimizer.param_groups for p in group["params"]}
        strangers = [n for n, p in named if id(p) not in known]
        if strangers:
            raise ValueError(f"parameters {strangers} are not among the wrapped optimizer's parameters")
        self.optimizer = optimizer
        self.worker = worker
        self.mode, self.prefix, self.wait_free, self.on_drop = mode, prefix, wait_free, on_drop
        self.pipeline = pipeline
        self.timeout = timeout
        self.backward_passes_per_step = backward_passes_per_step
        self._params = dict(named)
        self.groups = _groups_of(named, group_bytes)
        self._group_of = {n: i for i, g in enumerate(self.groups) for n in g}
        self._check_servers(getattr(worker, "servers", {}))
        self._stager = stager
        self.steps = 0
        self.pushed = self.applied = self.dropped = 0
        self.last_results: list[PushResult] = []
        self._first_push: float | None = None  # when this step's first group was queued
        self.last_overlap = 0.0
        self.hidden_seconds = self.comm_seconds = 0.0
        self._counts: dict[str, int] = {}
        self._ready: dict[int, int] = {}  # group -> parameters accumulated this step
        self._sent: dict[int, dict[str, tuple[int, int]]] = {}  # group -> its gradients at push time
        self._handles: dict[int, PushHandle | BaseException] = {}
        #: group -> its verdict and model, fetched as soon as the verdict came (``pipeline``)
        self._fetches: dict[int, Future[_Fetched]] = {}
        self._pullers: ThreadPoolExecutor | None = None
        self._fetched: dict[int, dict[str, Any] | BaseException] = {}
        self._done = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[int, dict[str, Any]] | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in named if p.requires_grad
        ]

    def _check_servers(self, servers: Mapping[str, Any]) -> None:
        """Refuse groups unlike the servers' models (a different ``group_bytes`` or model), naming them."""
        for g, names in enumerate(self.groups):
            known = servers.get(server_name(self.prefix, g))
            if known is not None and sorted(known["model"]) != sorted(names):
                raise ValueError(
                    f"group {g} holds {names} but server {server_name(self.prefix, g)!r} serves "
                    f"{sorted(known['model'])}: give the optimizer the servers' prefix and group_bytes"
                )

    # -- the wrapped optimizer's face -----------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's (GradScaler and LR logic read and change them)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``; a new step's backward starts.

        Raises
        ------
        RuntimeError
            Groups were pushed by the last backward but ``step()`` was not called (GradScaler
            skips the step on inf/NaN gradients; with ``wait_free=True`` the pushes were made).
        """
        if self._sent:
            sent = sorted(self._sent)
            self._collect()  # their verdicts are not lost
            raise RuntimeError(
                f"groups {sent} were pushed during backward but step() was not called (GradScaler "
                "skipping a step on inf/NaN?): use DistributedOptimizer(wait_free=False) with GradScaler"
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._reset_backward()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus mlfabric's step counter."""
        return {"optimizer": self.optimizer.state_dict(), "mlfabric": {"steps": self.steps}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave (the model itself comes from the servers: :meth:`pull`)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state.get("mlfabric", {}).get("steps", 0))

    # -- pushing --------------------------------------------------------------------------------

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(param: torch.Tensor) -> None:
            if not self.wait_free:
                return
            count = self._counts[name] = self._counts.get(name, 0) + 1
            if count != self.backward_passes_per_step:
                return
            g = self._group_of[name]
            ready = self._ready[g] = self._ready.get(g, 0) + 1
            if ready == len(self.groups[g]) and g not in self._sent:
                self._push_groups([g])

        return on_grad

    def _reset_backward(self) -> None:
        self._counts.clear()
        self._ready.clear()

    def _step_only(self, names: Sequence[str]) -> None:
        """The wrapped optimizer's step over ``names`` alone (the others' gradients hidden)."""
        wanted = {id(self._params[n]) for n in names}
        hidden = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in wanted and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _push_groups(self, groups: Sequence[int]) -> None:
        """Run the wrapped optimizer over ``groups`` and queue their deltas (before - after)."""
        names = [n for g in groups for n in self.groups[g]]
        if self._first_push is None:
            self._first_push = time.monotonic()
        with torch.no_grad():
            before = {n: self._params[n].detach().clone() for n in names}
            if len(groups) == len(self.groups):
                self.optimizer.step()
            else:
                self._step_only(names)
            for n in names:
                before[n].sub_(self._params[n].detach())
        stager = self._stager_for(before)
        for g in groups:
            grads = self._params_grads(self.groups[g])
            self._sent[g] = grads
            delta = {n: before[n] for n in self.groups[g]}
            staged = stager.to_host(delta) if stager is not None else None
            self._start_sender()
            self._queue.put((g, {"delta": delta, "staged": staged}))

    def _params_grads(self, names: Sequence[str]) -> dict[str, tuple[int, int]]:
        """Each gradient's identity and version counter (an in-place change bumps the counter)."""
        out = {}
        for n in names:
            grad = self._params[n].grad
            out[n] = (0, -1) if grad is None else (id(grad), int(grad._version))
        return out

    def _stager_for(self, tensors: Mapping[str, Any]) -> Stager | None:
        if self._stager is not None:
            return self._stager if has_device_tensors(tensors, self._stager.ops) else None
        return default_stager() if has_device_tensors(tensors) else None

    def _start_sender(self) -> None:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_loop, name="mlfabric-sender", daemon=True)
            self._sender.start()

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            g, work = item
            staged = work["staged"]
            outcome: PushHandle | BaseException
            try:
                update = staged.wait() if staged is not None else work["delta"]
                outcome = self.worker.push(server_name(self.prefix, g), update)
            except (MlfabricError, TypeError, ValueError, RuntimeError, OSError) as exc:  # step() raises it
                outcome = exc
            finally:
                if staged is not None:
                    staged.release()  # push() copied the bytes into its memfd
            with self._done:
                if self.pipeline and isinstance(outcome, PushHandle):
                    self._fetches[g] = self._pool().submit(self._fetch_after, g, outcome)
                self._handles[g] = outcome
                self._done.notify_all()

    def _pool(self) -> ThreadPoolExecutor:
        if self._pullers is None:
            workers = max(1, min(PULL_THREADS, len(self.groups)))
            self._pullers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mlfabric-pull")
        return self._pullers

    def _fetch_after(self, g: int, handle: PushHandle) -> _Fetched:
        """Group ``g``'s verdict, then its model: the round's (sync, applied) or the current one."""
        result = handle.wait(timeout=self.timeout)
        floor = result.version if self.mode == "sync" and result.status == APPLIED else None
        try:
            return result, self._fetch(g, floor)
        except (MlfabricError, OSError) as exc:  # raised by step() after the verdicts
            return result, exc

    def _fetch(self, g: int, floor: int | None) -> dict[str, Any]:
        """Group ``g``'s model from its server, as host tensors."""
        _, model = self.worker.get(
            server_name(self.prefix, g), min_version=floor, as_torch=True, timeout=self.timeout
        )
        return model

    # -- the step -------------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Push what backward did not, wait for this step's verdicts, load the servers' model.

        Returns
        -------
        The closure's loss, if a closure was given.

        Raises
        ------
        RuntimeError
            A gradient changed after its group was pushed (clipping or unscaling with
            ``wait_free=True``).
        MlfabricError
            A push failed (e.g. ``bad_tensor``), was DROPPED (code ``dropped``, unless
            ``on_drop="count"``) or its outcome is UNKNOWN (code ``unknown``); the servers'
            model is loaded first where it can be.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        called = time.monotonic()
        changed = [g for g, grads in self._sent.items() if self._params_grads(self.groups[g]) != grads]
        remaining = [g for g in range(len(self.groups)) if g not in self._sent]
        if remaining:
            self._push_groups(remaining)
        first = self._first_push if self._first_push is not None else called
        results = self._collect()
        span = time.monotonic() - first
        self.last_overlap = max(0.0, called - first) / span if span > 0 else 0.0
        self.hidden_seconds += max(0.0, called - first)
        self.comm_seconds += span
        if changed:
            self._pull(results)
            raise RuntimeError(
                f"the gradients of group {changed[0]} ({self.groups[changed[0]]}) changed after they were "
                "pushed (gradient clipping or GradScaler with wait_free=True): the servers applied the "
                "update of the gradients as backward left them; use DistributedOptimizer(wait_free=False)"
            )
        self.steps += 1
        self._pull(results)
        unknown = [r for r in results.values() if r.status not in (APPLIED, DROPPED)]
        if unknown:
            raise MlfabricError(
                f"push {unknown[0].update_id} outcome unknown: {unknown[0].reason}", code="unknown"
            )
        drops = [r for r in results.values() if r.status == DROPPED]
        if drops and self.on_drop == "raise":
            raise MlfabricError(
                f"{len(drops)} of {len(results)} pushes of step {self.steps} dropped: {drops[0].reason}",
                code="dropped",
            )
        return loss

    def _collect(self) -> dict[int, PushResult]:
        """The verdicts of this step's pushes, by group (raises the first push error)."""
        wanted = sorted(self._sent)
        with self._done:
            ok = self._done.wait_for(lambda: all(g in self._handles for g in wanted), timeout=self.timeout)
        if not ok:
            raise MlfabricError(f"pushes of groups {wanted} not handed to the daemon in {self.timeout} s")
        outcomes = {g: self._handles.pop(g) for g in wanted}
        fetches = {g: self._fetches.pop(g) for g in wanted if g in self._fetches}
        self._sent.clear()
        self._first_push = None
        self._reset_backward()
        self.pushed += sum(not isinstance(o, BaseException) for o in outcomes.values())
        errors = [o for o in outcomes.values() if isinstance(o, BaseException)]
        results = {}
        self._fetched = {}
        for g, o in outcomes.items():
            if isinstance(o, BaseException):
                continue
            if g in fetches:
                results[g], self._fetched[g] = fetches[g].result(timeout=2 * self.timeout + 10)
            else:
                results[g] = o.wait(timeout=self.timeout)
        self.applied += sum(r.status == APPLIED for r in results.values())
        self.dropped += sum(r.status == DROPPED for r in results.values())
        self.last_results = list(results.values())
        if errors:
            raise errors[0]
        return results

    def _pull(self, results: Mapping[int, PushResult]) -> None:
        """Load this step's models: those fetched after their verdicts, the others fetched now."""
        fetched, self._fetched = self._fetched, {}
        floors = {}
        if self.mode == "sync":  # the round's model: at least the version its verdict named
            floors = {g: r.version for g, r in results.items() if r.status == APPLIED}
        missing = [g for g in range(len(self.groups)) if g not in fetched]
        for g in missing:  # pipeline=False, or a group whose push failed
            fetched[g] = self._fetch(g, floors.get(g))
        self._load(fetched)

    def pull(self, min_versions: Mapping[int, int] | None = None) -> None:
        """Load the servers' model into the parameters (each group's current, or ``min_versions[g]`` on).

        The groups are fetched concurrently (``pipeline=True``) or one after another.
        """
        floors = dict(min_versions or {})
        groups = range(len(self.groups))
        if self.pipeline and len(self.groups) > 1:
            futures = {g: self._pool().submit(self._fetch, g, floors.get(g)) for g in groups}
            self._load({g: f.result(timeout=self.timeout + 10) for g, f in futures.items()})
        else:
            self._load({g: self._fetch(g, floors.get(g)) for g in groups})

    def _load(self, fetched: Mapping[int, dict[str, Any] | BaseException]) -> None:
        """Copy the fetched models into the parameters (raises the first fetch's error after the rest)."""
        errors = [m for m in fetched.values() if isinstance(m, BaseException)]
        for g in sorted(fetched):
            model = fetched[g]
            if isinstance(model, BaseException):
                continue
            names = self.groups[g]
            device = self._params[names[0]].device
            if device.type != "cpu":  # staged host -> device on the side stream
                model = (self._stager or default_stager()).to_device(model, device)
            with torch.no_grad():
                for n in names:
                    self._params[n].copy_(model[n])
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Remove the gradient hooks and stop the sender (the worker stays open)."""
        for h in self._hooks:
            h.remove()
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(timeout=30)
            self._sender = None
        if self._pullers is not None:
            self._pullers.shutdown(wait=True, cancel_futures=True)
            self._pullers = None
