"""Run mlfabric on a testbed: the scheduler, one daemon per host, training processes (DESIGN §3, §6).

:class:`TestbedCluster` is :class:`mlfabric.cluster.LocalCluster` on a real kernel network:
the scheduler runs in the testbed's control namespace (reachable from every host over the
unshaped control network), each host's daemon runs in the host's namespace with its data
plane on the host's shaped NIC, and training processes run next to their daemon. Ports are
chosen by the kernel (port 0) and learned from ready files, per the CLI contract in
DEVELOPERS.md. The scheduler and daemons run as ``python -m mlfabric SUBCOMMAND`` (which
imports only that subcommand's module). Each daemon appends its transfer reports to
``workdir/reports/<host>.jsonl`` (``--report-file``); :meth:`TestbedCluster.transfer_reports`
reads them back.

Examples
--------
With root and a testbed that is up::

    with TestbedCluster(testbed, "cluster.toml", policy="stf", workdir=tmp) as cluster:
        server = cluster.spawn("ps", [sys.executable, "train.py", "server"])
        workers = [cluster.spawn(w, [sys.executable, "train.py", "worker"]) for w in ("w0", "w1")]
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from mlfabric.cluster import LocalCluster
from mlfabric.testbed.cluster import CONTROL, Testbed
from mlfabric.wire.reports import REPORT_FIELDS

__all__ = ["TestbedCluster", "write_transfer_csv"]


class TestbedCluster(LocalCluster):
    """A scheduler and one daemon per host, as processes inside a testbed's namespaces.

    :class:`~mlfabric.cluster.LocalCluster` with its processes placed in the testbed: the
    scheduler in the control namespace, each daemon in its host's namespace with its data
    plane on the host's address, transfer reports in ``workdir/reports/<host>.jsonl``.

    Parameters
    ----------
    testbed : Testbed
        A testbed that is up.
    topology : str or Path
        The topology file the testbed was built from (the scheduler reads it too).
    policy, workdir, hosts, python, extra_scheduler_args, ready_timeout, log_level
        As for :class:`~mlfabric.cluster.LocalCluster` (``hosts`` defaults to the testbed's).
    """

    __test__ = False

    def __init__(
        self,
        testbed: Testbed,
        topology: str | Path,
        *,
        policy: str,
        workdir: str | Path,
        hosts: Sequence[str] | None = None,
        python: str = sys.executable,
        extra_scheduler_args: Sequence[str] = (),
        ready_timeout: float = 60.0,
        log_level: str = "INFO",
    ) -> None:
        super().__init__(
            topology,
            policy=policy,
            workdir=workdir,
            hosts=hosts if hosts is not None else testbed.hosts,
            python=python,
            extra_scheduler_args=extra_scheduler_args,
            ready_timeout=ready_timeout,
            log_level=log_level,
        )
        self.testbed = testbed

    def report_file(self, host: str) -> Path:
        """The JSON-lines file where ``host``'s daemon appends its transfer reports."""
        return self.workdir / "reports" / f"{host}.jsonl"

    def transfer_reports(self) -> list[dict[str, Any]]:
        """Every transfer report the daemons wrote so far, as dicts, host by host.

        Returns
        -------
        list of dict
            One per transfer, with the keys of
            :data:`mlfabric.wire.reports.REPORT_FIELDS`; a daemon that moved nothing adds
            none. A line still being written (a daemon killed mid-line) is skipped.
        """
        reports = []
        for host in self.hosts:
            path = self.report_file(host)
            if not path.exists():
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    reports.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # only the last line of a killed daemon can be partial
        return reports

    def _scheduler_listen(self) -> str:
        return f"{self.testbed.control_address()}:0"

    def _data_listen(self, host: str) -> str:
        return f"{self.testbed.address(host)}:0"

    def _daemon_args(self, host: str) -> list[str]:
        return ["--report-file", str(self.report_file(host))]

    def _popen(
        self, host: str | None, argv: list[str], env: dict[str, str], log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        return self.testbed.popen(
            CONTROL if host is None else host,
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def write_transfer_csv(
    path: str | Path, reports: Sequence[Mapping[str, Any]], leading: Sequence[str] = ()
) -> None:
    """Write transfer reports (:meth:`TestbedCluster.transfer_reports`) as a CSV file.

    Parameters
    ----------
    path : str or Path
        The CSV file (overwritten).
    reports : sequence of mapping
        Report dicts with the keys of :data:`~mlfabric.wire.reports.REPORT_FIELDS`.
    leading : sequence of str
        Extra keys of the dicts (e.g. ``"policy"``) written as the first columns.

    Examples
    --------
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "transfers.csv")
    >>> write_transfer_csv(path, [{"policy": "stf", "update_id": "w0/1"}], leading=["policy"])
    >>> open(path).read().splitlines()[1]
    'stf,w0/1,,,,,,,,,,,,'
    """
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[*leading, *REPORT_FIELDS], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(reports)
