"""Shared steps of the end-to-end tests: start a job's roles, wait for them, finish them.

The tests differ in their cluster (policy, topology, faults) and their checks; how a server
and its workers are spawned on a :class:`~mlfabric.cluster.LocalCluster`, waited for and
stopped is the same, and lives here.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from mlfabric.cluster import LocalCluster


def wait_for(path: Path, proc: Any, timeout: float) -> None:
    """Wait until ``path`` exists; fail with ``proc``'s log if it exits or time runs out.

    Parameters
    ----------
    path : Path
        The file the process writes when it is ready.
    proc : ManagedProcess
        The process (``popen`` and ``log_tail()``), checked while waiting.
    timeout : float
        Seconds to wait at most.
    """
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.popen.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.02)


def read_outcome(
    out: Path, workers: Sequence[tuple[str, int]], pushes: int
) -> tuple[dict[int, list[dict[str, Any]]], dict[str, Any], list[str]]:
    """The workers' verdicts, the server's record and the worker updates it applied (each once).

    Reads ``worker<rank>.json`` of every worker and ``server.json`` from ``out``; checks every
    push has a verdict and no worker update was applied twice.

    Returns
    -------
    results : dict
        Rank -> the verdicts of its pushes.
    served : dict
        The server's record (``applied``: each payload it applied with its ``members``).
    members : list of str
        The worker update ids it applied, aggregates flattened.
    """
    results = {rank: json.loads((out / f"worker{rank}.json").read_text()) for _, rank in workers}
    served = json.loads((out / "server.json").read_text())
    assert sum(len(r) for r in results.values()) == len(workers) * pushes
    members = [m for a in served["applied"] for m in a["members"]]
    assert len(members) == len(set(members)), "a worker update was applied twice"
    return results, served, members


def applied_pushes(
    results: Mapping[int, Sequence[dict[str, Any]]], members: Collection[str], tau_max: int
) -> list[tuple[int, dict[str, Any]]]:
    """The pushes whose updates the server applied, checking every verdict against its memory.

    Every push resolved APPLIED, DROPPED or UNKNOWN (the last two with a reason); an APPLIED
    one was applied (and within ``tau_max``); one the server applied was never reported
    DROPPED. An UNKNOWN push counts when the server applied it (its aggregate may have reached
    the server: the model says whether it did).

    Parameters
    ----------
    results : Mapping[int, sequence of dict]
        Worker rank -> its pushes' verdicts (``index``, ``status``, ``delay``, ``reason``,
        ``update_id``), as the workers wrote them.
    members : collection of str
        The worker update ids the server applied (its aggregates' members, flattened).
    tau_max : int
        The job's bound on an applied push's delay.

    Returns
    -------
    list of (int, dict)
        (rank, push) of each push the model must include.
    """
    applied, worker_applied, unknown = [], set(), set()
    for rank, pushes in results.items():
        for p in pushes:
            assert p["status"] in ("APPLIED", "DROPPED", "UNKNOWN"), p
            if p["status"] != "APPLIED":
                assert p["reason"], f"{p['status']} without a reason: {p}"
            if p["status"] == "UNKNOWN":
                unknown.add(p["update_id"])
                if p["update_id"] not in members:
                    continue
            elif p["status"] == "DROPPED":
                continue
            else:
                assert p["delay"] <= tau_max, p
                worker_applied.add(p["update_id"])
            applied.append((rank, p))
    assert worker_applied <= set(members), "a push reported APPLIED was not applied"
    assert set(members) - worker_applied <= unknown, "a push applied was reported DROPPED"
    return applied


def spawn_workers(
    cluster: LocalCluster, command: Sequence[str], out: Path, workers: Sequence[tuple[str, int]], pushes: int
) -> list[Any]:
    """Start ``command OUT RANK PUSHES`` on each worker's host.

    Parameters
    ----------
    cluster : LocalCluster
        The running cluster.
    command : sequence of str
        The worker's command line before its arguments, e.g.
        ``[sys.executable, "roles.py", "worker"]``.
    out : Path
        The directory the workers write their results into.
    workers : sequence of (str, int)
        Each worker's host and rank.
    pushes : int
        Pushes per worker.

    Returns
    -------
    list of ManagedProcess
        The workers (named ``worker<rank>``), in the order of ``workers``.
    """
    return [
        cluster.spawn(host, [*command, str(out), str(rank), str(pushes)], name=f"worker{rank}")
        for host, rank in workers
    ]


def finish(server: Any, workers: Sequence[Any], timeout: float = 240) -> None:
    """Wait for every worker to exit 0, then stop the server and check it exits 0.

    Parameters
    ----------
    server : ManagedProcess
        The server process (terminated once the workers are done).
    workers : sequence of ManagedProcess
        The workers, each of which must exit 0 within ``timeout`` seconds.
    timeout : float
        Seconds each worker may take.
    """
    for w in workers:
        try:
            code = w.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{w.name} did not finish; its log:\n{w.log_tail()}")
        assert code == 0, f"{w.name} failed:\n{w.log_tail()}"
    server.popen.terminate()
    assert server.popen.wait(timeout=30) == 0, server.log_tail()
