"""A real scheduler and real daemons on loopback (port 0) for the all-reduce tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mlfabric.cluster import LocalCluster

HOSTS = ["h0", "h1", "h2", "h3"]


def star_topology(hosts: list[str], mbps: int = 10_000, rates: dict[str, int] | None = None) -> str:
    """A TOML star of ``hosts`` around one switch (NICs of ``mbps``, or ``rates[host]``)."""
    lines = ["hosts = [" + ", ".join(f'"{h}"' for h in hosts) + "]", 'switches = ["sw"]']
    for h in hosts:
        lines += ["[[links]]", f'a = "{h}"', 'b = "sw"', f"mbps = {(rates or {}).get(h, mbps)}"]
    return "\n".join(lines) + "\n"


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """``make_cluster(mbps=10_000, enforce=False, rates=None)``: scheduler + daemons on h0..h3, started."""
    made: list[tuple[LocalCluster, Path]] = []

    def make(mbps: int = 10_000, enforce: bool = False, rates: dict[str, int] | None = None) -> LocalCluster:
        workdir = Path(tempfile.mkdtemp(prefix="mlfar-"))  # short: Unix socket paths
        topology = workdir / "topology.toml"
        topology.write_text(star_topology(HOSTS, mbps, rates))
        c = LocalCluster(
            topology, policy="fair", workdir=workdir / "run", enforce_nic_rates=enforce, ready_timeout=120
        )
        made.append((c, workdir))
        return c.start()

    yield make
    for c, workdir in made:
        c.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    """Scheduler (``fair``) + daemons on hosts h0..h3, unshaped loopback."""
    return make_cluster()
