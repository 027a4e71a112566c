"""The model in pieces down a chain of relays (docs/model-relays.md, chunk pipelining).

In-process daemons on loopback (port 0) under the in-test scheduler, which sends the
``ModelRouteDirective``\\ s (with ``chunk_bytes``) by hand: ``ps`` -> ``r`` -> ``w1`` ->
``w2``. The server's daemon sends at 4 MB/s, so a 2 MB model takes half a second to leave it
and the relays' pieces are asked for while the rest still arrives.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from mlfabric.api import MlfabricError
from mlfabric.daemon.channels.frames import FrameError, FrameHeader, FrameLimits, check_header
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.proto.v1 import dataplane_pb2
from tests.daemon.conftest import FakeScheduler
from tests.daemon.test_model_relays import Cluster

N = 500_000  # float32: 2 MB
CHUNK = 128 << 10
PIECES = -(-(N * 4 + 8) // CHUNK)


def _model(version: int) -> dict[str, np.ndarray]:
    w = np.arange(N, dtype=np.float32) + np.float32(version)
    return {"w": w, "v": np.array([version], dtype=np.float64)}


def _check(result: tuple[int, dict[str, Any]], version: int) -> None:
    got, model = result
    assert got == version
    np.testing.assert_array_equal(model["w"], _model(version)["w"])
    assert int(model["v"][0]) == version


@pytest.fixture
def chain(make_daemon: Any, scheduler: FakeScheduler) -> Any:
    c = Cluster(make_daemon, ("r", "w1", "w2"), model=_model, ps={"egress_rate": 4e6})
    for host, upstream in (("r", "ps"), ("w1", "r"), ("w2", "w1")):
        c.route(scheduler, host, upstream, chunk_bytes=CHUNK)
    yield c
    c.close()


def test_the_model_moves_down_a_chain_in_pieces_one_copy_from_the_server(chain: Cluster) -> None:
    for version in (1, 2):
        chain.publish(version)
        with ThreadPoolExecutor(3) as pool:
            futures = {
                h: pool.submit(chain.workers[h].get, "ps0", min_version=version) for h in ("w2", "w1", "r")
            }
            for f in futures.values():
                _check(f.result(timeout=30), version)
        # the server's daemon sent one copy, piece by piece
        assert chain.models("ps")["server_pieces"] == version * PIECES
    for host in ("r", "w1"):  # each relay answered every piece of both versions once
        stats = chain.models(host)
        assert stats["peer_pieces"] == 2 * PIECES, (host, stats)
    # cut-through: the first relay forwarded pieces while the rest still came from the server
    assert chain.models("r")["pieces_ahead"] > 0
    assert chain.models("w2").get("relay_fallbacks", 0) == 0
    # kept: a floor at or below the cached version is answered locally
    _check(chain.workers["w2"].get("ps0", min_version=2), 2)
    assert chain.models("w2")["local_hits"] >= 1


def test_a_piece_of_a_version_no_longer_here_is_an_error_naming_both(chain: Cluster) -> None:
    chain.publish(1)
    _check(chain.workers["r"].get("ps0", min_version=1), 1)
    chain.publish(2)
    _check(chain.workers["r"].get("ps0", min_version=2), 2)
    pool = PeerPool(FrameLimits(), connect_timeout=2.0, send_attempts=1, retry_backoff=0.0)
    try:
        get = dataplane_pb2.FRAME_KIND_GET
        for host in ("ps", "r"):
            address = chain.daemons[host].data_address
            piece = FrameHeader(
                kind=get,
                job="job",
                server="ps0",
                min_version=1,
                exact_version=True,
                range_offset=CHUNK,
                range_bytes=CHUNK,
            )
            reply = pool.request(address, piece)
            assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR, host
            assert "piece of version 1" in reply.header.reason and "version 2 here now" in reply.header.reason
            # the same piece of the version here: its bytes
            piece.min_version = 2
            reply = pool.request(address, piece)
            assert reply.header.kind == dataplane_pb2.FRAME_KIND_MODEL
            assert (reply.header.version, reply.header.range_offset) == (2, CHUNK)
            assert reply.header.model_bytes == N * 4 + 8 and len(reply.payload) == CHUNK
            want = _model(2)["w"].tobytes()[CHUNK : 2 * CHUNK]
            assert bytes(reply.payload) == want
            reply.release()
            # past the end
            piece.range_offset = N * 4 + 9
            reply = pool.request(address, piece)
            assert reply.header.kind == dataplane_pb2.FRAME_KIND_ERROR
            assert "past the end" in reply.header.reason
    finally:
        pool.close()


def test_a_piece_header_must_lie_inside_its_model() -> None:
    model = dataplane_pb2.FRAME_KIND_MODEL
    h = FrameHeader(kind=model, model_bytes=8, range_offset=4)
    check_header(h, FrameLimits(), payload_bytes=4)  # the last piece, without the layout
    with pytest.raises(FrameError, match=r"piece \[4, 9\) out of range of a 8-byte model"):
        check_header(h, FrameLimits(), payload_bytes=5)
    first = FrameHeader(kind=model, model_bytes=8)
    first.tensors.add(name="w", dtype="float32", shape=[2], offset=0, nbytes=8)
    check_header(first, FrameLimits(), payload_bytes=4)  # the layout describes the whole model
    first.tensors[0].shape[0] = 3
    first.tensors[0].nbytes = 12
    with pytest.raises(FrameError, match="out of range of a 8-byte payload"):
        check_header(first, FrameLimits(), payload_bytes=4)


def test_a_model_over_the_daemons_payload_limit_is_refused_naming_both(
    make_daemon: Any, scheduler: FakeScheduler
) -> None:
    # pieces pass the frame limit one by one: the whole model's size is checked on the first
    c = Cluster(make_daemon, ("w1",), model=_model, w1={"max_payload_bytes": 1 << 20})
    try:
        c.route(scheduler, "w1", "ps", chunk_bytes=CHUNK)
        c.publish(1)
        with pytest.raises(MlfabricError, match=r"a model of 2000008 bytes exceeds the limit of 1048576"):
            c.workers["w1"].get("ps0", min_version=1, timeout=10)
        assert c.models("w1")["entries"] == 0
    finally:
        c.close()
