"""The README's "Using it by hand": the digits example's server and worker say what they do
(issue 27 item 6: they printed nothing), and ``--help`` keeps its usage examples' lines."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from mlfabric.cluster import LocalCluster, python_module

TOPOLOGY = """hosts = ["h0", "h1"]
switches = ["sw"]
links = [{a = "h0", b = "sw", gbps = 1}, {a = "h1", b = "sw", gbps = 1}]
"""


def test_help_keeps_the_usage_examples_on_their_lines() -> None:
    out = subprocess.run(
        [*python_module("mlfabric.examples.digits"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        "    python -m mlfabric.examples.digits server --job digits --name ps0 --status-file /tmp/ps.json"
        in lines
    )
    assert "--progress S" in out.stdout


@pytest.mark.slow
def test_server_and_worker_say_what_they_do(tmp_path: Path) -> None:
    (tmp_path / "topology.toml").write_text(TOPOLOGY)
    example = [*python_module("mlfabric.examples.digits"), "--hidden", "16", "--progress", "0.5"]
    with LocalCluster(tmp_path / "topology.toml", policy="stf", workdir=tmp_path / "run") as cluster:
        server = cluster.spawn("h0", [*example, "server", "--tau-max", "8"], name="server")
        worker = cluster.spawn(
            "h1", [*example, "worker", "--rank", "0", "--world", "1", "--max-pushes", "40"]
        )
        assert cluster.wait(worker, timeout=120) == 0
        time.sleep(1.0)  # a progress line of the server after the pushes
        server.popen.send_signal(signal.SIGINT)
        server.popen.wait(timeout=30)
        said_server, said_worker = server.log_path.read_text(), worker.log_path.read_text()
    assert "server ps0 of job digits: serving (tau_max 8)" in said_server, said_server
    assert "server ps0: version" in said_server and "accuracy" in said_server
    assert "; stopped" in said_server
    assert "worker0: registered with job digits (servers: ps0)" in said_worker, said_worker
    assert "worker0: 40 pushes to ps0: " in said_worker and "; done" in said_worker
