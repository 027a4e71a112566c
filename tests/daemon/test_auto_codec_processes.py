"""The scheduler's ``auto`` codec end to end (issue 26, docs/compression.md): slow path compressed, fast not.

The scheduler service is a real process on a star: the server's host ``ps`` and a worker host
``fast`` with 40 Gbit/s NICs, a worker host ``slow`` with a 10 Mbit/s NIC. The daemons run in
this process (their stats are read), on loopback. A job registered with
``Params(compression="auto")`` pushes a 1 MB float32 update from each worker host: the
scheduler advises ``slow``'s daemon a codec before its worker's registration is acknowledged
(int8 under ``stf``; bf16, which an aggregator sums without decoding, under ``stf+agg``), and
nothing to ``fast``'s (40 Gbit/s: encoding would cost more than the link saves). Every push
resolves exactly once, APPLIED, and the server applies each update once: the slow host's
decoded from the codec's words, the fast host's exactly as pushed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from tests.daemon.test_daemon_processes import Processes

pytestmark = pytest.mark.slow

TOPOLOGY = """
hosts = ["ps", "fast", "slow"]
switches = ["sw"]

[[links]]
a = "ps"
b = "sw"
mbps = 40000

[[links]]
a = "fast"
b = "sw"
mbps = 40000

[[links]]
a = "slow"
b = "sw"
mbps = 10
"""

N = 250_000  # float32: 1 MB; 0.8 s at 10 Mbit/s, 0.2 ms at 40 Gbit/s
PUSHES = 6


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.reap()


@pytest.mark.parametrize(("policy", "codec"), [("stf", "int8"), ("stf+agg", "bf16")])
def test_auto_compresses_the_slow_path_only(
    procs: Processes, sockdir: str, tmp_path: Path, policy: str, codec: str
) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    sched = procs.start(
        "scheduler",
        "mlfabric.scheduler.service.cli",
        "--listen",
        "127.0.0.1:0",
        "--topology",
        str(topology),
        "--policy",
        policy,
    )
    daemons: dict[str, Daemon] = {}
    clients: list[Any] = []
    applied: list[tuple[str, np.ndarray]] = []
    try:
        for host in ("ps", "fast", "slow"):
            config = DaemonConfig(
                host=host, scheduler=sched["address"], socket_path=os.path.join(sockdir, f"{host}.sock")
            )
            daemons[host] = Daemon(config)
            daemons[host].start(timeout=20)
        sock = {h: d.config.socket_path for h, d in daemons.items()}
        model = {"w": np.zeros(N, np.float32)}
        server = mlfabric.register_as_server(
            "job", "ps0", model, mlfabric.Params(compression="auto"), daemon=sock["ps"]
        )
        clients.append(server)

        @server.on_update
        def apply(update: dict[str, Any], meta: Any) -> None:
            for worker in meta.workers or [meta.worker]:
                applied.append((worker, np.asarray(update["w"]).copy()))
            server.model["w"] += update["w"]

        serving = threading.Thread(target=server.serve, daemon=True)
        serving.start()
        workers = {
            h: mlfabric.register_as_worker("job", name=h, daemon=sock[h], wait=10) for h in ("fast", "slow")
        }
        clients += workers.values()
        # the advice came before the registration's ack: the first push already follows it
        assert workers["slow"].advised("ps0") == codec and workers["fast"].advised("ps0") == ""
        assert daemons["slow"].directory.advice("job", "ps0") == codec
        rng = np.random.default_rng(3)
        updates = {h: [rng.standard_normal(N).astype(np.float32) for _ in range(PUSHES)] for h in workers}
        for w in workers.values():
            w.rng = np.random.default_rng(5)
        handles = [
            (h, i, workers[h].push("ps0", {"w": updates[h][i]})) for i in range(PUSHES) for h in workers
        ]
        results = [(h, i, handle.wait(timeout=60)) for h, i, handle in handles]
        for h, i, r in results:
            assert r.status == mlfabric.APPLIED, (h, i, r.reason)
        # every push resolved exactly once, and was applied once (as one update or in an aggregate)
        assert sorted(w for w, _ in applied) == sorted(h for h, _, _ in results)
        slow_stats, fast_stats = daemons["slow"].stats(), daemons["fast"].stats()
        assert slow_stats.pushes == {codec: PUSHES}, slow_stats.pushes
        assert fast_stats.pushes == {"none": PUSHES}, fast_stats.pushes
        ratio = slow_stats.push_raw_bytes[codec] / slow_stats.push_bytes[codec]
        assert ratio > (3.9 if codec == "int8" else 1.99)
        if policy == "stf":  # each update applied alone (in any order): match it with what was pushed
            got = {h: [u for w, u in applied if w == h] for h in workers}
            scale = np.abs(np.concatenate(updates["slow"])).max() / 127
            for h, tol in (("fast", 0.0), ("slow", 2 * scale)):  # int8 with own scales: under 2 steps
                left = list(range(PUSHES))
                for have in got[h]:
                    err = {i: float(np.abs(have - updates[h][i]).max()) for i in left}
                    best = min(err, key=err.__getitem__)
                    assert err[best] <= tol, (h, err)
                    assert (err[best] > 0) == (h == "slow")  # the slow host's decoded, the fast's exact
                    left.remove(best)
        else:
            tol = np.abs(np.concatenate(updates["slow"])).max() * 2**-7 * PUSHES
            total = sum(updates["slow"]) + sum(updates["fast"])
            assert np.abs(server.model["w"] - total).max() <= tol + 1e-3
    finally:
        if clients:
            clients[0].stop()
        for c in clients:
            c.close()
        for d in daemons.values():
            d.stop()


def test_the_daemon_stamps_its_hosts_cpu_load_on_every_update_it_announces(tmp_path: Path) -> None:
    from mlfabric.proto.v1 import control_pb2

    daemon = Daemon(
        DaemonConfig(host="w0", scheduler="127.0.0.1:1", socket_path=str(tmp_path / "w0.sock")),
        host_load=lambda: 2.5,
    )
    sent: list[Any] = []

    class Stream:  # the control stream, as far as sending goes (no I/O: never started)
        def send(self, message: Any) -> bool:
            sent.append(message)
            return True

    daemon._control = Stream()  # type: ignore[assignment]
    ready = control_pb2.UpdateReady(update_id="w0/1", job="j", server="ps0", worker="w")
    assert daemon._context.send(control_pb2.DaemonMessage(update_ready=ready))
    assert daemon._context.send(control_pb2.DaemonMessage(update_resolved=control_pb2.UpdateResolved()))
    assert sent[0].update_ready.cpu_load == 2.5 and not sent[1].HasField("update_ready")
