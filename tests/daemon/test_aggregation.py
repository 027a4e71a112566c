"""Aggregation executed by daemons, driven by a hand-written control sequence (paper §5, Fig. 6).

In-process daemons ``ps`` (server ps0), ``w0``/``w1``/``w2`` (one worker each) and ``agg``
(the aggregator hop); the in-test scheduler holds every update, and each test sends the
directives the real scheduler would: AggregateDirective, SendDirective (with aggregate_id),
SendDirective of the aggregate, ResolveDirective. Updates are integer-valued float64, so the
model's arithmetic is exact: it must move by exactly the applied members.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.proto.v1 import control_pb2
from tests.daemon.conftest import FakeScheduler

MODEL = {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.zeros(4, dtype=np.float64)}
APPLIED, DROPPED = control_pb2.OUTCOME_APPLIED, control_pb2.OUTCOME_DROPPED


class AggScheduler(FakeScheduler):
    """The fake scheduler, also recording hellos and AggregateFailed messages."""

    def __init__(self) -> None:
        super().__init__()
        self.hellos: list[Any] = []
        self.failed: list[Any] = []

    def Session(self, request_iterator: Iterator[Any], context: Any) -> Iterator[Any]:
        it = iter(request_iterator)
        first = next(it)
        with self.lock:
            self.hellos.append(first.hello)
        yield from super().Session(itertools.chain([first], it), context)

    def _on_message(self, host: str, address: str, m: Any) -> None:
        if m.WhichOneof("kind") == "aggregate_failed":
            with self.lock:
                self.failed.append(m.aggregate_failed)
            return
        super()._on_message(host, address, m)

    def address_of(self, host: str) -> str:
        with self.lock:
            return self.sessions[host][1]

    def ready_for(self, update_id: str) -> Any:
        with self.lock:
            return next((r for r in self.ready if r.update_id == update_id), None)

    def report_for(self, update_id: str) -> list[Any]:
        with self.lock:
            return [r for r in self.reports if r.update_id == update_id]


def wait_until(predicate: Any, timeout: float = 10.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    pause = threading.Event()
    for _ in range(int(timeout / 0.02)):
        value = predicate()
        if value:
            return value
        pause.wait(0.02)
    raise AssertionError("condition not reached in time")


def held_scheduler() -> Iterator[AggScheduler]:
    """The aggregation tests' scheduler: a started :class:`AggScheduler` that holds reports."""
    sched = AggScheduler()
    sched.start()
    sched.hold = True
    yield sched
    sched.stop()


@pytest.fixture
def scheduler() -> Iterator[AggScheduler]:
    yield from held_scheduler()


def _update(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), value), "b": np.arange(4, dtype=np.float64) * value}


def _cluster(
    make_daemon: Any,
    params: mlfabric.Params,
    hosts: tuple[str, ...] = ("ps", "w0", "w1", "w2", "agg"),
    **ps_config: Any,
) -> dict[str, Any]:
    daemons = {h: make_daemon(h, **(ps_config if h == "ps" else {})) for h in hosts}
    server = mlfabric.register_as_server(
        "job", "ps0", {k: v.copy() for k, v in MODEL.items()}, params, daemon=daemons["ps"].config.socket_path
    )
    metas: list[Any] = []

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        metas.append(meta)
        for k in update:
            server.model[k] -= update[k]

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    workers = {
        f"w{i}": mlfabric.register_as_worker(
            "job", name=f"w{i}", daemon=daemons[f"w{i}"].config.socket_path, wait=5
        )
        for i in range(3)
    }
    return {"daemons": daemons, "server": server, "thread": thread, "workers": workers, "metas": metas}


@pytest.fixture
def cluster(make_daemon: Any) -> Iterator[dict[str, Any]]:
    c = _cluster(make_daemon, mlfabric.Params(tau_max=4))
    yield c
    _close(c)


def _close(c: dict[str, Any]) -> None:
    for w in c["workers"].values():
        w.close()
    c["server"].stop()
    c["thread"].join(5)
    c["server"].close()


def _aggregate(sched: AggScheduler, agg_id: str, ready: list[Any], timeout: float = 30.0) -> None:
    members = [
        control_pb2.AggregateMember(
            update_id=r.update_id,
            worker=r.worker,
            base_version=r.base_version,
            norm=r.norm,
            src_host=r.update_id.split("/")[0],
            bytes=r.bytes,
        )
        for r in ready
    ]
    directive = control_pb2.AggregateDirective(
        aggregate_id=agg_id,
        job="job",
        server="ps0",
        members=members,
        dst_host="ps",
        dst_address=sched.address_of("ps"),
        timeout_seconds=timeout,
    )
    sched.send("agg", control_pb2.Directive(aggregate=directive))


def _send(sched: AggScheduler, update_id: str, to: str, aggregate_id: str = "") -> None:
    src = "agg" if update_id.startswith("agg:") else update_id.split("/")[0]
    send = control_pb2.SendDirective(
        update_id=update_id,
        next_hop_host=to,
        next_hop_address=sched.address_of(to),
        dst_host="ps",
        aggregate_id=aggregate_id,
    )
    sched.send(src, control_pb2.Directive(send=send))


def _push(c: dict[str, Any], sched: AggScheduler, worker: str, value: float) -> tuple[Any, Any]:
    def mine() -> list[Any]:
        with sched.lock:
            return [r for r in sched.ready if r.worker == worker]

    n = len(mine())
    handle = c["workers"][worker].push("ps0", _update(value), norm=value)
    wait_until(lambda: len(mine()) > n)
    return handle, mine()[-1]


def _model(c: dict[str, Any]) -> dict[str, np.ndarray]:
    return c["workers"]["w0"].get("ps0")[1]


def test_hello_announces_whether_the_host_aggregates(make_daemon: Any, scheduler: AggScheduler) -> None:
    make_daemon("a1")
    make_daemon("a2", aggregator=False)
    hellos = {h.host: h.can_aggregate for h in scheduler.hellos}
    assert hellos == {"a1": True, "a2": False}


def test_aggregate_is_summed_forwarded_applied_once_and_members_resolve(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (h0, r0), (h1, r1), (h2, r2) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3))
    agg_id = "agg:job:0"
    _aggregate(scheduler, agg_id, [r0, r1, r2])
    for r in (r0, r1, r2):
        _send(scheduler, r.update_id, "agg", agg_id)
    ready = wait_until(lambda: scheduler.ready_for(agg_id))
    assert (ready.job, ready.server, ready.worker) == ("job", "ps0", "")
    assert ready.bytes == r0.bytes and ready.norm == 6.0 and ready.base_version == 0
    # the members were received, not resolved: no outcome, and the pushes still wait
    wait_until(lambda: all(scheduler.report_for(r.update_id) for r in (r0, r1, r2)))
    member_reports = [scheduler.report_for(r.update_id) for r in (r0, r1, r2)]
    assert all(rep[0].ok and rep[0].outcome == control_pb2.OUTCOME_UNSPECIFIED for rep in member_reports)
    assert all(rep[0].dst_host == "agg" for rep in member_reports)
    assert not any(h.done() for h in (h0, h1, h2))

    _send(scheduler, agg_id, "ps")
    report = wait_until(lambda: scheduler.report_for(agg_id))[0]
    assert report.ok and report.outcome == APPLIED and report.server_version == 1
    assert report.src_host == "agg" and report.dst_host == "ps"
    assert [(v.update_id, v.outcome, v.delay) for v in report.member_verdicts] == [
        (r.update_id, APPLIED, 0) for r in (r0, r1, r2)
    ]
    meta = c["metas"][-1]
    assert meta.num_updates == 3 and meta.workers == ("w0", "w1", "w2") and meta.worker == ""
    assert meta.member_ids == (r0.update_id, r1.update_id, r2.update_id) and meta.member_delays == (0, 0, 0)
    model = _model(c)
    for k in MODEL:
        np.testing.assert_array_equal(
            model[k], MODEL[k] - _update(1.0)[k] - _update(2.0)[k] - _update(3.0)[k]
        )

    for r in (r0, r1, r2):
        resolve = control_pb2.ResolveDirective(
            update_id=r.update_id, outcome=APPLIED, delay=0, server_version=1
        )
        scheduler.send(r.update_id.split("/")[0], control_pb2.Directive(resolve=resolve))
    results = [h.wait(10) for h in (h0, h1, h2)]
    assert [(x.status, x.delay, x.version) for x in results] == [(mlfabric.APPLIED, 0, 1)] * 3


def test_member_resent_directly_after_its_aggregate_was_applied_is_not_applied_again(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """The aggregator "died" after forwarding: the scheduler re-plans a member straight to the server."""
    c = cluster
    (h0, r0), (_h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:1"
    _aggregate(scheduler, agg_id, [r0, r1])
    for r in (r0, r1):
        _send(scheduler, r.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.ready_for(agg_id))
    _send(scheduler, agg_id, "ps")
    wait_until(lambda: scheduler.report_for(agg_id))
    # re-sent from the payload the source kept: answered from the server's memory
    _send(scheduler, r0.update_id, "ps")
    result = h0.wait(10)
    assert (result.status, result.delay, result.version) == (mlfabric.APPLIED, 0, 1)
    assert c["server"].version == 1 and len(c["metas"]) == 1
    model = _model(c)
    np.testing.assert_array_equal(model["w"], MODEL["w"] - 3.0)
    # an aggregate holding an already-applied member is refused as a whole
    (_h2, r2) = _push(c, scheduler, "w2", 5.0)
    agg2 = "agg:job:2"
    _aggregate(scheduler, agg2, [r1, r2])
    # r1 is held at w1 (never resolved): it may be sent again
    _send(scheduler, r1.update_id, "agg", agg2)
    _send(scheduler, r2.update_id, "agg", agg2)
    wait_until(lambda: scheduler.ready_for(agg2))
    _send(scheduler, agg2, "ps")
    report = wait_until(lambda: scheduler.report_for(agg2))[0]
    assert report.outcome == DROPPED and r1.update_id in report.reason
    verdicts = {v.update_id: v for v in report.member_verdicts}
    assert verdicts[r1.update_id].outcome == APPLIED and verdicts[r2.update_id].outcome == DROPPED
    assert c["server"].version == 1


def test_missing_member_times_out_and_the_members_are_replanned(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:3"
    _aggregate(scheduler, agg_id, [r0, r1], timeout=0.3)
    _send(scheduler, r0.update_id, "agg", agg_id)
    failed = wait_until(lambda: scheduler.failed)[0]
    assert failed.aggregate_id == agg_id and list(failed.arrived) == [r0.update_id]
    assert r1.update_id in failed.reason and "did not arrive" in failed.reason
    # a late member gets an ERROR naming the abandoned aggregate; its push stays held
    _send(scheduler, r1.update_id, "agg", agg_id)
    late = wait_until(lambda: scheduler.report_for(r1.update_id))[0]
    assert not late.ok and agg_id in late.error and "abandoned" in late.error
    assert not h1.done()
    # the scheduler re-plans both straight to the server, from the payloads the sources kept
    _send(scheduler, r0.update_id, "ps")
    _send(scheduler, r1.update_id, "ps")
    assert [h.wait(10).status for h in (h0, h1)] == [mlfabric.APPLIED] * 2
    np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 3.0)
    assert c["server"].version == 2


def test_reissued_directive_with_fewer_members_completes(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    (_h0, r0), (_h1, r1), (_h2, r2) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(3))
    agg_id = "agg:job:4"
    _aggregate(scheduler, agg_id, [r0, r1, r2])
    _send(scheduler, r0.update_id, "agg", agg_id)
    _send(scheduler, r1.update_id, "agg", agg_id)
    wait_until(lambda: len(scheduler.report_for(r1.update_id)) and len(scheduler.report_for(r0.update_id)))
    assert scheduler.ready_for(agg_id) is None
    _aggregate(scheduler, agg_id, [r0, r1])  # r2 was dropped: the list shrinks
    ready = wait_until(lambda: scheduler.ready_for(agg_id))
    assert ready.norm == 3.0
    # a list that removes a member already summed cannot be honoured
    (_h3, r3) = _push(c, scheduler, "w0", 7.0)
    agg2 = "agg:job:5"
    _aggregate(scheduler, agg2, [r2, r3])
    _send(scheduler, r3.update_id, "agg", agg2)
    wait_until(lambda: scheduler.report_for(r3.update_id))
    _aggregate(scheduler, agg2, [r2])
    failed = wait_until(lambda: scheduler.failed)[0]
    assert failed.aggregate_id == agg2 and r3.update_id in failed.reason


def test_frames_the_aggregator_cannot_take_get_an_error_naming_it(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    c = cluster
    c["daemons"]["agg"].aggregator._early_wait = 0.2
    (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    _send(scheduler, r0.update_id, "agg", "agg:job:nope")
    report = wait_until(lambda: scheduler.report_for(r0.update_id))[0]
    assert not report.ok and "agg:job:nope" in report.error and "unknown" in report.error
    _aggregate(scheduler, "agg:job:6", [r0])
    _send(scheduler, r1.update_id, "agg", "agg:job:6")
    report = wait_until(lambda: scheduler.report_for(r1.update_id))[0]
    assert not report.ok and f"{r1.update_id} is not a member of aggregate agg:job:6" in report.error
    assert not h0.done() and not h1.done()


def test_no_aggregator_host_refuses_aggregates(make_daemon: Any, scheduler: AggScheduler) -> None:
    make_daemon("noagg", aggregator=False)
    directive = control_pb2.AggregateDirective(aggregate_id="agg:j:0", job="j", server="s")
    scheduler.send("noagg", control_pb2.Directive(aggregate=directive))
    failed = wait_until(lambda: scheduler.failed)[0]
    assert failed.aggregate_id == "agg:j:0" and "--no-aggregator" in failed.reason


def test_aggregator_killed_mid_aggregate_members_go_direct_exactly_once(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """The aggregator's daemon stops after one member arrived; both members are applied once each."""
    c = cluster
    (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:7"
    _aggregate(scheduler, agg_id, [r0, r1])
    _send(scheduler, r0.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.report_for(r0.update_id))
    c["daemons"]["agg"].stop()
    _send(scheduler, r0.update_id, "ps")
    _send(scheduler, r1.update_id, "ps")
    assert [h.wait(10).status for h in (h0, h1)] == [mlfabric.APPLIED] * 2
    np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 3.0)
    assert c["server"].version == 2


def test_summed_members_resolve_unknown_when_their_scheduler_session_ends(
    cluster: dict[str, Any], scheduler: AggScheduler
) -> None:
    """The scheduler restarts after the aggregate was applied, before it resolved the members.

    The members' daemons cannot know whether the aggregate reached the server; announcing them
    again would apply them twice if the server's daemon forgot their verdicts (restarted):
    they resolve UNKNOWN naming the aggregate, and are never sent again."""
    c = cluster
    (h0, r0), (h1, r1) = (_push(c, scheduler, f"w{i}", float(i + 1)) for i in range(2))
    agg_id = "agg:job:8"
    _aggregate(scheduler, agg_id, [r0, r1])
    for r in (r0, r1):
        _send(scheduler, r.update_id, "agg", agg_id)
    wait_until(lambda: scheduler.ready_for(agg_id))
    _send(scheduler, agg_id, "ps")
    wait_until(lambda: scheduler.report_for(agg_id))
    port = int(scheduler.address.rsplit(":", 1)[1])
    scheduler.stop()
    fresh = AggScheduler()  # releases every announced update straight to the server
    fresh.start(port)
    try:
        results = [h.wait(15) for h in (h0, h1)]
        assert [x.status for x in results] == [mlfabric.UNKNOWN] * 2
        assert all(agg_id in x.reason for x in results)
        assert not {r0.update_id, r1.update_id} & {r.update_id for r in fresh.ready}
        assert c["server"].version == 1 and len(c["metas"]) == 1
        np.testing.assert_array_equal(_model(c)["w"], MODEL["w"] - 3.0)
    finally:
        fresh.stop()


def test_mixed_dtype_members_are_summed_per_dtype(make_daemon: Any, scheduler: AggScheduler) -> None:
    """float32, bfloat16 (raw uint16 words) and float16 tensors in one model: each summed in its dtype."""
    daemons = {h: make_daemon(h) for h in ("ps", "w0", "w1", "agg")}
    model = {"f": np.zeros(5, np.float32), "bf": np.zeros(5, np.uint16), "h": np.zeros(5, np.float16)}
    server = mlfabric.register_as_server("job", "ps0", model, daemon=daemons["ps"].config.socket_path)
    got: list[dict[str, np.ndarray]] = []

    @server.on_update
    def keep(update: dict[str, Any], meta: Any) -> None:
        got.append({k: np.array(v) for k, v in update.items()})

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    c = {
        "workers": {
            w: mlfabric.register_as_worker("job", name=w, daemon=daemons[w].config.socket_path, wait=5)
            for w in ("w0", "w1")
        },
        "server": server,
        "thread": thread,
    }
    try:
        values = [
            np.float32(1.0 + 2**-8),
            np.float32(1.0 + 2**-8),
        ]  # bfloat16 keeps 7 bits: 1 + 2**-8 is a tie

        def update(v: np.float32) -> dict[str, np.ndarray]:
            f = np.full(5, v, np.float32)
            return {"f": f, "bf": (f.view(np.uint32) >> 16).astype(np.uint16), "h": f.astype(np.float16)}

        handles = [c["workers"][f"w{i}"].push("ps0", update(v)) for i, v in enumerate(values)]
        ready = [
            wait_until(lambda w=w: [r for r in scheduler.ready if r.worker == w])[0] for w in ("w0", "w1")
        ]
        _aggregate(scheduler, "agg:job:h", ready)
        for r in ready:
            _send(scheduler, r.update_id, "agg", "agg:job:h")
        wait_until(lambda: scheduler.ready_for("agg:job:h"))
        _send(scheduler, "agg:job:h", "ps")
        assert wait_until(lambda: scheduler.report_for("agg:job:h"))[0].outcome == APPLIED
        (summed,) = got
        assert summed["f"].tolist() == [2 * (1.0 + 2**-8)] * 5
        # each member's bfloat16 word is 1.0 (0x3F80: truncated); their float32 sum 2.0 is 0x4000
        assert summed["bf"].tolist() == [0x4000] * 5
        assert summed["h"].tolist() == [np.float16(2 * (1.0 + 2**-8))] * 5
        assert not any(h.done() for h in handles)  # the scheduler never resolved them
    finally:
        _close(c)
