"""``mlfabric scheduler`` as a real process: ready file, health, SIGTERM, bad topology."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlfabric.proto.v1 import control_pb2 as pb
from mlfabric.proto.v1 import control_pb2_grpc as pb_grpc
from mlfabric.scheduler.service.core import CLIENT_CHANNEL_OPTIONS

TOPOLOGY = """
hosts = ["ps", "w0"]
switches = ["tor"]

[[links]]
a = "ps"
b = "tor"
gbps = 1.0

[[links]]
a = "w0"
b = "tor"
mbps = 200
"""


def _scheduler(*argv: str) -> list[str]:
    # the module's own entry point: same arguments as `mlfabric scheduler`, without
    # importing the other subcommands
    return [sys.executable, "-m", "mlfabric.scheduler.service.cli", *argv]


@pytest.fixture
def scheduler(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, object]]]:
    topology = tmp_path / "cluster.toml"
    topology.write_text(TOPOLOGY)
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        _scheduler(
            "--listen",
            "127.0.0.1:0",
            "--topology",
            str(topology),
            "--policy",
            "fair",
            "--ready-file",
            str(ready),
            "--metrics-port",
            "0",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no ready file"
            time.sleep(0.05)
        yield proc, json.loads(ready.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_scheduler_process_serves_and_exits_0_on_signal(scheduler, sig: signal.Signals) -> None:
    proc, info = scheduler
    assert info["pid"] == proc.pid
    address = str(info["address"])
    assert address.startswith("127.0.0.1:") and not address.endswith(":0")
    with grpc.insecure_channel(address, options=CLIENT_CHANNEL_OPTIONS) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        hello = pb.DaemonMessage(hello=pb.Hello(host="w0", data_address="127.0.0.1:1"))
        replies = pb_grpc.SchedulerStub(channel).Session(iter([hello]), timeout=10)
        assert next(replies).welcome.policy == "fair"
    with urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "mlfabric_updates_ready_total 0.0" in text and "mlfabric_decision_seconds_count" in text
    proc.send_signal(sig)
    assert proc.wait(timeout=10) == 0


@pytest.mark.slow
def test_bad_topology_file_is_named_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('hosts = ["a"]\n[[links]]\na = "a"\nb = "zz"\ngbps = 1\n')
    out = subprocess.run(_scheduler("--topology", str(bad)), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bad.toml" in out.stderr and "'zz'" in out.stderr


@pytest.mark.slow
def test_unknown_policy_names_the_known_ones(tmp_path: Path) -> None:
    out = subprocess.run(_scheduler("--policy", "nope"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'nope'" in out.stderr and "fair" in out.stderr


@pytest.mark.slow
def test_port_in_use_is_a_clear_error(scheduler) -> None:
    _, info = scheduler
    out = subprocess.run(
        _scheduler("--listen", str(info["address"])), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert f"cannot listen on {info['address']}" in out.stderr


@pytest.mark.slow
def test_sigterm_ends_open_daemon_streams_cleanly_and_exits(scheduler) -> None:
    """A daemon's open stream ends with OK on SIGTERM (not cancelled at the grace's end), and the
    process exits 0."""
    import threading

    proc, info = scheduler
    hold = threading.Event()

    def messages() -> Iterator[pb.DaemonMessage]:
        yield pb.DaemonMessage(hello=pb.Hello(host="w0", data_address="127.0.0.1:1"))
        hold.wait(30)  # the daemon keeps its stream open

    with grpc.insecure_channel(str(info["address"]), options=CLIENT_CHANNEL_OPTIONS) as channel:
        replies = pb_grpc.SchedulerStub(channel).Session(messages(), timeout=30)
        assert next(replies).welcome.policy == "fair"
        proc.send_signal(signal.SIGTERM)
        try:
            rest = list(replies)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            rest, code = [], exc.code()
        finally:
            hold.set()
    assert (code, rest) == (grpc.StatusCode.OK, [])
    assert proc.wait(timeout=10) == 0
    assert "Exception not handled" not in proc.communicate(timeout=10)[1]
