"""Iteration models: how simulated workers compute and push (paper §2 and §7).

**Asynchronous SGD** (:class:`AsyncSGD`, the paper's main setting). Each worker loops:
receive the model, compute an update from it (its compute time, see
:class:`~mlfabric.scheduler.sim.workload.ComputeModel`), push it. With ``wait=True`` (the
default, as in the paper: workers fetch the model, then compute) a worker waits until its
push resolves (applied or dropped) and the current model has come back before it computes
again, so its next update's ``base_version`` is the server's version when the model left.
With ``wait=False`` a worker starts its next computation right after pushing, from the
newest model it has received so far (more updates in flight, larger delays).

**Synchronous SGD** (:class:`SyncSGD`, paper §7 "Synchronous SGD/PS"). Every iteration all
workers receive the model (:meth:`~mlfabric.scheduler.sim.engine.Simulator.broadcast_model`:
one copy each, or down a relay tree), compute and push; the server sums the updates (or aggregates)
and takes one step when the last one is in. The iteration's *makespan* runs from the
model leaving the server to the last update arriving.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from mlfabric.scheduler.sim.engine import Simulator, UpdateRecord
from mlfabric.scheduler.sim.workload import ComputeModel, ComputeSampler

__all__ = ["AsyncSGD", "SyncSGD"]


@dataclass
class AsyncSGD:
    """Asynchronous SGD workers (paper §2, Fig. 1).

    Parameters
    ----------
    compute : ComputeModel
        Compute time of every worker's iterations.
    iterations : int, optional
        Pushes per worker; ``None`` runs until the simulator's ``until``.
    wait : bool
        Wait for the push to resolve and the model to come back before computing again.

    Examples
    --------
    >>> it = AsyncSGD(ComputeModel({"w": 1.0}), iterations=3)
    >>> it.accumulates
    False
    """

    compute: ComputeModel
    iterations: int | None = None
    wait: bool = True
    accumulates: bool = field(default=False, init=False)
    _sampler: ComputeSampler | None = field(default=None, init=False, repr=False)
    _model: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _pushed: dict[str, int] = field(default_factory=dict, init=False, repr=False)

    def start(self, sim: Simulator) -> None:
        """Send every worker the initial model; each starts computing when it has it."""
        self._sampler = self.compute.sampler()
        self._model = {}
        self._pushed = dict.fromkeys(sim.workers, 0)
        for w in sim.workers:
            sim.send_model(w, partial(self._got_model, sim, w, first=True))

    def resolved(self, sim: Simulator, record: UpdateRecord) -> None:
        """The worker's push resolved: the current model goes back to it."""
        w = record.worker
        sim.send_model(w, lambda v: self._got_model(sim, w, v, first=False))

    def _got_model(self, sim: Simulator, worker: str, version: int, *, first: bool) -> None:
        self._model[worker] = max(version, self._model.get(worker, 0))
        if first or self.wait:
            self._compute(sim, worker)

    def _compute(self, sim: Simulator, worker: str) -> None:
        if self.iterations is not None and self._pushed[worker] >= self.iterations:
            return
        assert self._sampler is not None
        t = self._sampler.next(worker)
        sim.at(sim.now + t, lambda: self._computed(sim, worker))

    def _computed(self, sim: Simulator, worker: str) -> None:
        self._pushed[worker] += 1
        sim.push(worker, self._model[worker])
        if not self.wait:
            self._compute(sim, worker)


@dataclass
class SyncSGD:
    """Synchronous SGD workers (paper §7): one server step per iteration.

    Parameters
    ----------
    compute : ComputeModel
        Compute time of every worker's iterations.
    iterations : int, optional
        Iterations to run; ``None`` runs until the simulator's ``until``.

    Attributes
    ----------
    makespans : list of float
        Duration of each finished iteration (model out to last update in).

    Examples
    --------
    >>> SyncSGD(ComputeModel({"w": 1.0}), iterations=2).accumulates
    True
    """

    compute: ComputeModel
    iterations: int | None = None
    accumulates: bool = field(default=True, init=False)
    makespans: list[float] = field(default_factory=list, init=False)
    _sampler: ComputeSampler | None = field(default=None, init=False, repr=False)
    _began: float = field(default=0.0, init=False, repr=False)
    _outstanding: int = field(default=0, init=False, repr=False)

    def start(self, sim: Simulator) -> None:
        """Begin the first iteration."""
        self._sampler = self.compute.sampler()
        self.makespans = []
        self._begin(sim)

    def resolved(self, sim: Simulator, record: UpdateRecord) -> None:
        """One more update is in (or dropped); the last one ends the iteration."""
        self._outstanding -= 1
        if self._outstanding:
            return
        sim.step()
        self.makespans.append(sim.now - self._began)
        self._begin(sim)

    def _begin(self, sim: Simulator) -> None:
        if self.iterations is not None and len(self.makespans) >= self.iterations:
            return
        self._began = sim.now
        self._outstanding = len(sim.workers)
        sim.broadcast_model(sim.workers, partial(self._compute, sim))

    def _compute(self, sim: Simulator, worker: str, base: int) -> None:
        """``worker`` has the model of version ``base``: it computes its update from it."""
        assert self._sampler is not None
        t = self._sampler.next(worker)
        sim.at(sim.now + t, lambda: sim.push(worker, base))
