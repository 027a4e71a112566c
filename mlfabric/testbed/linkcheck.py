"""Link check: one measured transfer per link against its configured rate (DESIGN §5, §6).

:func:`plan_link_checks` (pure) picks, for every directed link, a pair of hosts whose path
crosses it and the rate that path should deliver (its bottleneck). :func:`measure_transfer`
runs one bulk TCP transfer between two hosts of a live :class:`~mlfabric.testbed.Testbed`
with :mod:`mlfabric.testbed.probe` and returns the throughput the receiver saw.
:func:`measure_concurrent` runs many such transfers at once (e.g. every host sending to the
next, :func:`ring_pairs`), as an experiment's traffic does: an experiment that claims a link
rate prints what the testbed delivered with that many flows on this machine's cores.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from mlfabric.cluster import python_module
from mlfabric.scheduler.core.graph import bottleneck, hosts, shortest_path
from mlfabric.testbed.cluster import Testbed

__all__ = [
    "ConcurrentCheck",
    "LinkCheck",
    "Measurement",
    "measure_concurrent",
    "measure_transfer",
    "plan_link_checks",
    "ring_pairs",
]

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
        probe = python_module("mlfabric.testbed.probe")
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


def ring_pairs(names: list[str]) -> list[tuple[str, str]]:
    """Every host sending to the next one (the last to the first): one flow out of and into each.

    Examples
    --------
    >>> ring_pairs(["a", "b", "c"])
    [('a', 'b'), ('b', 'c'), ('c', 'a')]
    """
    return [(a, names[(i + 1) % len(names)]) for i, a in enumerate(names)]


@dataclass(frozen=True)
class ConcurrentCheck:
    """Concurrent transfers against their paths' configured rates.

    Attributes
    ----------
    measurements : tuple of Measurement
        One per flow.
    expected : tuple of float
        Per flow, its path's configured bottleneck (bytes/s).
    """

    measurements: tuple[Measurement, ...]
    expected: tuple[float, ...]

    def ratios(self) -> list[float]:
        """Per flow, the measured throughput over the configured rate."""
        return [m.throughput / e for m, e in zip(self.measurements, self.expected, strict=True)]

    def summary(self) -> str:
        """One line: flows, configured rates, the median and worst fraction delivered.

        Examples
        --------
        >>> m = Measurement("a", "b", 10**6, 1.0, 0.9 * 125e6)
        >>> ConcurrentCheck((m, m), (125e6, 125e6)).summary()
        'link check: 2 concurrent flows at 1000 Mbit/s configured: 0.90 of the rate (worst 0.90)'
        """
        ratios = sorted(self.ratios())
        rates = sorted({f"{e * BITS_PER_BYTE / 1e6:g}" for e in self.expected})
        median = ratios[len(ratios) // 2]
        return (
            f"link check: {len(ratios)} concurrent flows at {'/'.join(rates)} Mbit/s configured: "
            f"{median:.2f} of the rate (worst {ratios[0]:.2f})"
        )


def measure_concurrent(
    testbed: Testbed,
    graph: nx.DiGraph,
    pairs: list[tuple[str, str]],
    seconds: float = 2.0,
    *,
    timeout: float = 120.0,
) -> ConcurrentCheck:
    """Run one bulk TCP transfer per ``(src, dst)`` pair, all at once; measure each.

    Each flow moves ``seconds`` worth of bytes at its path's configured bottleneck (so the
    flows end at about the same time and overlap the whole way).

    Parameters
    ----------
    testbed : Testbed
        A testbed that is up.
    graph : networkx.DiGraph
        Its bandwidth graph (the configured rates).
    pairs : list of (src, dst)
        The flows (e.g. :func:`ring_pairs`).
    seconds : float
        About how long each flow runs.
    timeout : float
        Seconds before the transfers are abandoned.

    Returns
    -------
    ConcurrentCheck
    """
    expected = tuple(bottleneck(graph, shortest_path(graph, a, b))[1] for a, b in pairs)
    probe = python_module("mlfabric.testbed.probe")
    receivers: list[subprocess.Popen[str]] = []
    senders: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="mlfabric-probe-") as tmp:
        try:
            addresses = []
            for i, (_, dst) in enumerate(pairs):
                ready = Path(tmp) / f"ready{i}.json"
                argv = [*probe, "recv", "--listen", f"{testbed.address(dst)}:0"]
                recv = testbed.popen(
                    dst,
                    [*argv, "--ready-file", str(ready), "--timeout", str(timeout)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                receivers.append(recv)
                addresses.append(_wait_ready(ready, recv, timeout=30.0)["address"])
            for (src, _), address, rate in zip(pairs, addresses, expected, strict=True):
                nbytes = max(1 << 20, int(rate * seconds))
                argv = [*probe, "send", "--to", address, "--bytes", str(nbytes)]
                senders.append(testbed.popen(src, argv, stdout=subprocess.DEVNULL))
            results = []
            for (src, dst), recv in zip(pairs, receivers, strict=True):
                out, _ = recv.communicate(timeout=timeout)
                if recv.returncode != 0:
                    raise RuntimeError(f"probe receiver on {dst} failed with {recv.returncode}")
                r = json.loads(out.strip().splitlines()[-1])
                results.append(
                    Measurement(src, dst, int(r["bytes"]), r["last"] - r["first"], float(r["throughput"]))
                )
            for sender in senders:
                sender.wait(timeout=timeout)
        finally:
            for proc in (*receivers, *senders):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return ConcurrentCheck(tuple(results), expected)
