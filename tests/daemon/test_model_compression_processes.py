"""A model that travels compressed (``Params(model_compression="fp16")``) through a relay, in pieces.

The scheduler service is a real process on the two-rack topology of
``test_model_relays_processes.py`` (``start_scheduler``): the server's host ``ps`` in one
rack, ``a1``, ``a2``, ``a3`` behind a 100 Mbit/s uplink in the other, ``a1`` the rack's
relay; the scheduler knows
the model's size, so its routes move the model in pieces (docs/model-relays.md). The daemons
run in this process (their stats are read), on loopback. Two jobs serve the same 4 MB float32
model from ``ps``, side by side: ``zip`` with ``model_compression="fp16"``, ``raw`` without.

The workers of ``zip`` (behind the relay, and one on the server's own host) get float32 tensors
equal to the fp16 rounding of the server's model, while the server's own model stays exact;
the bytes its daemon and the relay served are half those of ``raw``'s (the daemons' stats); a
replica of ``zip`` is refused (it needs the exact model); a published model whose encoding is
corrupt is refused naming the problem.
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
from mlfabric.aggregators.codecs import Fp16Codec
from mlfabric.daemon.config import DaemonConfig
from mlfabric.daemon.host import Daemon
from mlfabric.localclient import MlfabricError
from mlfabric.proto.v1 import local_pb2
from mlfabric.tensorio import to_memfd
from mlfabric.tensors import layouts_to_pb
from tests.daemon.test_aggregation import wait_until
from tests.daemon.test_daemon_processes import Processes
from tests.daemon.test_model_relays_processes import start_scheduler

pytestmark = pytest.mark.slow

N = 1_000_000  # float32: 4 MB raw, 2 MB as fp16 words


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(N).astype(np.float32), "b": rng.standard_normal(10)}


def _fp16(model: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    codec = Fp16Codec()
    return {k: codec.decode(codec.encode(v)) for k, v in model.items()}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    group = Processes(tmp_path)
    yield group
    group.reap()


def test_a_compressed_model_through_a_relay_in_pieces(procs: Processes, sockdir: str, tmp_path: Path) -> None:
    sched = start_scheduler(procs, tmp_path)
    daemons: dict[str, Daemon] = {}
    clients: list[Any] = []
    try:
        for host in ("ps", "a1", "a2", "a3"):
            config = DaemonConfig(
                host=host, scheduler=sched["address"], socket_path=os.path.join(sockdir, f"{host}.sock")
            )
            daemons[host] = Daemon(config)
            daemons[host].start(timeout=20)
        sock = {h: d.config.socket_path for h, d in daemons.items()}
        params = {"zip": mlfabric.Params(model_compression="fp16"), "raw": mlfabric.Params()}
        servers = {
            job: mlfabric.register_as_server(job, "ps0", _model(0), p, daemon=sock["ps"])
            for job, p in params.items()
        }
        clients += servers.values()
        workers = {
            (job, h): mlfabric.register_as_worker(job, name=h, daemon=sock[h], wait=10)
            for job in params
            for h in ("ps", "a1", "a2", "a3")
        }
        clients += workers.values()
        assert workers[("zip", "a2")].params.model_compression == "fp16"  # told at registration
        for job in params:
            for host in ("a2", "a3"):  # the scheduler's choice: a1 relays the rack, in pieces
                route = wait_until(lambda j=job, h=host: daemons[h].models.route(j, "ps0"))
                assert route.upstream_host == "a1" and route.chunk_bytes > 0

        exact = _model(1)
        for server in servers.values():
            server.model, server.version = {k: v.copy() for k, v in exact.items()}, 1
            server.publish()
        with ThreadPoolExecutor(4) as pool:
            gets = {
                key: pool.submit(w.get, "ps0", min_version=1, timeout=30)
                for key, w in workers.items()
                if key[1] != "a1"  # a1's own get would race the pieces it relays
            }
            got = {key: f.result() for key, f in gets.items()}
        got[("zip", "a1")] = workers[("zip", "a1")].get("ps0", min_version=1)
        got[("raw", "a1")] = workers[("raw", "a1")].get("ps0", min_version=1)
        rounded = _fp16(exact)
        for (job, host), (version, model) in got.items():
            assert version == 1, (job, host)
            want = rounded if job == "zip" else exact
            for name in exact:
                assert model[name].dtype == exact[name].dtype, (job, host, name)
                np.testing.assert_array_equal(model[name], want[name], err_msg=f"{job} at {host}")
        assert not np.array_equal(rounded["w"], exact["w"])
        for server in servers.values():  # the servers' own models stay exact
            for name in exact:
                np.testing.assert_array_equal(server.model[name], exact[name])

        # the bytes on the wire: the server's daemon served the relay (in pieces), the relay the
        # rack; fp16 half of the raw job's, which served the same model at the same versions
        raw_bytes = N * 4 + 10 * 8
        zip_bytes = N * 2 + 10 * 2
        ps, relay = daemons["ps"].stats(), daemons["a1"].stats()
        assert ps.models["server_pieces"] > 0 and relay.models["peer_pieces"] > 0
        for stats in (ps, relay):
            served, raw = stats.model_bytes_served, stats.model_raw_bytes_served
            assert served["fp16"] > 0 and served["fp16"] % zip_bytes == 0
            assert served["none"] == served["fp16"] // zip_bytes * raw_bytes  # as many copies
            assert abs(served["fp16"] / served["none"] - 0.5) < 1e-3
            assert raw["fp16"] == served["none"]
        assert daemons["a2"].stats().models["bytes"] == zip_bytes + raw_bytes  # the cache: one of each

        # a replica needs the exact model: refused for a job whose model travels rounded
        with pytest.raises(MlfabricError, match=r"model_compression='fp16'.*a replica needs the exact model"):
            mlfabric.register_as_replica("zip", "ps0", exact, daemon=sock["a3"], timeout=20)
        # ... and the job goes on without it: a push is applied, the next get is version 2
        handle = workers[("zip", "a2")].push("ps0", {k: np.ones_like(v) for k, v in exact.items()})
        assert servers["zip"].serve(max_updates=1, timeout=20) == 1
        assert handle.wait(timeout=20).status == "APPLIED"
        version, model = workers[("zip", "a3")].get("ps0", min_version=2, timeout=20)
        assert version == 2
        np.testing.assert_array_equal(model["w"], _fp16({"w": exact["w"] - 1})["w"])

        # a published model whose encoding is corrupt is refused, naming the problem
        server = servers["zip"]
        fd, layouts, total = to_memfd({"w": np.ones(4, np.float16)})
        (pb,) = layouts_to_pb(layouts)
        pb.dtype = "float32"
        pb.encoding.codec, pb.encoding.words, pb.encoding.members = "fp16", "int8", 1  # not fp16's words
        publish = local_pb2.PublishModel(version=2, tensors=[pb], payload_bytes=total, has_payload=True)
        server._client.send(local_pb2.LocalRequest(publish=publish), fd)
        os.close(fd)
        with pytest.raises(MlfabricError, match=r"published model: bad encoding: words: tensor 'w' \(fp16\)"):
            server.serve(timeout=10)
        assert workers[("zip", "a2")].get("ps0")[0] == 2  # the model served is still version 2
    finally:
        for c in clients:
            c.close()
        for d in daemons.values():
            d.stop()
