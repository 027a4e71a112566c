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
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from mlfabric.cluster import ClusterError, ManagedProcess, stop_processes, wait_for_ready_file
from mlfabric.daemon.transfers import REPORT_FIELDS
from mlfabric.testbed.cluster import CONTROL, Testbed

__all__ = ["TestbedCluster", "write_transfer_csv"]


class TestbedCluster:
    """A scheduler and one daemon per host, as processes inside a testbed's namespaces.

    Parameters
    ----------
    testbed : Testbed
        A testbed that is up.
    topology : str or Path
        The topology file the testbed was built from (the scheduler reads it too).
    policy : str
        ``"fair"`` or ``"stf"``.
    workdir : str or Path
        Sockets, ready files and logs of this run.
    hosts : sequence of str, optional
        Hosts that get a daemon (default: all).
    python : str
        Interpreter of the child processes.
    extra_scheduler_args : sequence of str
        More ``mlfabric scheduler`` arguments.
    ready_timeout : float
        Seconds to wait for each ready file.
    log_level : str
        Log level of the scheduler and the daemons (their logs go to ``workdir/logs``).

    Notes
    -----
    The constructor does no I/O; :meth:`start` launches and waits for every ready file,
    :meth:`stop` sends SIGTERM (SIGKILL after a grace period) and reaps every child.
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
        self.testbed = testbed
        self.topology = Path(topology)
        self.policy = policy
        self.workdir = Path(workdir)
        self.hosts = list(hosts) if hosts is not None else testbed.hosts
        self.python = python
        self.extra_scheduler_args = list(extra_scheduler_args)
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self.scheduler_address: str | None = None
        self.daemons: dict[str, dict[str, Any]] = {}
        self._procs: list[ManagedProcess] = []

    def start(self) -> TestbedCluster:
        """Start the scheduler in the control namespace, then every daemon; wait until ready."""
        for sub in ("logs", "ready", "sockets", "reports"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        try:
            ready = self.workdir / "ready" / "scheduler.json"
            sched = self._launch(
                CONTROL,
                "scheduler",
                [
                    *("scheduler", "--listen", f"{self.testbed.control_address()}:0"),
                    *("--topology", str(self.topology), "--policy", self.policy, "--ready-file", str(ready)),
                    *self.extra_scheduler_args,
                ],
            )
            self.scheduler_address = str(wait_for_ready_file(ready, sched, self.ready_timeout)["address"])
            pending = []
            for host in self.hosts:
                ready = self.workdir / "ready" / f"daemon-{host}.json"
                argv = [
                    "daemon",
                    "--host",
                    host,
                    "--scheduler",
                    self.scheduler_address,
                    "--socket",
                    self.socket(host),
                ]
                argv += ["--data-listen", f"{self.testbed.address(host)}:0", "--ready-file", str(ready)]
                argv += ["--report-file", str(self.report_file(host))]
                pending.append((host, ready, self._launch(host, f"daemon-{host}", argv)))
            for host, ready, proc in pending:
                self.daemons[host] = wait_for_ready_file(ready, proc, self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 10.0) -> None:
        """Terminate every child (training processes first, scheduler last) and reap it."""
        procs, self._procs = self._procs, []
        stop_processes(procs, grace)

    def __enter__(self) -> TestbedCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def socket(self, host: str) -> str:
        """The Unix socket of ``host``'s daemon (namespaces share the file system)."""
        return str(self.workdir / "sockets" / f"{host}.sock")

    def report_file(self, host: str) -> Path:
        """The JSON-lines file where ``host``'s daemon appends its transfer reports."""
        return self.workdir / "reports" / f"{host}.jsonl"

    def transfer_reports(self) -> list[dict[str, Any]]:
        """Every transfer report the daemons wrote so far, as dicts, host by host.

        Returns
        -------
        list of dict
            One per transfer, with the keys of
            :data:`mlfabric.daemon.transfers.REPORT_FIELDS`; a daemon that moved nothing adds
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

    def spawn(
        self, host: str, argv: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """Run a training process inside ``host``; ``MLFABRIC_DAEMON`` points it at that host's daemon."""
        if host not in self.hosts:
            raise ClusterError(f"unknown host '{host}' (hosts with a daemon: {', '.join(self.hosts)})")
        child_env = {**os.environ, **(env or {}), "MLFABRIC_DAEMON": self.socket(host)}
        return self._start(host, name or f"{host}-{len(self._procs)}", list(argv), child_env)

    def wait(self, proc: ManagedProcess, timeout: float) -> int:
        """Wait for a spawned process to exit; raise :class:`ClusterError` (with its log) if it fails."""
        try:
            code = proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(
                f"{proc.name} still running after {timeout:.0f}s; log:\n{proc.log_tail()}"
            ) from None
        if code != 0:
            raise ClusterError(f"{proc.name} exited with code {code}; log:\n{proc.log_tail()}")
        return code

    def check_alive(self) -> None:
        """Raise :class:`ClusterError` if the scheduler or a daemon has died."""
        for proc in self._procs:
            if proc.name.startswith(("scheduler", "daemon-")) and proc.popen.poll() is not None:
                raise ClusterError(
                    f"{proc.name} died with code {proc.popen.returncode}; log:\n{proc.log_tail()}"
                )

    def _launch(self, host: str, name: str, mlfabric_argv: list[str]) -> ManagedProcess:
        argv = [self.python, "-m", "mlfabric", "--log-level", self.log_level, *mlfabric_argv]
        return self._start(host, name, argv, dict(os.environ))

    def _start(self, host: str, name: str, argv: list[str], env: dict[str, str]) -> ManagedProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        popen = self.testbed.popen(
            host, argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        proc = ManagedProcess(name, popen, log_path, log)
        self._procs.append(proc)
        return proc


def write_transfer_csv(
    path: str | Path, reports: Sequence[Mapping[str, Any]], leading: Sequence[str] = ()
) -> None:
    """Write transfer reports (:meth:`TestbedCluster.transfer_reports`) as a CSV file.

    Parameters
    ----------
    path : str or Path
        The CSV file (overwritten).
    reports : sequence of mapping
        Report dicts with the keys of :data:`~mlfabric.daemon.transfers.REPORT_FIELDS`.
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
