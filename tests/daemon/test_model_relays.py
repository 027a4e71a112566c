"""Model relays in the daemons: a version floor on ``get``, the model cache, relays (docs/model-relays.md).

In-process daemons on loopback (port 0) under the in-test scheduler, which sends the
``ModelRouteDirective``\\ s by hand; the server and the workers are this process, through the
public API. The relay SIGKILLed is a real ``mlfabric daemon`` process.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.api import MlfabricError
from mlfabric.daemon.channels.frames import FrameHeader, FrameLimits
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.daemon.host import Daemon
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from tests.daemon.conftest import FakeScheduler
from tests.daemon.test_aggregation import wait_until

MODEL = {"w": np.zeros((4, 4), dtype=np.float32), "b": np.zeros(3, dtype=np.float64)}


def _model(version: int) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, float(version)) for k, v in MODEL.items()}


class Cluster:
    """A server on ``ps`` and one worker per other daemon given."""

    def __init__(self, make_daemon: Any, hosts: tuple[str, ...], model: Any = None, **config: Any) -> None:
        self.model = model or _model
        self.daemons: dict[str, Daemon] = {h: make_daemon(h, **config.get(h, {})) for h in ("ps", *hosts)}
        self.server = mlfabric.register_as_server(
            "job", "ps0", self.model(0), mlfabric.Params(), daemon=self.daemons["ps"].config.socket_path
        )
        self.workers = {
            h: mlfabric.register_as_worker(
                "job", name=f"w-{h}", daemon=self.daemons[h].config.socket_path, wait=5
            )
            for h in hosts
        }

    def publish(self, version: int) -> None:
        """Publish ``version`` and wait until the server's daemon has it (publishing is one way)."""
        self.server.model = self.model(version)
        self.server.version = version
        self.server.publish()
        handoff = self.daemons["ps"].serving.handoff("job", "ps0")
        snap = handoff.wait_published(version, 10) if handoff is not None else None
        assert snap is not None and snap.version >= version

    def route(self, scheduler: FakeScheduler, host: str, upstream: str, chunk_bytes: int = 0) -> None:
        up, ps = self.daemons[upstream], self.daemons["ps"]
        route = control_pb2.ModelRouteDirective(
            job="job",
            server="ps0",
            upstream_host=upstream,
            upstream_address=up.data_address if isinstance(up, Daemon) else up,
            server_host="ps",
            server_address=ps.data_address,
            chunk_bytes=chunk_bytes,
        )
        scheduler.send(host, control_pb2.Directive(model_route=route))
        wait_until(lambda: self.daemons[host].models.route("job", "ps0") is not None)

    def models(self, host: str) -> dict[str, int]:
        return self.daemons[host].stats().models

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        self.server.close()


@pytest.fixture
def cluster(make_daemon: Any) -> Any:
    c = Cluster(make_daemon, ("r", "w1", "w2"))
    yield c
    c.close()


def _check(result: tuple[int, dict[str, Any]], version: int) -> None:
    got, model = result
    assert got == version
    for k, v in _model(version).items():
        np.testing.assert_array_equal(model[k], v)


def test_a_get_with_a_floor_is_served_from_the_cache(cluster: Cluster) -> None:
    cluster.publish(1)
    w1 = cluster.workers["w1"]
    _check(w1.get("ps0", min_version=1), 1)
    assert cluster.models("w1")["fetches"] == 1
    frames = cluster.daemons["ps"].stats().received_frames
    _check(w1.get("ps0", min_version=1), 1)
    _check(w1.get("ps0", min_version=0), 1)
    stats = cluster.models("w1")
    assert stats["fetches"] == 1 and stats["local_hits"] == 2  # no second network fetch
    assert cluster.daemons["ps"].stats().received_frames == frames
    assert stats["entries"] == 1 and stats["bytes"] == 16 * 4 + 3 * 8
    # without a floor: the server's current model, fetched as before relays
    cluster.publish(2)
    _check(w1.get("ps0"), 2)
    assert cluster.models("w1")["fetches"] == 2
    _check(w1.get("ps0", min_version=2), 2)  # kept: from the cache
    assert cluster.models("w1")["fetches"] == 2


def test_concurrent_gets_on_one_daemon_fetch_once(make_daemon: Any) -> None:
    c = Cluster(make_daemon, ("w1",))
    extra = [
        mlfabric.register_as_worker("job", name=f"x{i}", daemon=c.daemons["w1"].config.socket_path, wait=5)
        for i in range(3)
    ]
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(w.get, "ps0", min_version=3, timeout=10) for w in [c.workers["w1"], *extra]
            ]
            time.sleep(0.3)  # all four wait for version 3, one fetch under way
            c.publish(3)
            for f in futures:
                _check(f.result(), 3)
        stats = c.models("w1")
        assert stats["fetches"] == 1, stats  # single-flight
        assert c.models("ps")["server_gets"] == 1
    finally:
        for w in extra:
            w.close()
        c.close()


def test_two_workers_behind_a_relay_one_get_at_the_server(cluster: Cluster, scheduler: FakeScheduler) -> None:
    for host in ("w1", "w2"):
        cluster.route(scheduler, host, "r")
    for version in (1, 2):
        cluster.publish(version)
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(cluster.workers[h].get, "ps0", min_version=version) for h in ("w1", "w2")]
            for f in futures:
                _check(f.result(), version)
        assert cluster.models("ps")["server_gets"] == version  # one per version, not two
    relay = cluster.models("r")
    assert relay["relayed"] == 4 and relay["fetches"] == 2
    # the relay's own worker is served from its cache
    _check(cluster.workers["r"].get("ps0", min_version=2), 2)
    assert cluster.models("r")["fetches"] == 2 and cluster.models("ps")["server_gets"] == 2


def test_a_floor_waits_for_a_newer_publish_and_errors_naming_the_versions(cluster: Cluster) -> None:
    cluster.publish(1)
    w1 = cluster.workers["w1"]
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(w1.get("ps0", min_version=3, timeout=10)))
    thread.start()
    time.sleep(0.3)
    cluster.publish(2)  # not enough
    time.sleep(0.2)
    assert not result
    cluster.publish(3)
    thread.join(10)
    _check(result[0], 3)
    with pytest.raises(MlfabricError) as err:
        w1.get("ps0", min_version=9, timeout=0.5)
    assert err.value.code == "unavailable"
    assert "min_version 9" in str(err.value) and "version 3" in str(err.value)
    # at the server's host the floor is honoured too
    ps_worker = mlfabric.register_as_worker(
        "job", name="w-ps", daemon=cluster.daemons["ps"].config.socket_path
    )
    try:
        with pytest.raises(MlfabricError, match=r"min_version 4 not reached.*version 3"):
            ps_worker.get("ps0", min_version=4, timeout=0.3)
        _check(ps_worker.get("ps0", min_version=3), 3)
    finally:
        ps_worker.close()
    # never backwards: an older floor is answered with the newest kept
    _check(w1.get("ps0", min_version=1), 3)


def test_bad_floors_and_unknown_servers_are_named(cluster: Cluster) -> None:
    cluster.publish(1)
    with pytest.raises(MlfabricError, match="min_version -1 is negative") as err:
        cluster.workers["w1"].get("ps0", min_version=-1)
    assert err.value.code == "bad_request"
    pool = PeerPool(FrameLimits(), connect_timeout=2.0, send_attempts=1, retry_backoff=0.0)
    try:
        kind = dataplane_pb2.FRAME_KIND_GET
        for host in ("ps", "r"):
            address = cluster.daemons[host].data_address
            reply = pool.request(address, FrameHeader(kind=kind, job="job", server="ps0", min_version=-2))
            assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
            assert "min_version -2 is negative" in reply.header.reason
            reply = pool.request(address, FrameHeader(kind=kind, job="job", server="nope", min_version=1))
            assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
            assert "'nope'" in reply.header.reason, reply.header.reason
    finally:
        pool.close()


def test_an_unreachable_relay_falls_back_to_the_server(
    cluster: Cluster, scheduler: FakeScheduler, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    cluster.daemons["gone"] = dead  # type: ignore[assignment]
    cluster.route(scheduler, "w1", "gone")
    cluster.publish(1)
    _check(cluster.workers["w1"].get("ps0", min_version=1, timeout=10), 1)
    stats = cluster.models("w1")
    assert stats["relay_fallbacks"] == 1 and stats["fetches"] == 2
