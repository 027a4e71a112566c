"""Model relays end to end: the real scheduler picks the relay, whose daemon is SIGKILLed mid-fetch.

The scheduler service is a real process on a two-rack topology: the server's host ``ps`` in one
rack, ``a1``, ``a2``, ``a3`` behind a 100 Mbit/s uplink in the other, ``a1`` with the fastest
NIC (so the relay). ``a1``'s daemon is a real ``mlfabric daemon`` process; the others run in
this process (their stats are read), ``ps``'s with its egress shaped to 10 MB/s so that the
relay's fetch of the 8 MB model takes most of a second. The scheduler knows the model's size,
so the routes say to move it in pieces (docs/model-relays.md): the workers' daemons take
pieces from the relay while it still fetches. The relay is SIGKILLed while it fetches: both
workers behind it still get the model (the rest of it from the server's daemon, same
version), the scheduler routes the rack through a new relay, and no version ever goes
backwards.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from tests.daemon.test_aggregation import wait_until
from tests.daemon.test_daemon_processes import Processes

pytestmark = pytest.mark.slow

TOPOLOGY = """
hosts = ["ps", "a1", "a2", "a3"]
switches = ["torp", "tora", "core"]

[[links]]
a = "ps"
b = "torp"
mbps = 1000

[[links]]
a = "torp"
b = "core"
mbps = 1000

[[links]]
a = "tora"
b = "core"
mbps = 100

[[links]]
a = "a1"
b = "tora"
mbps = 2000

[[links]]
a = "a2"
b = "tora"
mbps = 1000

[[links]]
a = "a3"
b = "tora"
mbps = 1000
"""

N = 2_000_000  # float32: 8 MB


def _model(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full(N, float(version), dtype=np.float32), "v": np.array([version], dtype=np.float64)}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.reap()


def _check(result: tuple[int, dict[str, Any]], version: int) -> None:
    got, model = result
    assert got == version and int(model["v"][0]) == version
    assert float(model["w"][0]) == float(model["w"][-1]) == float(version)


def start_scheduler(procs: Processes, tmp_path: Path) -> dict[str, Any]:
    """The scheduler service as a process on :data:`TOPOLOGY`: its ready file's contents."""
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    return procs.start(
        "scheduler", "mlfabric.scheduler.service.cli", "--listen", "127.0.0.1:0", "--topology", str(topology)
    )


def test_relay_sigkilled_mid_fetch(procs: Processes, sockdir: str, tmp_path: Path) -> None:
    sched = start_scheduler(procs, tmp_path)
    daemons: dict[str, Daemon] = {}
    clients: list[Any] = []
    try:
        for host in ("ps", "a2", "a3"):
            config = DaemonConfig(
                host=host,
                scheduler=sched["address"],
                socket_path=os.path.join(sockdir, f"{host}.sock"),
                egress_rate=10e6 if host == "ps" else None,
            )
            daemons[host] = Daemon(config)
            daemons[host].start(timeout=20)
        relay = procs.start(
            "a1",
            "mlfabric.daemon.cli",
            "--host",
            "a1",
            "--scheduler",
            sched["address"],
            "--socket",
            os.path.join(sockdir, "a1.sock"),
            "--data-listen",
            "127.0.0.1:0",
        )
        server = mlfabric.register_as_server(
            "job", "ps0", _model(0), mlfabric.Params(), daemon=daemons["ps"].config.socket_path
        )
        clients.append(server)
        sockets = {"a1": relay["socket"], **{h: daemons[h].config.socket_path for h in ("a2", "a3")}}
        workers = {
            h: mlfabric.register_as_worker("job", name=h, daemon=s, wait=10) for h, s in sockets.items()
        }
        clients += workers.values()
        for host in ("a2", "a3"):  # the scheduler's choice: a1 (the fastest NIC) relays the rack
            route = wait_until(lambda h=host: daemons[h].models.route("job", "ps0"))
            assert (route.upstream_host, route.upstream_address) == ("a1", relay["data_address"])
            assert route.server_host == "ps" and route.chunk_bytes > 0
        pieces = -(-(N * 4 + 8) // route.chunk_bytes)  # GETs of one whole model

        server.model, server.version = _model(1), 1
        server.publish()
        with ThreadPoolExecutor(2) as pool:
            gets = [pool.submit(workers[h].get, "ps0", min_version=1, timeout=30) for h in ("a2", "a3")]
            # the relay's single fetch is under way through the shaped link: kill it
            wait_until(lambda: daemons["ps"].stats().models.get("server_pieces", 0) >= 1)
            procs.kill("a1")
            for f in gets:
                _check(f.result(), 1)
        for host in ("a2", "a3"):
            assert daemons[host].stats().models["relay_fallbacks"] == 1
        # the scheduler saw the relay's daemon go: a2 (first by name) relays the rack now
        wait_until(lambda: daemons["a3"].models.route("job", "ps0").upstream_host == "a2", timeout=20)
        gets_before = daemons["ps"].stats().models["server_pieces"]
        server.model, server.version = _model(2), 2
        server.publish()
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda h: workers[h].get("ps0", min_version=2, timeout=30), ("a2", "a3")))
        for r in results:
            _check(r, 2)
        assert daemons["ps"].stats().models["server_pieces"] == gets_before + pieces  # one copy
        # never backwards: an older floor gets the newest kept
        _check(workers["a3"].get("ps0", min_version=1), 2)
    finally:
        for c in clients:
            c.close()
        for d in daemons.values():
            d.stop()
