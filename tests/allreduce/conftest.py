"""A real scheduler and real daemons on loopback (port 0) for the all-reduce tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlfabric.cluster import LocalCluster


def star_topology(hosts: list[str], mbps: int = 10_000) -> str:
    """A TOML star of ``hosts`` around one switch."""
    lines = [f"hosts = {hosts!r}".replace("'", '"'), 'switches = ["sw"]']
    for h in hosts:
        lines += ["[[links]]", f'a = "{h}"', 'b = "sw"', f"mbps = {mbps}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """Scheduler (``fair``) + daemons on hosts h0..h3; Unix sockets under a short temp dir."""
    workdir = Path(tempfile.mkdtemp(prefix="mlfar-"))
    topology = workdir / "topology.toml"
    topology.write_text(star_topology(["h0", "h1", "h2", "h3"]))
    c = LocalCluster(topology, policy="fair", workdir=workdir / "run", log_level="INFO")
    c.start()
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(workdir, ignore_errors=True)
