"""Link check: one measured transfer per link against its configured rate (DESIGN §5, §6).

:func:`plan_link_checks` (pure) picks, for every directed link, a pair of hosts whose path
crosses it and the rate that path should deliver (its bottleneck). :func:`measure_transfer`
runs one bulk TCP transfer between two hosts of a live :class:`~mlfabric.testbed.Testbed`
with :mod:`mlfabric.testbed.probe` and returns the throughput the receiver saw.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from mlfabric.scheduler.core.graph import bottleneck, hosts, shortest_path
from mlfabric.testbed.cluster import Testbed

__all__ = ["LinkCheck", "Measurement", "measure_transfer", "plan_link_checks"]

BITS_PER_BYTE = 8


@dataclass(frozen=True)
class LinkCheck:
    """One directed link to check with a transfer from ``src`` to ``dst``.

    Attributes
    ----------
    link : (str, str)
        The link ``(u, v)`` under test (direction ``u -> v``).
    src, dst : str
        Hosts whose shortest path crosses ``link``.
    expected : float
        The path's bottleneck rate, bytes/s (the link's own rate when it is the bottleneck).
    """

    link: tuple[str, str]
    src: str
    dst: str
    expected: float


@dataclass(frozen=True)
class Measurement:
    """A measured transfer: bytes, receiver-side seconds and throughput (bytes/s)."""

    src: str
    dst: str
    bytes: int
    seconds: float
    throughput: float


def plan_link_checks(graph: nx.DiGraph) -> list[LinkCheck]:
    """For every directed link, the host pair that best exercises it.

    Among the host pairs whose shortest path crosses the link, take the one whose path
    bottleneck is highest (ideally the link itself), ties broken by host order.

    Parameters
    ----------
    graph : networkx.DiGraph
        A bandwidth graph.

    Returns
    -------
    list of LinkCheck
        One per directed link that some host pair crosses, in edge order.

    Examples
    --------
    >>> from mlfabric.scheduler.core.graph import star
    >>> g = star(["a", "b"], 50e6)
    >>> [(c.link, c.src, c.dst, c.expected) for c in plan_link_checks(g)][:2]
    [(('sw', 'a'), 'b', 'a', 6250000.0), (('sw', 'b'), 'a', 'b', 6250000.0)]
    """
    names = hosts(graph)
    best: dict[tuple[str, str], LinkCheck] = {}
    for src in names:
        for dst in names:
            if src == dst:
                continue
            try:
                path = shortest_path(graph, src, dst)
            except ValueError:
                continue
            _, rate = bottleneck(graph, path)
            for link in itertools.pairwise(path):
                current = best.get(link)
                if current is None or rate > current.expected:
                    best[link] = LinkCheck(link, src, dst, rate)
    return [best[e] for e in graph.edges if e in best]


def _wait_ready(path: Path, proc: subprocess.Popen[str], timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            data: dict[str, str] = json.loads(path.read_text())
            return data
        if proc.poll() is not None:
            raise RuntimeError(f"probe receiver exited with {proc.returncode} before it was ready")
        time.sleep(0.02)
    raise TimeoutError(f"probe receiver not ready after {timeout} s")


def measure_transfer(
    testbed: Testbed, src: str, dst: str, nbytes: int, *, timeout: float = 120.0
) -> Measurement:
    """Send ``nbytes`` from ``src`` to ``dst`` over the testbed's shaped links; measure it.

    Parameters
    ----------
    testbed : Testbed
        A testbed that is up.
    src, dst : str
        Host names.
    nbytes : int
        Bytes to move; a few seconds' worth at the link rate gives a steady measurement.
    timeout : float
        Seconds before the transfer is abandoned.

    Returns
    -------
    Measurement
        Throughput from the receiver's first to last byte.
    """
    with tempfile.TemporaryDirectory(prefix="mlfabric-probe-") as tmp:
        ready = Path(tmp) / "ready.json"
        probe = [sys.executable, "-m", "mlfabric.testbed.probe"]
        listen = f"{testbed.address(dst)}:0"
        recv = testbed.popen(
            dst,
            [*probe, "recv", "--listen", listen, "--ready-file", str(ready), "--timeout", str(timeout)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            address = _wait_ready(ready, recv, timeout=30.0)["address"]
            testbed.exec(src, [*probe, "send", "--to", address, "--bytes", str(nbytes)], timeout=timeout)
            out, _ = recv.communicate(timeout=timeout)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()
        if recv.returncode != 0:
            raise RuntimeError(f"probe receiver on {dst} failed with {recv.returncode}")
        result = json.loads(out.strip().splitlines()[-1])
    seconds = result["last"] - result["first"]
    return Measurement(src, dst, int(result["bytes"]), seconds, float(result["throughput"]))
