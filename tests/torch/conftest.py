"""A real scheduler and real daemons on loopback (port 0) for the PyTorch integration tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlfabric.cluster import LocalCluster

HOSTS = ["h0", "h1"]


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """Scheduler (``stf``) + daemons on h0 (the servers) and h1 (the workers), unshaped loopback."""
    workdir = Path(tempfile.mkdtemp(prefix="mlft-"))  # short: Unix socket paths
    topology = workdir / "topology.toml"
    lines = ["hosts = [" + ", ".join(f'"{h}"' for h in HOSTS) + "]", 'switches = ["sw"]']
    for h in HOSTS:
        lines += ["[[links]]", f'a = "{h}"', 'b = "sw"', "mbps = 10000"]
    topology.write_text("\n".join(lines) + "\n")
    c = LocalCluster(topology, policy="stf", workdir=workdir / "run", ready_timeout=120)
    try:
        yield c.start()
    finally:
        c.stop()
        shutil.rmtree(workdir, ignore_errors=True)
