"""The discrete-event loop: one scheduler, one server, many workers, a fluid network.

:class:`Simulator` plays every role around a policy, with the same rules as the real
system (DESIGN §3):

* **the scheduler service**: ready updates are batched by the service's adaptive
  batching rule (:class:`~mlfabric.scheduler.policies.dispatch.BatchWindow`), then the
  service's :class:`~mlfabric.scheduler.policies.runner.DecisionRunner` decides on *every*
  update not yet released, adopts the decision and releases each send when the transfers
  in its ``after`` are done; drops resolve the push as DROPPED. A later decision replaces
  the plan of every update still pending. As in the service, the runner's re-plan trigger
  asks for a decision without a new ready update when a bounded-horizon plan runs low;
* **the network**: released transfers start at once and share links max-min fairly
  (:class:`~mlfabric.scheduler.sim.fluid.FluidNetwork`); link capacities follow a
  schedule of :class:`~mlfabric.scheduler.sim.workload.BandwidthChange`; a payload
  arrives one path latency after its last byte leaves the bottleneck;
* **aggregator hops** (paper Fig. 6): a send whose next hop is not the server carries
  its update to the aggregator named by one of the decision's ``aggregates``; once all
  members are in (and its ``after`` are done), the runner releases the aggregate (one
  update's size) and it goes on to the server; a pipelined one (``chunk_bytes``) once all
  have started arriving, as they arrive (:mod:`~mlfabric.scheduler.sim.pipelines`);
* **the server**: applies payloads in arrival order; the model version goes up by one
  per applied update or aggregate (or once per iteration, for synchronous SGD); an
  update whose delay (version at apply - base version) exceeds ``tau_max`` is dropped
  at the server (the safety net) — policies should have dropped it before.

The workers' behaviour (when they compute and push) is an
:class:`~mlfabric.scheduler.sim.iteration.IterationModel`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol

import networkx as nx

from mlfabric.scheduler.core.graph import PathCache
from mlfabric.scheduler.core.schedule import Aggregate
from mlfabric.scheduler.policies.base import (
    InFlight,
    PendingUpdate,
    PlannedAggregate,
    Policy,
    RoundSpec,
    Send,
    Snapshot,
)
from mlfabric.scheduler.policies.dispatch import BatchWindow, Dispatcher, ReplanTrigger
from mlfabric.scheduler.policies.runner import DecisionError, DecisionRunner
from mlfabric.scheduler.sim.broadcast import TreeBroadcast
from mlfabric.scheduler.sim.fluid import FluidNetwork
from mlfabric.scheduler.sim.pipelines import Pipelines
from mlfabric.scheduler.sim.tracing import FlowRecord
from mlfabric.scheduler.sim.workload import BandwidthChange

__all__ = ["IterationModel", "SimulationError", "Simulator", "UpdateRecord"]

APPLIED = "applied"
DROPPED = "dropped"


class SimulationError(RuntimeError):
    """A policy's decision cannot be executed (unknown update, path or aggregator)."""


@dataclass
class UpdateRecord:
    """What happened to one update (for the report)."""

    update_id: str
    worker: str
    base_version: int
    ready_at: float
    released_at: float = math.nan
    arrived_at: float = math.nan
    delay: int = -1
    outcome: str = ""  # "" while unresolved, then APPLIED or DROPPED
    reason: str = ""

    @property
    def completion_time(self) -> float:
        """Ready to arrival at the server (NaN unless it arrived)."""
        return self.arrived_at - self.ready_at


class IterationModel(Protocol):
    """How workers compute and push (see :mod:`mlfabric.scheduler.sim.iteration`)."""

    #: True if the server applies one step per iteration (synchronous SGD)
    accumulates: bool

    def start(self, sim: Simulator) -> None:
        """Schedule the first computations."""
        ...

    def resolved(self, sim: Simulator, record: UpdateRecord) -> None:
        """``record``'s push resolved (applied or dropped)."""
        ...


class Simulator:
    """Discrete-event fluid simulation of one job under one policy (DESIGN §6).

    Parameters
    ----------
    graph : networkx.DiGraph
        The bandwidth graph (capacities in bytes/s).
    policy : Policy
        The scheduling policy, the same object the service would run
        (:func:`~mlfabric.scheduler.policies.registry.make_policy`).
    iteration : IterationModel
        Asynchronous or synchronous SGD workers.
    server_host : str
        Host of the parameter server.
    workers : sequence of str
        Worker hosts (a worker's name is its host).
    update_bytes : float
        Size of one update (and of one aggregate).
    model_bytes : float
        Size of the model sent back to a worker after each push resolves; 0 means the
        model returns instantly (the model transfer is not simulated).
    model_broadcast : {"direct", "tree"}
        How :meth:`broadcast_model` (synchronous rounds) sends the model: ``"direct"``, one copy
        per worker from the server; ``"tree"``, down a relay tree planned from the graph, in
        pipelined chunks (:mod:`mlfabric.scheduler.sim.broadcast`).
    tau_max : int
        Delay bound (< 0: unbounded).
    batch_window, batch_max_wait : float
        Adaptive batching (:class:`~mlfabric.scheduler.policies.dispatch.BatchWindow`): a batch of
        ready updates closes ``batch_window`` s after the latest arrival, at most
        ``batch_max_wait`` s after the first. 0 and 0: updates ready at the same instant.
    dispatch_margin : float
        The dispatcher's margin (:class:`~mlfabric.scheduler.policies.dispatch.Dispatcher`): a send
        may go this long before its predecessors' expected end. 0 (the default) releases
        exactly when they are done: the fluid network has no control latency to hide.
    replan : ReplanTrigger, optional
        When to decide again without a new ready update (the policy's trigger from
        :func:`~mlfabric.scheduler.policies.registry.make_policy`; default: low-water 0).
        Each run starts from a fresh trigger with its low-water mark.
    changes : iterable of BandwidthChange
        Link capacity changes over time.
    until : float
        Stop at this simulated time.
    record_flows : bool
        Keep a :class:`FlowRecord` of every transfer (traces, schedule checks).
    progress : callable, optional
        Called as ``progress(sim_time, events)`` every ``progress_every`` events.
    clock : callable, optional
        A clock (e.g. ``time.perf_counter``) to time the policy's decisions with
        (:attr:`decide_s`, how much of a run the policy takes).
    job, server : str
        Names of the job and of the server.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> from mlfabric.scheduler.sim.iteration import AsyncSGD
    >>> from mlfabric.scheduler.sim.workload import ComputeModel
    >>> g = star(["ps", "w0", "w1"], 8e6)  # 1 MB/s NICs
    >>> it = AsyncSGD(ComputeModel({"w0": 0.0, "w1": 0.0}), iterations=1)
    >>> sim = Simulator(g, FairPolicy(), it, server_host="ps", workers=["w0", "w1"], update_bytes=1e6)
    >>> [round(r.arrived_at, 6) for r in sim.run()]
    [2.0, 2.0]
    """

    def __init__(
        self,
        graph: nx.DiGraph,
        policy: Policy,
        iteration: IterationModel,
        *,
        server_host: str,
        workers: Sequence[str],
        update_bytes: float,
        model_bytes: float = 0.0,
        model_broadcast: str = "direct",
        tau_max: int = -1,
        batch_window: float = 0.0,
        batch_max_wait: float = 0.0,
        dispatch_margin: float = 0.0,
        replan: ReplanTrigger | None = None,
        changes: Iterable[BandwidthChange] = (),
        until: float = math.inf,
        record_flows: bool = False,
        progress: Callable[[float, int], None] | None = None,
        progress_every: int = 64,
        clock: Callable[[], float] | None = None,
        job: str = "job",
        server: str = "ps",
    ) -> None:
        self.graph = graph
        self.policy = policy
        self.iteration = iteration
        self.server_host = server_host
        self.workers = tuple(workers)
        self.update_bytes = float(update_bytes)
        self.model_bytes = float(model_bytes)
        if model_broadcast not in ("direct", "tree"):
            raise ValueError(f"model_broadcast must be 'direct' or 'tree', got {model_broadcast!r}")
        self.model_broadcast = model_broadcast
        self._tree_broadcast = TreeBroadcast(server_host, self.model_bytes)
        self.tau_max = tau_max
        self.batch_window = batch_window
        self.batch_max_wait = max(batch_max_wait, batch_window)
        self.dispatch_margin = dispatch_margin
        self.low_water = 0 if replan is None else replan.low_water
        self.changes = sorted(changes, key=lambda c: c.at)
        self.until = until
        self.record_flows = record_flows
        self.progress = progress
        self.clock = clock
        #: seconds of ``clock`` spent in the policy's decisions (NaN without a clock)
        self.decide_s = 0.0 if clock is not None else math.nan
        self.progress_every = progress_every
        self.job = job
        self.server = server
        self.version = 0
        self.records: list[UpdateRecord] = []
        self.flows: list[FlowRecord] = []
        self.aggregates: list[Aggregate] = []
        self.events = 0
        self._reset()  # the run state; run() starts from a fresh one

    # -- API for iteration models ----------------------------------------------------
    @property
    def now(self) -> float:
        """Current simulated time (s)."""
        return self._now

    def at(self, t: float, action: Callable[[], object]) -> None:
        """Run ``action`` at simulated time ``t`` (>= now); what it returns is ignored."""
        self._schedule(t, 0, action)

    def push(self, worker: str, base_version: int) -> UpdateRecord:
        """``worker``'s update computed from ``base_version`` is ready now.

        Returns
        -------
        UpdateRecord
            Filled in as the update moves and resolves.
        """
        # ids sort in push order: policies breaking ties by id then serve equals first-come
        uid = f"u{len(self.records):07d}-{worker}"
        rec = UpdateRecord(uid, worker, base_version, self._now)
        self.records.append(rec)
        self._rec[uid] = rec
        self._pending[uid] = PendingUpdate(
            update_id=uid,
            job=self.job,
            server=self.server,
            worker=worker,
            src_host=worker,
            dst_host=self.server_host,
            bytes=int(self.update_bytes),
            norm=1.0,
            base_version=base_version,
            ready_at=self._now,
        )
        self._ready()
        return rec

    def send_model(self, worker: str, then: Callable[[int], None]) -> None:
        """Send the current model to ``worker``; call ``then(version)`` when it is there."""
        version = self.version
        if self.model_bytes <= 0 or worker == self.server_host:
            then(version)
            return
        self._model_seq += 1
        fid = f"model:{worker}#{self._model_seq}"
        self._start_flow(fid, "model", self._path(self.server_host, worker), self.model_bytes)
        self._model_cb[fid] = lambda: then(version)

    def broadcast_model(self, workers: Sequence[str], then: Callable[[str, int], None]) -> None:
        """Send the current model to every one of ``workers``; ``then(worker, version)`` as each has it.

        ``model_broadcast="direct"``: :meth:`send_model` to each. ``"tree"``: down the relay tree
        :func:`~mlfabric.scheduler.policies.broadcast.plan_broadcast` plans on the current
        capacities, chunks as flows (:mod:`mlfabric.scheduler.sim.broadcast`). Either way every
        worker gets the version current at this call, once.
        """
        if self.model_broadcast == "direct":
            for w in workers:
                self.send_model(w, partial(then, w))
            return
        version = self.version
        far = [w for w in workers if w != self.server_host]
        for w in workers:
            if self.model_bytes <= 0 or w == self.server_host:
                then(w, version)
        if self.model_bytes <= 0 or not far:
            return

        def start(name: str, path: tuple[str, ...], nbytes: float, arrived: Callable[[], None]) -> None:
            self._model_seq += 1
            fid = f"model:{name}#{self._model_seq}"
            self._start_flow(fid, "model", path, nbytes)
            self._model_cb[fid] = arrived

        graph = self._policy_graph
        self._tree_broadcast.send(graph, far, start, lambda w: then(w, version), paths=self._paths)

    def step(self) -> None:
        """Advance the model version by one (synchronous SGD: one step per iteration)."""
        self.version += 1

    # -- the run ---------------------------------------------------------------------
    def run(self) -> list[UpdateRecord]:
        """Simulate until nothing is left to do or ``until``; returns every update's record."""
        self._reset()
        for change in self.changes:
            self._schedule(change.at, 0, partial(self._change, change))
        self.iteration.start(self)
        net, heap = self._net, self._heap
        while True:
            self._pipes.refresh()  # pipelined aggregates' caps from their members' rates
            t_net = net.next_completion()
            t_ev = heap[0][0] if heap else math.inf
            t = min(t_net, t_ev)
            if t == math.inf:
                break
            if t > self.until:
                self._now = self.until
                break
            self._now = t
            done = net.advance_to(t)
            moved = [self._flow_done(fid) for fid in done]
            if done:
                self._release()
            if any(moved):
                self._moved()
            if heap and heap[0][0] <= t:
                _, _, _, action = heapq.heappop(heap)
                action()
            self.events += 1
            if self.progress is not None and self.events % self.progress_every == 0:
                self.progress(t, self.events)
        return self.records

    @property
    def decisions(self) -> int:
        """Decisions made in the run (policy calls)."""
        return self.runner.decisions

    @property
    def unresolved(self) -> int:
        """Updates pushed but neither applied nor dropped when the run stopped."""
        return sum(1 for r in self.records if not r.outcome)

    # -- internals: state ------------------------------------------------------------
    def _reset(self) -> None:
        capacity = {(u, v): c for u, v, c in self.graph.edges(data="capacity")}
        self._now = 0.0
        on_rate = self._log_rate if self.record_flows else None
        self._net: FluidNetwork[tuple[str, str], str] = FluidNetwork(capacity, on_rate=on_rate)
        self._pipes: Pipelines = Pipelines(self._net, on_rate)
        self._heap: list[tuple[float, int, int, Callable[[], object]]] = []
        self._seq = 0
        self._policy_graph = self.graph
        self._graph_version = 0  # changed with each capacity change of the policy's graph
        self._pending: dict[str, PendingUpdate] = {}
        #: the service's decision pipeline: policy, dispatcher, re-plan trigger
        self.runner = DecisionRunner(
            self.policy, dispatcher=Dispatcher(self.dispatch_margin), trigger=ReplanTrigger(self.low_water)
        )
        self._batch = BatchWindow(self.batch_window, self.batch_max_wait)
        self._requested = False
        self._inflight: dict[str, tuple[str, tuple[str, ...], float, float]] = {}  # kind, path, bytes, t0
        self._moving: dict[str, InFlight] = {}  # update and aggregate transfers, expected_end = inf
        self._seen: dict[str, InFlight] = {}  # those of _moving as the last snapshot gave them
        self._rate_log: dict[str, list[tuple[float, float]]] = {}
        self._made: dict[str, PlannedAggregate] = {}  # aggregates forwarded, by id
        self._to_aggregator: set[str] = set()  # updates released to an aggregator
        self._model_cb: dict[str, Callable[[], None]] = {}
        self._model_seq = 0
        self._rec: dict[str, UpdateRecord] = {}
        self._paths = PathCache(self.graph)
        self._decide_scheduled = False
        self._wake_at: float | None = None  # a release scheduled by the runner's next wake-up
        # synchronous SGD: every round takes one update of each worker (the service's sync_workers)
        members = {w: w for w in self.workers}
        self._rounds = {(self.job, self.server): RoundSpec(members)} if self.iteration.accumulates else {}
        self.version = 0
        self.records = []
        self.flows = []
        self.aggregates = []
        self.events = 0
        self.decide_s = 0.0 if self.clock is not None else math.nan

    def _schedule(self, t: float, prio: int, action: Callable[[], object]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self._now), prio, self._seq, action))

    def _path(self, src: str, dst: str) -> tuple[str, ...]:
        return self._paths.path(src, dst)

    def _change(self, change: BandwidthChange) -> None:
        self._net.set_capacity(change.link, change.capacity)
        if self._policy_graph is self.graph:
            self._policy_graph = self.graph.copy()
        self._policy_graph.edges[change.link]["capacity"] = change.capacity
        self._graph_version += 1

    # -- internals: the scheduler service --------------------------------------------
    def _snapshot(self) -> Snapshot:
        ends = self._net.expected_ends(list(self._moving)).tolist()
        seen = self._seen  # the last snapshot's view of each transfer: kept while its end is the same
        in_flight = []
        for (fid, f), end in zip(self._moving.items(), ends, strict=True):
            got = seen.get(fid)
            if got is None or got.expected_end != end:
                got = seen[fid] = InFlight(f.update_id, f.job, f.server, f.path, f.bytes, f.started_at, end)
            in_flight.append(got)
        return Snapshot(
            now=self._now,
            graph=self._policy_graph,
            in_flight=tuple(in_flight),
            server_versions={(self.job, self.server): self.version},
            tau_max={self.job: self.tau_max},
            rounds=self._rounds,
            graph_version=self._graph_version,
        )

    def _ready(self) -> None:
        """An update became ready: open or extend the batch (adaptive batching)."""
        self._batch.arrive(self._now)
        if not self._decide_scheduled:
            self._decide_scheduled = True
            self._schedule(self._batch.deadline() or self._now, 1, self._decide)

    def _moved(self) -> None:
        """Something left the plan or the network: ask for a decision if the plan runs low."""
        if self.runner.moved(len(self._pending)):
            self._requested = True  # an open batch's decision serves the request
            if not self._decide_scheduled:
                self._decide_scheduled = True
                self._schedule(self._now, 1, self._decide)

    def _decide(self) -> None:
        self._decide_scheduled = False
        deadline = self._batch.deadline()
        if deadline is not None and self._now < deadline:
            self._decide_scheduled = True
            self._schedule(deadline, 1, self._decide)
            return
        if deadline is None and not self._requested:
            return
        self._requested = False
        self._batch.close()
        snapshot = self._snapshot()
        t0 = self.clock() if self.clock is not None else 0.0
        try:
            decision = self.runner.decide(snapshot, list(self._pending.values()))
        except DecisionError as exc:
            raise SimulationError(str(exc)) from exc
        if self.clock is not None:
            self.decide_s += self.clock() - t0
        for drop in decision.drops:
            if self._pending.pop(drop.update_id, None) is not None:
                self._resolve(drop.update_id, DROPPED, f"policy: {drop.reason}")
        self._release()

    def _release(self) -> None:
        """Start every aggregate and send the runner releases now (the service's rule)."""
        if self.dispatch_margin > 0:
            net = self._net
            moving: Mapping[str, InFlight] = {
                fid: replace(f, expected_end=net.expected_end(fid)) for fid, f in self._moving.items()
            }
        else:
            moving = self._moving  # expected_end = inf: released only when really done
        released = self.runner.release(self._now, moving)
        for agg in released.aggregates:
            self._forward(agg)
        for r in released.sends:
            self._start_update(r.send)
        wake = self.runner.next_wakeup(moving)  # a send's predecessors nearly done, a hold's end
        if wake is not None and wake > self._now and wake != self._wake_at:
            self._wake_at = wake
            self._schedule(wake, 1, self._release)
        if released:
            self._moved()

    def _forward(self, agg: PlannedAggregate) -> None:
        """Send the aggregate ``agg`` on from its aggregator (all its members are in)."""
        nbytes = float(agg.bytes) if agg.bytes else self.update_bytes
        agg = replace(agg, bytes=nbytes, dst=agg.dst or self.server_host)
        self._made[agg.aggregate_id] = agg
        self.aggregates.append(Aggregate(agg.aggregate_id, agg.aggregator, agg.members, nbytes, agg.dst))
        path = agg.path or self._path(agg.aggregator, agg.dst)
        self._towards(agg.aggregate_id)  # summed into another aggregate?
        self._start_flow(agg.aggregate_id, "aggregate", path, nbytes, agg)

    def _towards(self, pid: str) -> None:
        """Payload ``pid`` leaves now; into a pipelined aggregate, it counts in once it starts."""
        of = self.runner.aggregate_of(pid)
        if of is not None:
            self._to_aggregator.add(pid)
            if of.chunk_bytes:
                self.runner.arrived(pid)
                self._schedule(self._now, 0, self._release)

    def _start_update(self, send: Send) -> None:
        uid = send.update_id
        update = self._pending.pop(uid)
        path = tuple(send.path) or self._path(update.src_host, send.next_hop)
        if path[0] != update.src_host or path[-1] != send.next_hop:
            raise SimulationError(
                f"send of '{uid}': path {path} does not run {update.src_host}->{send.next_hop}"
            )
        self._towards(uid)
        if uid not in self._to_aggregator and send.next_hop != update.dst_host:
            raise SimulationError(
                f"send of '{uid}' goes to '{send.next_hop}', which aggregates nothing for it"
            )
        self._rec[uid].released_at = self._now
        self._start_flow(uid, "update", path, float(update.bytes))

    def _start_flow(
        self, fid: str, kind: str, path: tuple[str, ...], nbytes: float, agg: PlannedAggregate | None = None
    ) -> None:
        links = list(itertools.pairwise(path))
        for link in links:
            if not self.graph.has_edge(*link):
                raise SimulationError(f"transfer '{fid}': link {link} is not in the bandwidth graph")
        self._inflight[fid] = (kind, path, nbytes, self._now)
        if kind != "model":
            self._moving[fid] = InFlight(fid, self.job, self.server, path, int(nbytes), self._now, math.inf)
        if agg is not None and agg.chunk_bytes:
            self._pipes.start(fid, agg.members, links, nbytes, agg.chunk_bytes)
        else:
            self._net.add(fid, links, nbytes)
        if self.record_flows:
            self._rate_log[fid] = []

    def _log_rate(self, fid: object, t: float, rate: float) -> None:
        log = self._rate_log.get(str(fid))
        if log is not None:
            log.append((t, rate))

    # -- internals: the network and the server ---------------------------------------
    def _flow_done(self, fid: str) -> bool:
        """Transfer ``fid`` left its last link; True if it was an update or an aggregate."""
        if self._pipes and self._pipes.ended(fid):  # a pipelined aggregate's body: its tail waits
            return False
        kind, path, nbytes, t0 = self._inflight.pop(fid)
        if self.record_flows:
            self.flows.append(
                FlowRecord(fid, kind, path, nbytes, t0, self._now, tuple(self._rate_log.pop(fid)))
            )
        latency = sum(self.graph.edges[link].get("latency", 0.0) for link in itertools.pairwise(path))
        if kind == "model":
            cb = self._model_cb.pop(fid)
            self._schedule(self._now + latency, 0, cb)
            return False
        if fid in self._to_aggregator:
            self._to_aggregator.discard(fid)
            self._schedule(self._now + latency, 0, lambda: self._at_aggregator(fid))
        else:
            self._schedule(self._now + latency, 0, lambda: self._arrive(fid))
        self._moving.pop(fid, None)
        self._seen.pop(fid, None)
        return True

    def _at_aggregator(self, fid: str) -> None:
        self.runner.arrived(fid)
        self._release()

    def _updates_in(self, payload: str) -> list[str]:
        agg = self._made.get(payload)
        if agg is None:
            return [payload]
        return [u for m in agg.members for u in self._updates_in(m)]

    def _arrive(self, payload: str) -> None:
        """A payload reached the server: apply it (one step) or drop it (safety net)."""
        uids = self._updates_in(payload)
        delays = {u: self.version - self._rec[u].base_version for u in uids}
        if not self.iteration.accumulates and 0 <= self.tau_max < max(delays.values()):
            for u in uids:
                self._rec[u].arrived_at = self._now
                self._resolve(u, DROPPED, f"server: delay {delays[u]} > tau_max {self.tau_max}")
            return
        if not self.iteration.accumulates:
            self.version += 1
        for u in uids:
            self._rec[u].arrived_at = self._now
            self._rec[u].delay = delays[u]
            self._resolve(u, APPLIED, "")

    def _resolve(self, uid: str, outcome: str, reason: str) -> None:
        rec = self._rec[uid]
        rec.outcome, rec.reason = outcome, reason
        self.iteration.resolved(self, rec)
