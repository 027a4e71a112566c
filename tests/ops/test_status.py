"""``mlfabric status`` against a running scheduler: hosts, jobs, rates, the straggler, health."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def _status(address: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlfabric", "status", "--scheduler", address, *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_names_the_straggler(ops_cluster: Any) -> None:
    c = ops_cluster
    roles = subprocess.Popen(
        [sys.executable, str(HERE / "live_roles.py"), c.daemons["h0"]["socket"], c.daemons["h1"]["socket"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert roles.stdout is not None and roles.stdout.readline().strip() == "ready"
        out = _status(c.scheduler["address"], "--json")
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        text = _status(c.scheduler["address"]).stdout
    finally:
        roles.terminate()
        roles.wait(30)
    assert st["health"] == "SERVING"
    assert [d["host"] for d in st["daemons"]] == ["h0", "h1"]
    (job,) = st["jobs"]
    assert job["name"] == "ops"
    # int64 fields are JSON numbers, not strings (issue 27 item 10)
    assert type(job["tau_max"]) is int and type(job["servers"][0]["version"]) is int
    assert [(s["name"], s["host"]) for s in job["servers"]] == [("ps0", "h0")]
    workers = {w["name"]: w for w in job["workers"]}
    assert set(workers) == {"fast", "slow"} and {w["host"] for w in workers.values()} == {"h1"}
    assert workers["fast"]["pushes_per_second"] > workers["slow"]["pushes_per_second"] > 0
    assert workers["slow"]["mean_interval_seconds"] > workers["fast"]["mean_interval_seconds"] > 0
    assert [(b["job"], b["kind"], b["name"]) for b in st["holding_back"] if b["kind"] == "worker"] == [
        ("ops", "worker", "slow")
    ]
    up = next(ls for ls in st["links"] if (ls["src"], ls["dst"]) == ("h1", "sw"))
    assert up["configured_bytes_per_second"] == 1e9 / 8 and up["measured_bytes_per_second"] > 0
    assert "holding back" in text and "job ops: worker slow: mean push interval" in text
    assert "worker fast on h1" in text


def test_status_of_no_scheduler_fails_naming_it(tmp_path: Path) -> None:
    out = _status("127.0.0.1:1", "--timeout", "2")
    assert out.returncode == 1
    assert "scheduler 127.0.0.1:1: UNAVAILABLE" in out.stderr
    assert "mutual TLS" not in out.stderr  # nothing listens: no talk of certificates
