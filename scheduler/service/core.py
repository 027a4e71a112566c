"""The scheduler service: one grpc.aio server, one ``Session`` stream per daemon (DESIGN §3).

Message sequence on a daemon's ``Scheduler.Session`` stream (``control.proto``)::

    daemon                                   scheduler
    Hello{host, data_address}         ->
                                      <-     Welcome{policy}
        (or the stream is aborted: INVALID_ARGUMENT when the first message is not
         Hello or the host is not in the bandwidth graph; ALREADY_EXISTS when the
         host already has a connected daemon)
    RegisterRole{request_id, ROLE_SERVER, job, name, model, params, version}
                                      ->
                                      <-     RoleAck{request_id, ok, params, servers}
                                      <-     JobUpdate{job, servers}   (to every daemon
                                             with a worker of the job)
    RegisterRole{request_id, ROLE_WORKER, job, name}
                                      ->
                                      <-     RoleAck{ok, params, servers} — or
                                             ok=false, error naming the unknown job
    UpdateReady{update_id, job, server, worker, bytes, norm, base_version}
                                      ->     (batched: collected while others arrive
                                              within --batch-window-us, then the policy)
                                      <-     SendDirective{update_id, next_hop_host,
                                             next_hop_address, dst_host}  — or
                                      <-     DropDirective{update_id, reason}
                                             (also at once for an update naming an
                                              unknown job/server/worker)
    TransferReport{update_id, ok, start, end, bytes, outcome, delay, server_version}
                                      ->     (frees the transfers planned after it;
                                              feeds the bandwidth estimates; tracks
                                              the server's version; may trigger a new
                                              decision, see below)
    UpdateResolved{update_id, outcome, reason}
                                      ->     (the daemon resolved a push itself)
    UnregisterRole{job, role, name}   ->     (no reply; a server's pending updates
                                              are dropped, its workers get JobUpdate)

Directives about an update go to the daemon where the update is (its source).
When a stream ends, the daemon's roles are removed; its pending updates are dropped;
pending updates of other daemons bound for its servers are dropped with a
``DropDirective`` naming the server; transfers it sent or was receiving are forgotten;
daemons with workers of a job that lost a server get a ``JobUpdate``.

Clients should open their channel with :data:`CLIENT_CHANNEL_OPTIONS` (keepalive pings
every 10 s, allowed without calls) so idle streams survive middleboxes and a dead
scheduler is noticed; the server accepts pings that often.

Deciding, adopting and releasing go through
:class:`~mlfabric.scheduler.policies.runner.DecisionRunner`, the code path the simulator
runs too. With a bounded-horizon policy (``STFPolicy(horizon=N)`` plans only the first N
sends) the core also decides again, without a ready notification, when the runner's
:class:`~mlfabric.scheduler.policies.dispatch.ReplanTrigger` says so: the planned sends have
fallen to its low-water mark while unplanned pending updates remain.

Servicer methods only unpack messages, call :class:`~mlfabric.scheduler.service.state.SchedulerState`
and the runner, and build replies. The books of aggregates, replicas and all-reduce operations
are pure: they return :class:`~mlfabric.scheduler.service.effects.Effects`, which the core
executes in one place (:meth:`SchedulerCore._execute`). What the service observes is counted in
its state's :class:`~mlfabric.scheduler.service.observe.Recorder`; :meth:`SchedulerCore.stats`
is the snapshot ``/metrics`` reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.scheduler.core.estimation import Estimator, StaticEstimator
from mlfabric.scheduler.core.schedule import is_aggregate_id
from mlfabric.scheduler.policies.base import Decision, Policy, describe_decision
from mlfabric.scheduler.policies.dispatch import Dispatcher, Release, ReplanTrigger
from mlfabric.scheduler.policies.runner import DecisionRunner
from mlfabric.scheduler.service import wire
from mlfabric.scheduler.service.aggregates import DEFAULT_TIMEOUT, AggregateBook
from mlfabric.scheduler.service.allreduce import AllreduceBook
from mlfabric.scheduler.service.batching import AdaptiveBatcher
from mlfabric.scheduler.service.codec_advice import CodecBook
from mlfabric.scheduler.service.effects import Effects
from mlfabric.scheduler.service.model_routes import ModelRouteBook
from mlfabric.scheduler.service.observe import ServiceStats
from mlfabric.scheduler.service.records import (
    Cleanup,
    DuplicateUpdate,
    OutcomeKind,
    SchedulerError,
    TensorSpec,
    UnknownUpdate,
)
from mlfabric.scheduler.service.replicas import REREGISTER_GRACE, Replication
from mlfabric.scheduler.service.servicer import SERVER_OPTIONS, SchedulerServicer, start_server
from mlfabric.scheduler.service.state import SchedulerState
from mlfabric.wire.keepalive import CHANNEL_OPTIONS

__all__ = [
    "CLIENT_CHANNEL_OPTIONS",
    "SERVER_OPTIONS",
    "DaemonSession",
    "Estimator",
    "SchedulerCore",
    "SchedulerServicer",
    "StaticEstimator",
    "start_server",
]

log = logging.getLogger(__name__)

#: options for a daemon's channel to the scheduler (``grpc.insecure_channel(addr, options=...)``);
#: the one definition is :data:`mlfabric.wire.keepalive.CHANNEL_OPTIONS`, which daemons import
CLIENT_CHANNEL_OPTIONS: list[tuple[str, int]] = CHANNEL_OPTIONS


@dataclass(eq=False)
class DaemonSession:
    """One daemon's stream: its host and the queue of directives to write to it."""

    host: str
    queue: asyncio.Queue[pb.Directive | None] = field(default_factory=asyncio.Queue)

    def send(self, directive: pb.Directive) -> None:
        """Queue ``directive`` for this daemon."""
        self.queue.put_nowait(directive)

    def close(self) -> None:
        """End the stream after the directives already queued."""
        self.queue.put_nowait(None)


# ------------------------------------------------------------------------------ core


class SchedulerCore:
    """The service's logic on one asyncio loop: sessions, batching, deciding, releasing.

    Parameters
    ----------
    state : SchedulerState
        Graph, daemons, roles, pending and in-flight updates.
    policy : Policy
        Decides on every pending update after each batch (``fair``, ``stf``, ...).
    dispatcher : Dispatcher
        Releases the policy's sends as their predecessors (nearly) finish.
    batcher : AdaptiveBatcher
        Groups update-ready notifications.
    estimator : Estimator
        Fed with every successful transfer; its graph goes to the policy.
    replan : ReplanTrigger, optional
        When to decide again with no new ready notification (default: low-water 0, i.e.
        only when nothing is planned and some pending update has no send).
    clock : callable
        Monotonic seconds, the time base of pending/in-flight times and of the plan.
    aggregate_timeout : float
        Seconds an aggregator waits for an aggregate's members (:mod:`.aggregates`).
    replica_grace : float
        Seconds a replica whose daemon lost its session stays attached (:mod:`.replicas`);
        one registered again later is re-synced.
    pipelined_aggregates : bool
        The daemons forward aggregates while their members land (:class:`.aggregates.AggregateBook`).

    Examples
    --------
    Without gRPC: two daemons, a server, a worker and one update under ``fair``.

    >>> from mlfabric.scheduler.core.graph import star
    >>> from mlfabric.scheduler.policies.fair import FairPolicy
    >>> g = star(["ps", "a"], 8e9)
    >>> core = SchedulerCore(SchedulerState(g), FairPolicy(), dispatcher=Dispatcher(),
    ...                      batcher=AdaptiveBatcher(), estimator=StaticEstimator(g))
    >>> ps = core.hello(pb.Hello(host="ps", data_address="127.0.0.1:9000"))
    >>> a = core.hello(pb.Hello(host="a", data_address="127.0.0.1:9001"))
    >>> msg = pb.DaemonMessage
    >>> core.on_message(ps, msg(register_role=pb.RegisterRole(job="j", role=pb.ROLE_SERVER, name="ps")))
    >>> core.on_message(a, msg(register_role=pb.RegisterRole(job="j", role=pb.ROLE_WORKER, name="w")))
    >>> ready = pb.UpdateReady(update_id="a/1", job="j", server="ps", worker="w", bytes=8)
    >>> core.on_message(a, msg(update_ready=ready))
    >>> _ = core.decide()  # what the decision loop does once the batch closes
    >>> [a.queue.get_nowait().WhichOneof("kind") for _ in range(a.queue.qsize())]
    ['role_ack', 'send']
    >>> core.stats().transfers_released
    1
    """

    def __init__(
        self,
        state: SchedulerState,
        policy: Policy,
        *,
        dispatcher: Dispatcher,
        batcher: AdaptiveBatcher,
        estimator: Estimator,
        replan: ReplanTrigger | None = None,
        clock: Callable[[], float] = time.monotonic,
        aggregate_timeout: float = DEFAULT_TIMEOUT,
        replica_grace: float = REREGISTER_GRACE,
        pipelined_aggregates: bool = False,
    ) -> None:
        self.state = state
        #: the decision pipeline shared with the simulator: policy, dispatcher, trigger
        self.runner = DecisionRunner(policy, dispatcher=dispatcher, trigger=replan)
        #: aggregates executed by the daemons (stf+agg)
        self.aggregates = AggregateBook(
            state, self.runner, timeout=aggregate_timeout, pipelined=pipelined_aggregates
        )
        self.batcher = batcher
        self.estimator = estimator
        #: where the state, the core and the replicas' book count what they see (``stats()``)
        self.recorder = state.recorder
        self.clock = clock
        self.sessions: dict[str, DaemonSession] = {}
        self._wake = asyncio.Event()
        self._timer = math.inf  # when the release loop wakes by itself (its earliest deadline)
        self._looping = False  # run() is running (model routes refreshed by its release loop)
        #: replicas: their books, replica sends, promotion (docs/replication.md)
        self.replication = Replication(state, self.runner, replica_grace)
        #: all-reduce operations: readiness, tree plans, aborts (docs/allreduce.md)
        self.allreduce = AllreduceBook(lambda: self.estimator.estimated_graph(), state.address)
        #: where each worker host fetches each server's model: relays (docs/model-relays.md)
        self.model_routes = ModelRouteBook(state)
        #: the codec of each worker host's pushes to each server (``auto``, docs/compression.md)
        self.codecs = CodecBook(state, must_sum=policy.name in ("stf+agg", "stf+tree"))

    @property
    def policy(self) -> Policy:
        """The policy the runner decides with."""
        return self.runner.policy

    @property
    def dispatcher(self) -> Dispatcher:
        """The runner's dispatcher (the unreleased sends)."""
        return self.runner.dispatcher

    @property
    def replan(self) -> ReplanTrigger:
        """The runner's re-plan trigger."""
        return self.runner.trigger

    def stats(self) -> ServiceStats:
        """The service's counters and gauges now (call it on the loop: it copies them).

        What :class:`~mlfabric.scheduler.service.metrics.ServiceCollector` reports at a scrape.
        """
        snap = self.recorder.stats(self.state, self.estimator.estimated_graph())
        return replace(snap, allreduce_plans=dict(self.allreduce.plans))

    def replace_graph(self, graph: nx.DiGraph, make_estimator: Callable[[nx.DiGraph], Estimator]) -> None:
        """A reload (SIGHUP): make ``graph`` the bandwidth graph, estimated by ``make_estimator(graph)``.

        Sessions, roles, pending and in-flight updates stay (:meth:`SchedulerState.replace_graph`);
        the old estimates belong to the old links, the counters go on. Raises ``ValueError``,
        changing nothing, if ``graph`` lacks the host of a connected daemon.
        """
        self.state.replace_graph(graph)
        self.estimator = make_estimator(graph)
        self._execute(self.allreduce.replan(self.clock(), force=True))
        self._execute(self.model_routes.refresh())

    # -------------------------------------------------------------- sessions

    def hello(self, m: pb.Hello) -> DaemonSession:
        """Open the session of ``m.host``; raises :class:`SchedulerError` naming the problem."""
        self.state.connect(m.host, m.data_address, m.version)
        session = self.sessions[m.host] = DaemonSession(m.host)
        self.aggregates.hello(m.host, m.can_aggregate)
        log.info("daemon of host %s connected (data plane %s)", m.host, m.data_address)
        return session

    def goodbye(self, session: DaemonSession) -> None:
        """The stream of ``session`` ended: forget its daemon, tell the others what changed."""
        if self.sessions.get(session.host) is not session:
            return
        del self.sessions[session.host]
        # before its servers are forgotten: promote their replicas; its own replicas wait for it
        # (the cleanup wakes the release loop, which then also waits for their grace)
        self._execute(self.replication.host_lost(session.host, self.clock()))
        self._apply_cleanup(self.state.disconnect(session.host))
        self._execute(self.aggregates.host_lost(session.host, self.clock()))
        self._execute(self.allreduce.host_lost(session.host))
        self.codecs.forget(session.host)  # a new session gets its advice again
        self._routes_changed()  # a relay may be gone
        log.info("daemon of host %s disconnected", session.host)

    def welcome(self) -> pb.Directive:
        """The first directive of every session."""
        return pb.Directive(welcome=pb.Welcome(policy=self.policy.name))

    def on_message(self, session: DaemonSession, m: pb.DaemonMessage) -> None:
        """Handle one message of an open session."""
        kind = m.WhichOneof("kind")
        host = session.host
        if kind == "register_role":
            self._register_role(session, m.register_role)
        elif kind == "unregister_role":
            self._unregister_role(host, m.unregister_role)
        elif kind == "update_ready":
            self._update_ready(session, m.update_ready)
        elif kind == "transfer_report":
            self._transfer_report(host, m.transfer_report)
        elif kind == "update_resolved":
            r = m.update_resolved
            kind_ = wire.OUTCOMES.get(r.outcome, OutcomeKind.DROPPED)
            try:
                self.state.resolve(host, r.update_id, kind_, r.reason)
            except UnknownUpdate as exc:
                log.warning("host %s: %s", host, exc)
                return
            self.runner.forget([r.update_id])
            self.recorder.count(kind_)
            self._execute(self.aggregates.reconcile(self.clock()))
            self._moved()
        elif kind == "aggregate_failed":
            self._execute(self.aggregates.failed(host, m.aggregate_failed, self.clock()))
        elif kind == "allreduce_ready":
            self._execute(self.allreduce.ready(host, m.allreduce_ready, self.clock()))
        elif kind == "allreduce_done":
            self._execute(self.allreduce.done(host, m.allreduce_done))
        elif kind in ("server_applied", "replica_status"):
            self._execute(self.replication.on_message(kind, getattr(m, kind)))
        elif kind == "hello":
            log.warning("host %s: a second Hello on an open session is ignored", host)
        else:
            log.warning("host %s: empty DaemonMessage ignored", host)

    # ----------------------------------------------------------------- roles

    def _register_role(self, session: DaemonSession, m: pb.RegisterRole) -> None:
        ack = pb.RoleAck(request_id=m.request_id, ok=True)
        try:
            if m.role == pb.ROLE_SERVER:
                self.replication.check_server(session.host, m.job, m.name)
                model = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in m.model)
                job = self.state.register_server(
                    session.host, m.job, m.name, model, wire.job_params(m.params), m.version
                )
            elif m.role == pb.ROLE_WORKER:
                job = self.state.register_worker(session.host, m.job, m.name)
            elif m.role == pb.ROLE_REPLICA:
                self._execute(self.replication.register(session.host, m))
                job = self.state.jobs[m.job]
            else:
                name = pb.Role.Name(m.role) if m.role in pb.Role.values() else str(m.role)
                raise SchedulerError(f"role {name} is not supported by this scheduler")
        except SchedulerError as exc:
            session.send(wire.role_refused(m.request_id, exc))
            return
        ack.params.CopyFrom(wire.job_params_pb(job.params))
        ack.servers.extend(self.replication.server_infos(m.job))
        if m.role == pb.ROLE_WORKER:  # its codec advice before the ack: its first push may use it
            self._execute(self.codecs.refresh(self.estimator.estimated_graph(), [session.host]))
        session.send(pb.Directive(role_ack=ack))
        if m.role == pb.ROLE_SERVER:
            self._execute(self.replication.announce(m.job))  # its workers' daemons
        self._routes_changed()

    def _unregister_role(self, host: str, m: pb.UnregisterRole) -> None:
        try:
            if m.role == pb.ROLE_SERVER:
                reason = f"server process '{m.name}' of job '{m.job}' on host '{host}' went away"
                promoted = self.replication.server_lost(m.job, m.name, reason)
                if promoted is None:
                    self._apply_cleanup(self.state.unregister_server(host, m.job, m.name))
                else:
                    self._execute(promoted)
            elif m.role == pb.ROLE_REPLICA:
                self._execute(self.replication.replica_left(m.job, m.name))
            elif m.role == pb.ROLE_WORKER:
                self.state.unregister_worker(host, m.job, m.name)
        except SchedulerError as exc:
            log.warning("host %s: cannot unregister: %s", host, exc)
        self._routes_changed()

    def _routes_changed(self) -> None:
        """Roles or daemons changed: model routes and codec advice follow, coalesced while looping."""
        self._execute(self.codecs.refresh_due(self.clock(), self.estimator.estimated_graph))
        if not self._looping:  # driven by hand (no release loop): at once
            self._execute(self.model_routes.refresh())
        elif self.model_routes.changed(self.clock()) < self._timer:
            self._wake.set()

    def _apply_cleanup(self, cleanup: Cleanup) -> None:
        self.runner.forget(u.update_id for u, _ in cleanup.dropped)
        for u, reason in cleanup.dropped:
            self.recorder.count(OutcomeKind.DROPPED)
            self._send_to(u.src_host, wire.drop_directive(u.update_id, reason))
        for job in cleanup.jobs_changed:
            self._execute(self.replication.announce(job))
        self._execute(self.aggregates.reconcile(self.clock()))
        self._wake.set()
        self._moved()

    # --------------------------------------------------------------- updates

    def _update_ready(self, session: DaemonSession, m: pb.UpdateReady) -> None:
        if not m.worker and is_aggregate_id(m.update_id):  # an aggregator: all members in
            self._execute(self.aggregates.ready(session.host, m.update_id, tuple(m.members)))
            self.release()
            return
        self.recorder.updates_ready += 1
        log.debug(
            "host %s: update %s of worker %r ready (base version %d)",
            session.host,
            m.update_id,
            m.worker,
            m.base_version,
        )
        try:
            self.state.add_update(
                session.host,
                m.update_id,
                m.job,
                m.server,
                m.worker,
                m.bytes,
                m.norm,
                m.base_version,
                now=self.clock(),
                resent=m.resent,
                codec=m.codec,
            )
        except DuplicateUpdate as exc:
            log.warning("host %s: %s; ignored", session.host, exc)
            return
        except SchedulerError as exc:
            self.recorder.count(OutcomeKind.DROPPED)
            session.send(wire.drop_directive(m.update_id, str(exc), wire.error_code(exc)))
            return
        self.codecs.note_ready(session.host, m.job, m.server, m.cpu_load, self.clock())
        self.batcher.notify()

    def _transfer_report(self, host: str, m: pb.TransferReport) -> None:
        result = wire.transfer_result(host, m)
        now = self.clock()
        shared = self.state.sharing(result.update_id, now)
        book = self.aggregates
        if is_aggregate_id(m.update_id) or book.is_member_send(m.update_id):
            # a pipelined forward moves as its members land: its time measures them, not its path
            streamed = is_aggregate_id(m.update_id) and book.pipelined(m.update_id)
            if is_aggregate_id(m.update_id):
                effects = book.aggregate_report(m, host, now)
            else:
                effects = book.member_report(result, now)
            f = effects.closed
            if f is not None and result.end > result.start and not streamed:
                self._measured(f.path, result.bytes, result.end - result.start, now, shared)
            self._execute(effects)
            self.release()
            self._moved()
            return
        try:
            f = self.state.report(result)
        except UnknownUpdate as exc:
            log.debug("host %s: report ignored: %s", host, exc)
            return
        if result.ok and result.end > result.start:
            self._measured(f.path, result.bytes, result.end - result.start, now, shared)
        elif not result.ok:
            log.info("host %s: transfer of %s failed: %s", host, result.update_id, result.error)
        if result.outcome is not None:
            self.recorder.count(result.outcome)
        self.release()
        self._moved()

    def _measured(self, path: Sequence[str], nbytes: int, duration: float, now: float, shared: int) -> None:
        """The one place measurements reach the bandwidth estimator (``scheduler/core/estimation.py``)."""
        self.recorder.measured(path, nbytes, duration, now)
        self.estimator.observe(path, nbytes, duration, now, shared=shared)
        self._execute(self.allreduce.replan(now))  # kept process-group plans follow the estimates
        self._execute(self.codecs.refresh_due(now, self.estimator.estimated_graph))  # and codecs

    # ------------------------------------------------------- deciding/releasing

    def decide(self) -> Decision:
        """Run the policy on every pending update, execute its drops, adopt its plan."""
        pending = list(self.state.pending.values())
        now = self.clock()
        snapshot = self.state.snapshot(now, self.estimator.estimated_graph())
        gathering = self.aggregates.gathering(now)
        snapshot = replace(
            snapshot, aggregators=self.aggregates.eligible(), in_flight=(*snapshot.in_flight, *gathering)
        )
        t0 = time.perf_counter()
        decision = self.runner.decide(snapshot, pending)
        seconds = time.perf_counter() - t0
        self.recorder.decision_seconds.observe(seconds)
        log.debug("decided %d pending in %.2f ms, %d sends", len(pending), seconds * 1e3, len(decision.sends))
        if snapshot.rounds and log.isEnabledFor(logging.DEBUG):  # a synchronous round's plan
            for line in describe_decision(decision, snapshot.now):
                log.debug("  %s", line)
        for d in decision.drops:
            src = self.state.source_host(d.update_id)
            self.state.drop(d.update_id, d.reason)
            self.recorder.count(OutcomeKind.DROPPED)
            self._send_to(src, wire.drop_directive(d.update_id, d.reason))
        self._execute(self.aggregates.reconcile(now))
        self._execute(self.replication.decide(snapshot, pending))
        self.release()
        return decision

    def release(self) -> list[Release]:
        """Send every planned transfer whose predecessors are (nearly) done.

        Sends to an aggregator and the runner's released aggregates go through the
        :class:`~mlfabric.scheduler.service.aggregates.AggregateBook`.
        """
        now = self.clock()
        out = self.runner.release(now, self.state.in_flight)
        for agg in out.aggregates:
            self._execute(self.aggregates.forward(agg, now))
        released = list(out.sends)
        for r in released:
            s = r.send
            planned = self.runner.aggregate_of(s.update_id)
            if planned is not None and s.next_hop == planned.aggregator:
                self.recorder.transfers_released += 1
                self._execute(self.aggregates.send_member(r, planned, now))
                continue
            src = self.state.source_host(s.update_id)
            dst = self.state.pending[s.update_id].dst_host
            try:
                address = self.state.address(s.next_hop)
            except SchedulerError as exc:
                self.state.drop(s.update_id, str(exc))
                self.recorder.count(OutcomeKind.DROPPED)
                self._send_to(src, wire.drop_directive(s.update_id, str(exc), wire.error_code(exc)))
                continue
            self.state.release(s.update_id, s.path, r.started_at, r.expected_end)
            self.recorder.transfers_released += 1
            directive = pb.SendDirective(
                update_id=s.update_id, next_hop_host=s.next_hop, next_hop_address=address, dst_host=dst
            )
            self._send_to(src, pb.Directive(send=directive))
        if out or (
            self.runner.wakeup_changed()
            and (self.runner.next_wakeup(self.state.in_flight) or math.inf) < self._timer
        ):
            self._wake.set()  # the release loop's timer is set for later than what may go now
        if out:
            self._moved()
        return released

    def _execute(self, effects: Effects) -> None:
        """Carry out what a book asks: its directives (in order), its outcomes counted, a decision."""
        for host, directive in effects.directives:
            self._send_to(host, directive)
        for kind in effects.resolved:
            self.recorder.count(kind)
        if effects.requeued:
            self.batcher.notify()
        if effects.replan:
            self.batcher.request()

    def _moved(self) -> None:
        """Something left the plan or the network: ask for a decision if the plan runs low."""
        if self.runner.moved(len(self.state.pending)):
            self.batcher.request()

    def _send_to(self, host: str, directive: pb.Directive) -> None:
        session = self.sessions.get(host)
        if session is None:
            log.debug("no session for host %s; directive dropped", host)
            return
        session.send(directive)

    async def run(self) -> None:
        """Run the decision loop (per batch) and the release timer until cancelled."""
        self._looping = True
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._decide_loop())
                tg.create_task(self._release_loop())
        finally:
            self._looping = False

    async def _decide_loop(self) -> None:
        while True:
            await self.batcher.next_batch()
            self.decide()

    async def _release_loop(self) -> None:
        while True:
            wakes = [
                w
                for w in (
                    self.runner.next_wakeup(self.state.in_flight),
                    self.aggregates.next_deadline(),
                    self.state.stall_deadline(),
                    self.replication.next_deadline(),
                    self.model_routes.due_at(),
                )
                if w
            ]
            wake = min(wakes, default=None)
            self._timer = math.inf if wake is None else wake
            timeout = None if wake is None or math.isinf(wake) else max(0.0, wake - self.clock())
            # asyncio.timeout, not wait_for: on 3.11 wait_for with a timeout swallows a cancel
            # that arrives as the event is set, and the loop then never ends
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            self._execute(self.aggregates.expire(self.clock()))
            self._execute(self.replication.expire(self.clock()))
            self._execute(self.model_routes.refresh_due(self.clock()))
            self.expire_stalled()
            self.release()

    def expire_stalled(self) -> None:
        """Forget transfers in flight with no report past their deadline: their bottleneck is free.

        An aggregate's transfers (members to their aggregator, the aggregate to its server) first,
        through the aggregate book: their members resolve once, through the aggregate's verdicts.
        """
        self._execute(self.aggregates.expire_stalled(self.clock()))
        for f in self.state.expire_stalled(self.clock()):
            log.warning("%s", self.state.outcomes[f.update_id].reason)
            self.recorder.count(OutcomeKind.DROPPED)
            self._moved()
