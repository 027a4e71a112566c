"""Replicas within div_max and server failover, with real processes (docs/replication.md).

A scheduler and four daemons (hosts ps, rep, a, b) on loopback; the server on ps, its replica
on rep, workers on a and b pushing integer-valued float64 updates (exact arithmetic), so the
final model tells exactly which updates were applied.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mlfabric.cluster import LocalCluster

HERE = Path(__file__).resolve().parent
ROLES = HERE / "roles.py"

WORKER_HOSTS = ("a", "b", "c")


def _topology(workers: int = 2) -> str:
    hosts = ["ps", "rep", *WORKER_HOSTS[:workers]]
    links = "".join(f'[[links]]\na = "{h}"\nb = "sw"\nmbps = 1000\n' for h in hosts)
    return f'hosts = {json.dumps(hosts)}\nswitches = ["sw"]\n{links}'


def _roles() -> Any:
    """This directory's ``roles.py`` by path (``tests/integration`` has a ``roles`` module too)."""
    spec = importlib.util.spec_from_file_location("replication_test_roles", ROLES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wait_file(path: Path, proc: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.popen.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, f"{path.name} did not appear; log:\n{proc.log_tail()}"
        time.sleep(0.05)


class Run:
    """A cluster with the server, its replica and the workers of one test."""

    def __init__(
        self,
        tmp_path: Path,
        div_max: float,
        cluster_cls: Any = LocalCluster,
        policy: str = "stf",
        replica_args: tuple[str, ...] = (),
        scheduler_args: tuple[str, ...] = (),
        workers: int = 2,
        server_args: tuple[str, ...] = (),
    ) -> None:
        topology = tmp_path / "topology.toml"
        topology.write_text(_topology(workers))
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.cluster = cluster_cls(
            topology, policy=policy, workdir=tmp_path / "run", extra_scheduler_args=scheduler_args
        ).start()
        self.server = self.spawn("ps", "server", str(div_max), *server_args)
        _wait_file(self.out / "server.ready", self.server)
        self.replica = self.spawn("rep", "replica", *replica_args)
        _wait_file(self.out / "replica.ready", self.replica)
        self.workers: list[Any] = []

    def spawn(self, host: str, role: str, *args: str, name: str | None = None) -> Any:
        argv = [sys.executable, str(ROLES), role, str(self.out), *args]
        return self.cluster.spawn(host, argv, name=name or role)

    def start_workers(self, pushes: int, gap: float, workers: int = 2) -> None:
        for rank, host in enumerate(WORKER_HOSTS[:workers]):
            args = (str(rank), str(pushes), str(gap))
            self.workers.append(self.spawn(host, "worker", *args, name=f"worker{rank}"))

    def progress(self) -> int:
        total = 0
        for rank in range(len(self.workers)):
            p = self.out / f"worker{rank}.progress"
            total += int(p.read_text() or 0) if p.exists() else 0
        return total

    def wait_progress(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.progress() < n:
            assert time.monotonic() < deadline, f"workers stuck at {self.progress()} pushes"
            time.sleep(0.02)

    def finish(self, *procs: Any) -> dict[int, list[dict[str, Any]]]:
        for w in self.workers:
            try:
                assert w.popen.wait(timeout=180) == 0, w.log_tail()
            except subprocess.TimeoutExpired:
                pytest.fail(f"{w.name} did not finish; log:\n{w.log_tail()}")
        for p in procs:
            p.popen.terminate()
            assert p.popen.wait(timeout=30) == 0, p.log_tail()
        return {r: json.loads((self.out / f"worker{r}.json").read_text()) for r in range(len(self.workers))}

    def stop(self) -> None:
        self.cluster.stop()


def _model(out: Path, role: str) -> dict[str, np.ndarray]:
    with np.load(out / f"{role}.npz") as z:
        return {k: z[k] for k in z.files}


def _minus(results: dict[int, list[dict[str, Any]]], statuses: tuple[str, ...]) -> dict[str, np.ndarray]:
    roles = _roles()
    model = roles.initial_model()
    for rank, pushes in results.items():
        for p in pushes:
            if p["status"] in statuses:
                for k, v in roles.update_for(rank, p["index"]).items():
                    model[k] -= v
    return model


def _check_exact(final: dict[str, np.ndarray], results: dict[int, list[dict[str, Any]]]) -> None:
    """final == initial - APPLIED - (some subset of UNKNOWN): nothing lost, nothing twice."""
    roles = _roles()
    base = _minus(results, ("APPLIED",))
    unknown = [(r, p["index"]) for r, ps in results.items() for p in ps if p["status"] == "UNKNOWN"]
    assert len(unknown) <= 6, f"too many UNKNOWN verdicts to check: {unknown}"
    for size in range(len(unknown) + 1):
        for subset in itertools.combinations(unknown, size):
            model = {k: v.copy() for k, v in base.items()}
            for r, i in subset:
                for k, v in roles.update_for(r, i).items():
                    model[k] -= v
            if all(np.array_equal(model[k], final[k]) for k in final):
                return
    pytest.fail("the final model is not initial - APPLIED (- some UNKNOWN): lost or applied twice")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stf", "stf+agg"])
def test_replica_is_bit_identical_to_its_server(tmp_path: Path, policy: str) -> None:
    """The replica applies what the server applied, in its order (aggregates included)."""
    run = Run(tmp_path, div_max=40.0, policy=policy)
    try:
        run.start_workers(pushes=20, gap=0.0)
        results = run.finish(run.server, run.replica)
    finally:
        run.stop()
    assert all(p["status"] == "APPLIED" for ps in results.values() for p in ps), results
    server, replica = _model(run.out, "server"), _model(run.out, "replica")
    expected = _minus(results, ("APPLIED",))
    for k in expected:
        assert np.array_equal(server[k], expected[k])
        assert np.array_equal(replica[k], server[k]), "the replica differs from its server"
    applied = json.loads((run.out / "replica.json").read_text())["applied"]
    served = json.loads((run.out / "server.json").read_text())["applied"]
    assert applied == served  # the same payloads (updates or aggregates), in the same order


def _daemon(run: Run, host: str) -> Any:
    return next(p for p in run.cluster.processes() if p.name == f"daemon-{host}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("victim", "after"),
    [("process", 0), ("process", 12), ("daemon", 12), ("process", 30), ("daemon", 30)],
)
def test_chain_failover_is_exactly_once(tmp_path: Path, victim: str, after: int) -> None:
    """Chain replication (div_max 0): SIGKILL the server (process or daemon) after ``after``
    pushes resolved — before any replica transfer, or mid-stream with transfers in flight;
    the promoted replica ends at initial - exactly the APPLIED updates (UNKNOWN: either way)."""
    run = Run(tmp_path, div_max=0.0)
    try:
        run.start_workers(pushes=30, gap=0.01)
        run.wait_progress(after)
        target = run.server if victim == "process" else _daemon(run, "ps")
        os.kill(target.popen.pid, signal.SIGKILL)
        target.popen.wait(timeout=10)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=20)
        results = run.finish(run.replica)
    finally:
        run.stop()
    statuses = [p["status"] for ps in results.values() for p in ps]
    # pushes in flight to the failed server are re-routed to the promoted replica (3 s wait)
    assert statuses.count("APPLIED") >= 58, statuses
    for p in (p for ps in results.values() for p in ps if p["status"] != "APPLIED"):
        assert p["reason"], p
    _check_exact(_model(run.out, "replica"), results)
    replica = json.loads((run.out / "replica.json").read_text())
    assert len(replica["applied"]) == len(set(replica["applied"])), "an update applied twice at the replica"
    assert replica["promoted_at"] is not None and replica["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [4, 10, 16])
def test_stf_agg_chain_failover_applies_re_routed_updates_the_replica_has_not(
    tmp_path: Path, kill_at: int
) -> None:
    """stf+agg, chain replication, 3 workers (issue 27): the server's daemon dies right after
    the replica applied an update (the replica's ``on_update`` SIGKILLs it), so that update's
    ACK is lost, its worker's daemon announces it again, and it may meet fresh updates at the
    scheduler. It goes whole to the promoted replica (answered from memory), never summed
    with them: an aggregate holding it was refused there, and its fresh members DROPPED."""
    ready = tmp_path / "run" / "ready" / "daemon-ps.json"
    run = Run(
        tmp_path, div_max=0.0, policy="stf+agg", workers=3, replica_args=("0", str(ready), str(kill_at))
    )
    try:
        for rank, host in enumerate(WORKER_HOSTS):  # 2 pushes each unresolved at a time
            run.workers.append(run.spawn(host, "flood", str(rank), "3", "2", name=f"worker{rank}"))
        _wait_file(run.out / "replica.promoted", run.replica, timeout=60)
        results = run.finish(run.replica)
    finally:
        run.stop()
    pushes = [p for ps in results.values() for p in ps]
    assert pushes and not [p for p in pushes if p["status"] not in ("APPLIED", "UNKNOWN")]
    _check_exact(_model(run.out, "replica"), results)


@pytest.mark.slow
def test_bounded_failover_loses_at_most_div_max(tmp_path: Path) -> None:
    """div_max = ~3 update norms: the replica lacks at most div_max worth of APPLIED updates."""
    roles = _roles()
    norm = float(np.sqrt(sum((v**2).sum() for v in roles.update_for(0, 0).values())))
    div_max = 3 * norm
    run = Run(tmp_path, div_max=div_max)
    try:
        run.start_workers(pushes=30, gap=0.01)
        run.wait_progress(20)
        os.kill(run.server.popen.pid, signal.SIGKILL)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=20)
        results = run.finish(run.replica)
    finally:
        run.stop()
    final = _model(run.out, "replica")
    applied = _minus(results, ("APPLIED",))
    # what the replica lacks of the APPLIED updates (UNKNOWN ones may be in or out)
    replica_ids = set(json.loads((run.out / "replica.json").read_text())["applied"])
    lost = [
        (r, p["index"])
        for r, ps in results.items()
        for p in ps
        if p["status"] == "APPLIED" and p["update_id"] not in replica_ids
    ]
    lost_norm = sum(
        float(np.sqrt(sum((v**2).sum() for v in roles.update_for(r, i).values()))) for r, i in lost
    )
    assert lost_norm <= div_max + 1e-9, (lost, lost_norm, div_max)
    expected = {k: v.copy() for k, v in applied.items()}
    for r, i in lost:
        for k, v in roles.update_for(r, i).items():
            expected[k] += v
    unknown = [p for ps in results.values() for p in ps if p["status"] == "UNKNOWN"]
    if not unknown:
        assert all(np.array_equal(final[k], expected[k]) for k in final)


@pytest.mark.slow
def test_a_stalled_replica_blocks_the_server_instead_of_diverging(tmp_path: Path) -> None:
    """SIGSTOP the replica: at most div_max worth of updates is applied, then the server waits;
    SIGCONT: everything is applied and the replica matches the server exactly."""
    roles = _roles()
    norm = float(np.sqrt(sum((v**2).sum() for v in roles.update_for(0, 0).values())))
    run = Run(tmp_path, div_max=2.5 * norm)  # about two updates of this size
    try:
        os.kill(run.replica.popen.pid, signal.SIGSTOP)
        run.workers.append(run.spawn("a", "worker", "0", "8", "0", name="worker0"))
        time.sleep(4.0)
        stalled = run.progress()
        os.kill(run.replica.popen.pid, signal.SIGCONT)
        results = run.finish(run.server, run.replica)
    finally:
        run.stop()
    assert stalled <= 4, f"{stalled} pushes resolved while the replica was stopped"
    assert all(p["status"] == "APPLIED" for p in results[0]), results
    server, replica = _model(run.out, "server"), _model(run.out, "replica")
    assert all(np.array_equal(server[k], replica[k]) for k in server)


@pytest.mark.slow
def test_a_failed_server_comes_back_as_the_replica_of_the_promoted_one(tmp_path: Path) -> None:
    """After its replica took over, the server's name registered again on the old host joins
    as the promoted server's replica and ends bit-identical to it."""
    run = Run(tmp_path, div_max=0.0)
    try:
        run.start_workers(pushes=30, gap=0.02)
        run.wait_progress(10)
        os.kill(run.server.popen.pid, signal.SIGKILL)
        run.server.popen.wait(timeout=10)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=20)
        rejoined = run.spawn("ps", "rejoin")
        _wait_file(run.out / "rejoin.ready", rejoined)
        results = run.finish(rejoined, run.replica)
    finally:
        run.stop()
    info = json.loads((run.out / "rejoin.json").read_text())
    assert info["is_replica"] and info["start_version"] > 0
    promoted, rejoin = _model(run.out, "replica"), _model(run.out, "rejoin")
    assert all(np.array_equal(promoted[k], rejoin[k]) for k in promoted), "the re-joined replica differs"
    _check_exact(promoted, results)


@pytest.mark.slow
def test_after_a_scheduler_restart_the_replica_still_takes_over(tmp_path: Path) -> None:
    """SIGKILL the scheduler mid-run and start it again: the replica registers again (once its
    server is back) and is promoted when the server process is killed later; exactly once."""
    sys.path.insert(0, str(HERE.parents[1] / "experiments"))
    try:
        from faults_cluster import FaultCluster
    finally:
        sys.path.pop(0)
    run = Run(tmp_path, div_max=0.0, cluster_cls=FaultCluster)
    try:
        run.start_workers(pushes=40, gap=0.02)
        run.wait_progress(8)
        for rank in range(2):  # both registered before the restart (a loaded host starts them late)
            _wait_file(run.out / f"worker{rank}.progress", run.workers[rank])
        run.cluster.restart("scheduler", signal.SIGKILL)
        run.wait_progress(30)
        os.kill(run.server.popen.pid, signal.SIGKILL)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=30)
        results = run.finish(run.replica)
    finally:
        run.stop()
    _check_exact(_model(run.out, "replica"), results)
    replica = json.loads((run.out / "replica.json").read_text())
    assert len(replica["applied"]) == len(set(replica["applied"]))


@pytest.mark.slow
def test_a_replica_whose_daemon_lost_its_session_is_attached_again(tmp_path: Path) -> None:
    """Cut the replica's daemon's scheduler session (a TCP proxy; the scheduler and every process
    stay up): the daemon reconnects, the replica registers again and is attached anew, so when
    the server process is killed later it is promoted, holding exactly the APPLIED updates."""
    spec = importlib.util.spec_from_file_location("replication_test_proxy", HERE / "proxy.py")
    assert spec is not None and spec.loader is not None
    proxy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proxy)
    run = Run(tmp_path, div_max=0.0, cluster_cls=proxy.ProxiedCluster)
    try:
        run.start_workers(pushes=40, gap=0.02)
        run.wait_progress(8)
        carried = run.cluster.proxy.connections()
        run.cluster.proxy.cut()
        deadline = time.monotonic() + 20
        while run.cluster.proxy.connections() == carried:  # the replica's daemon reconnected
            assert time.monotonic() < deadline, "the replica's daemon did not reconnect"
            time.sleep(0.05)
        run.wait_progress(30)
        os.kill(run.server.popen.pid, signal.SIGKILL)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=20)
        results = run.finish(run.replica)
    finally:
        run.stop()
    _check_exact(_model(run.out, "replica"), results)
    replica = json.loads((run.out / "replica.json").read_text())
    assert len(replica["applied"]) == len(set(replica["applied"])), "an update applied twice at the replica"


def _norm(update: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum((v**2).sum() for v in update.values())))


@pytest.mark.slow
def test_an_update_beyond_div_max_is_admitted_under_steady_small_pushes(tmp_path: Path) -> None:
    """First-come admission: an update 4x div_max/2.5 pushed while two workers keep 4 small pushes
    each unresolved is applied within a bounded time, long before the small pushes stop (failed
    before: smaller updates that fit were admitted beside it, the divergence never reached 0 and it
    waited until the flood ended); the replica ends bit-identical to the server."""
    roles = _roles()
    div_max = 2.5 * _norm(roles.update_for(0, 0))
    scale = 4.0
    run = Run(tmp_path, div_max=div_max, policy="fair", replica_args=("0.02",))  # replication: the bottleneck
    try:
        for host, rank in (("a", 0), ("b", 1)):
            run.workers.append(run.spawn(host, "flood", str(rank), "8", "4", name=f"worker{rank}"))
        run.workers.append(run.spawn("a", "big", "2", str(scale), "2", name="worker2"))
        results = run.finish(run.server, run.replica)
    finally:
        run.stop()
    (large,) = results[2]
    small = [p for r in (0, 1) for p in results[r]]
    assert large["status"] == "APPLIED" and all(p["status"] == "APPLIED" for p in small)
    waited = large["t"] - large["t0"]
    after = [p for p in small if p["t"] > large["t"]]
    assert waited < 3.0, f"the large update waited {waited:.1f} s (small pushes resolved meanwhile)"
    assert len(after) >= 10, "the small pushes did not go on after the large one (no steady traffic)"
    expected = _minus({r: results[r] for r in (0, 1)}, ("APPLIED",))
    for k, v in roles.update_for(2, 0).items():
        expected[k] -= v * scale
    server, replica = _model(run.out, "server"), _model(run.out, "replica")
    for k in expected:
        assert np.array_equal(server[k], expected[k]) and np.array_equal(replica[k], server[k])


def _proxy_module() -> Any:
    spec = importlib.util.spec_from_file_location("replication_test_proxy", HERE / "proxy.py")
    assert spec is not None and spec.loader is not None
    proxy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proxy)
    return proxy


@pytest.mark.slow
def test_a_replica_back_after_the_grace_is_resynced_and_takes_over(tmp_path: Path) -> None:
    """Keep the replica's daemon away from the scheduler past the grace (1 s here) with the
    replica process stopped: the chain-replicated server waits for it, then, once it is detached,
    goes on without it; the replica resumes, its daemon registers it again, the server's daemon
    sends it the model again and it is attached anew; the server process is killed later: the
    replica is promoted, holding exactly the APPLIED updates (failed before: never attached
    again, never promoted)."""
    proxy = _proxy_module()
    grace = ("--replica-grace", "1")
    run = Run(tmp_path, div_max=0.0, cluster_cls=proxy.ProxiedCluster, scheduler_args=grace)
    try:
        run.start_workers(pushes=300, gap=0.02)  # (still pushing when the daemon is back, ~3-7 s)
        run.wait_progress(8)
        carried = run.cluster.proxy.connections()
        os.kill(run.replica.popen.pid, signal.SIGSTOP)  # chain: the server waits for it...
        run.cluster.proxy.cut(hold=3.0)  # ... until it is detached (the grace is 1 s)
        at_cut = run.progress()
        try:
            run.wait_progress(at_cut + 15, timeout=4.0)  # the server does not wait on it any more
        finally:
            os.kill(run.replica.popen.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while run.cluster.proxy.connections() == carried:  # the replica's daemon reconnected
            assert time.monotonic() < deadline, "the replica's daemon did not reconnect"
            time.sleep(0.05)
        _wait_file(run.out / "replica.resynced", run.replica, timeout=20)
        run.wait_progress(run.progress() + 20)
        os.kill(run.server.popen.pid, signal.SIGKILL)
        _wait_file(run.out / "replica.promoted", run.replica, timeout=20)
        results = run.finish(run.replica)
    finally:
        run.stop()
    _check_exact(_model(run.out, "replica"), results)
    replica = json.loads((run.out / "replica.json").read_text())
    assert replica["resyncs"] == 1
    assert len(replica["applied"]) == len(set(replica["applied"])), "an update applied twice at the replica"
