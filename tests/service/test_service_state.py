"""SchedulerState: registration rules, domain errors naming the culprit, cleanup on departure."""

from __future__ import annotations

import pytest

from mlfabric.scheduler.core.graph import parse_topology, star
from mlfabric.scheduler.service.records import (
    DuplicateServer,
    DuplicateUpdate,
    DuplicateWorker,
    HostAlreadyConnected,
    JobParams,
    NoPath,
    OutcomeKind,
    ParamsMismatch,
    SchedulerError,
    TensorSpec,
    TransferResult,
    UnknownDaemon,
    UnknownHost,
    UnknownJob,
    UnknownServer,
    UnknownUpdate,
    UnknownWorker,
)
from mlfabric.scheduler.service.state import SchedulerState

MODEL = (TensorSpec("w", "float32", (1000, 1000)),)  # 4 MB: the updates below are smaller


def _state() -> SchedulerState:
    s = SchedulerState(star(3, 8e9))
    for i in range(3):
        s.connect(f"h{i}", f"127.0.0.1:{9000 + i}")
    s.register_server("h0", "j", "ps", MODEL, JobParams(tau_max=3), version=5)
    s.register_worker("h1", "j", "w1")
    s.register_worker("h2", "j", "w2")
    return s


def _ready(s: SchedulerState, uid: str, host: str = "h1", worker: str = "w1", now: float = 0.0):
    return s.add_update(host, uid, "j", "ps", worker, 1000, 1.0, 5, now=now)


def test_hello_with_unknown_host_names_it_and_the_known_hosts() -> None:
    s = SchedulerState(star(2, 8e9))
    with pytest.raises(UnknownHost, match=r"'nope'.*h0, h1"):
        s.connect("nope", "127.0.0.1:1")
    with pytest.raises(UnknownHost):
        s.connect("sw", "127.0.0.1:1")  # a switch is not a host


def test_second_daemon_for_a_host_is_refused() -> None:
    s = SchedulerState(star(2, 8e9))
    s.connect("h0", "127.0.0.1:1")
    with pytest.raises(HostAlreadyConnected, match="h0"):
        s.connect("h0", "127.0.0.1:2")


def test_worker_of_unknown_job_is_refused_naming_the_job() -> None:
    s = _state()
    with pytest.raises(UnknownJob, match="'other'"):
        s.register_worker("h1", "other", "w9")


def test_a_live_workers_name_from_another_host_is_refused_naming_its_host() -> None:
    s = _state()
    with pytest.raises(DuplicateWorker, match=r"'w1' on host 'h1'"):
        s.register_worker("h2", "j", "w1")
    assert s.jobs["j"].workers["w1"] == "h1"  # the live one keeps its name
    s.register_worker("h1", "j", "w1")  # its own daemon again (after a reconnect): accepted
    s.disconnect("h1")  # its daemon left, and its workers with it: the name is free
    s.register_worker("h2", "j", "w1")
    assert s.jobs["j"].workers["w1"] == "h2"


def test_duplicate_server_and_params_mismatch() -> None:
    s = _state()
    with pytest.raises(DuplicateServer, match=r"'ps'.*h0"):
        s.register_server("h1", "j", "ps", MODEL, JobParams(tau_max=3), version=0)
    with pytest.raises(ParamsMismatch, match="ps2"):
        s.register_server("h1", "j", "ps2", MODEL, JobParams(tau_max=9), version=0)
    s.register_server("h1", "j", "ps2", MODEL, JobParams(tau_max=3), version=0)
    assert [x.name for x in s.servers("j")] == ["ps", "ps2"]


def test_update_ready_resolves_destination_and_path() -> None:
    s = _state()
    u = _ready(s, "h1/1", now=2.5)
    assert (u.src_host, u.dst_host, u.ready_at, u.bytes) == ("h1", "h0", 2.5, 1000)
    assert s.path("h1", "h0") == ("h1", "sw", "h0")
    with pytest.raises(DuplicateUpdate, match="h1/1"):
        _ready(s, "h1/1")


def test_update_errors_name_the_problem() -> None:
    s = _state()
    s.register_server("h2", "k", "ps_k", MODEL, JobParams(), version=0)
    with pytest.raises(UnknownJob, match="'nojob'"):
        s.add_update("h1", "u", "nojob", "ps", "w1", 1, 1.0, 0, now=0.0)
    with pytest.raises(UnknownServer, match=r"job 'j' has no server 'ps_k'.*job 'k'"):
        s.add_update("h1", "u", "j", "ps_k", "w1", 1, 1.0, 0, now=0.0)
    with pytest.raises(UnknownWorker, match=r"'w2' on host 'h1'"):
        s.add_update("h1", "u", "j", "ps", "w2", 1, 1.0, 0, now=0.0)
    assert not s.pending


def test_no_path_is_a_domain_error() -> None:
    g = parse_topology(
        {
            "hosts": ["a", "b", "c", "d"],
            "links": [{"a": "a", "b": "b", "gbps": 1}, {"a": "c", "b": "d", "gbps": 1}],
        }
    )
    s = SchedulerState(g)
    s.connect("a", "127.0.0.1:1")
    s.connect("c", "127.0.0.1:2")
    s.register_server("a", "j", "ps", MODEL, JobParams(), version=0)
    s.register_worker("c", "j", "w")
    with pytest.raises(NoPath, match="'c' to 'a'"):
        s.add_update("c", "u", "j", "ps", "w", 1, 1.0, 0, now=0.0)


def test_release_report_tracks_version_and_outcome() -> None:
    s = _state()
    _ready(s, "u1")
    f = s.release("u1", ("h1", "sw", "h0"), started_at=1.0, expected_end=2.0)
    assert "u1" not in s.pending and s.in_flight["u1"] == f
    snap = s.snapshot(1.5)
    assert snap.in_flight == (f,) and snap.server_versions == {("j", "ps"): 5} and snap.tau_max == {"j": 3}
    res = TransferResult(
        "u1", "h1", "h0", 1000, 10.0, 10.5, outcome=OutcomeKind.APPLIED, delay=1, server_version=6
    )
    assert s.report(res) == f
    assert not s.in_flight
    assert s.server_versions()[("j", "ps")] == 6
    assert s.outcomes["u1"].kind is OutcomeKind.APPLIED and s.outcomes["u1"].delay == 1
    with pytest.raises(UnknownUpdate):
        s.report(res)


def test_failed_transfer_is_forgotten_without_outcome() -> None:
    s = _state()
    _ready(s, "u1")
    s.release("u1", ("h1", "sw", "h0"), 0.0, 1.0)
    s.report(TransferResult("u1", "h1", "h0", 0, 0.0, 0.0, ok=False, error="peer gone"))
    assert not s.in_flight and "u1" not in s.outcomes
    _ready(s, "u1")  # the daemon may announce it again to retry
    s.release("u1", ("h1", "sw", "h0"), 0.0, 1.0)
    s.report(
        TransferResult("u1", "h1", "h0", 0, 0.0, 0.0, ok=False, error="gone", outcome=OutcomeKind.DROPPED)
    )
    assert s.outcomes["u1"].kind is OutcomeKind.DROPPED and s.outcomes["u1"].reason == "gone"
    assert s.server_versions()[("j", "ps")] == 5


def test_drop_records_reason() -> None:
    s = _state()
    _ready(s, "u1")
    s.drop("u1", "too stale")
    assert s.outcomes["u1"].kind is OutcomeKind.DROPPED and s.outcomes["u1"].reason == "too stale"
    with pytest.raises(UnknownUpdate):
        s.drop("u1", "again")


def test_disconnect_of_a_worker_host_cleans_up_its_updates_and_roles() -> None:
    s = _state()
    _ready(s, "u1")
    _ready(s, "u2")
    s.release("u2", ("h1", "sw", "h0"), 0.0, 1.0)
    _ready(s, "v1", host="h2", worker="w2")
    cleanup = s.disconnect("h1")
    assert [u.update_id for u, _ in cleanup.dropped] == ["u1"]
    assert "disconnected" in cleanup.dropped[0][1]
    assert [f.update_id for f in cleanup.in_flight] == ["u2"]
    assert list(s.pending) == ["v1"] and not s.in_flight
    assert s.worker_hosts("j") == {"h2"}
    assert cleanup.jobs_changed == ()
    with pytest.raises(UnknownDaemon):
        _ready(s, "u3")


def test_disconnect_of_the_server_host_drops_updates_bound_for_it() -> None:
    s = _state()
    _ready(s, "u1")
    cleanup = s.disconnect("h0")
    assert [(u.update_id, "server 'ps' left" in r) for u, r in cleanup.dropped] == [("u1", True)]
    assert cleanup.jobs_changed == ("j",)
    with pytest.raises(UnknownJob):
        s.register_worker("h1", "j", "w3")
    # the workers stay: a new server brings the job back, with fresh params
    s.connect("h0", "127.0.0.1:9100")
    s.register_server("h0", "j", "ps", MODEL, JobParams(tau_max=7), version=0)
    assert _ready(s, "u5").dst_host == "h0"


def test_unregister_server_and_worker() -> None:
    s = _state()
    _ready(s, "u1")
    with pytest.raises(UnknownServer, match="h0"):
        s.unregister_server("h1", "j", "ps")
    cleanup = s.unregister_server("h0", "j", "ps")
    assert [u.update_id for u, _ in cleanup.dropped] == ["u1"] and "unregistered" in cleanup.dropped[0][1]
    s.unregister_worker("h1", "j", "w1")
    with pytest.raises(UnknownWorker):
        s.unregister_worker("h1", "j", "w1")


def test_resolve_by_daemon_checks_the_source() -> None:
    s = _state()
    _ready(s, "u1")
    with pytest.raises(UnknownUpdate, match="h1"):
        s.resolve("h2", "u1", OutcomeKind.DROPPED, "x")
    assert s.resolve("h1", "u1", OutcomeKind.DROPPED, "shape mismatch") is not None
    assert not s.pending and s.outcomes["u1"].reason == "shape mismatch"


def test_sharing_weights_other_transfers_by_their_overlap() -> None:
    s = _state()
    _ready(s, "u1")
    _ready(s, "v1", host="h2", worker="w2")
    s.release("u1", ("h1", "sw", "h0"), started_at=0.0, expected_end=1.0)
    assert s.sharing("u1", now=1.0) == 1  # alone
    s.release("v1", ("h2", "sw", "h0"), started_at=0.75, expected_end=2.0)
    assert s.sharing("u1", now=1.0) == 1  # v1 overlapped a quarter of u1's time on sw->h0
    assert s.sharing("u1", now=3.0) == 2  # ... and three quarters here
    assert s.sharing("unknown", now=1.0) == 1


@pytest.mark.parametrize(
    "address",
    ["nonsense", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1:http", ":9000", "999.1.1.1:9"],
)
def test_hello_with_a_malformed_data_address_is_refused_naming_it(address: str) -> None:
    s = SchedulerState(star(2, 8e9))
    with pytest.raises(SchedulerError, match=f"'{address}'"):
        s.connect("h0", address)
    assert "h0" not in s.daemons


@pytest.mark.parametrize("address", ["127.0.0.1:1", "198.18.0.2:65535", "[::1]:9000"])
def test_hello_with_a_well_formed_data_address_is_accepted(address: str) -> None:
    s = SchedulerState(star(2, 8e9))
    assert s.connect("h0", address).data_address == address


def test_bounded_div_max_is_accepted_now_that_replicas_run() -> None:
    s = SchedulerState(star(2, 8e9))
    s.connect("h0", "127.0.0.1:1")
    s.register_server("h0", "j", "ps", MODEL, JobParams(div_max=0.5), version=0)
    assert s.jobs["j"].params.div_max == 0.5


def test_update_announcing_more_than_the_model_size_is_refused_naming_both() -> None:
    s = _state()
    with pytest.raises(SchedulerError, match=r"announces 1000000000000 bytes.*4000000-byte model"):
        s.add_update("h1", "h1/rogue", "j", "ps", "w1", 10**12, 1.0, 5, now=0.0)
    assert "h1/rogue" not in s.pending
    assert s.add_update("h1", "h1/ok", "j", "ps", "w1", 4_000_000, 1.0, 5, now=0.0).bytes == 4_000_000


def test_transfer_without_progress_is_forgotten_past_its_deadline() -> None:
    s = _state()
    _ready(s, "u1")
    _ready(s, "u2", host="h2", worker="w2")
    s.release("u1", ("h1", "sw", "h0"), started_at=0.0, expected_end=2.0)  # deadline 4 x 2 s + 30 s = 38 s
    s.release("u2", ("h2", "sw", "h0"), started_at=30.0, expected_end=31.0)  # deadline 64 s
    assert s.stall_deadline() == 38.0
    assert s.expire_stalled(now=37.0) == []
    stalled = s.expire_stalled(now=39.0)
    assert [f.update_id for f in stalled] == ["u1"] and list(s.in_flight) == ["u2"]
    out = s.outcomes["u1"]
    assert out.kind is OutcomeKind.DROPPED and "no report" in out.reason and "38" in out.reason
    with pytest.raises(UnknownUpdate):  # a late report finds nothing to release
        s.report(TransferResult("u1", "h1", "h0", 1000, 0.0, 50.0, outcome=OutcomeKind.APPLIED))
