"""Launch a whole mlfabric cluster as real processes on this machine (loopback).

:class:`LocalCluster` starts one ``mlfabric scheduler`` and one ``mlfabric daemon`` per host
of a topology, each a real process speaking real gRPC and TCP on 127.0.0.1 with ports
chosen by the kernel (port 0, learned from each process's ready file), and runs training
processes next to a host's daemon. It is what ``mlfabric demo`` and the integration tests
use; the namespace testbed (:mod:`mlfabric.testbed`) is the same thing on a real kernel
network.

Examples
--------
>>> from mlfabric.cluster import LocalCluster
>>> with LocalCluster("topology.toml", policy="stf", workdir="/tmp/run") as cluster:  # doctest: +SKIP
...     server = cluster.spawn("ps", ["python", "train.py", "server"])
...     cluster.wait(server, timeout=60)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

__all__ = [
    "ClusterError",
    "LocalCluster",
    "ManagedProcess",
    "ingress_bytes",
    "python_module",
    "read_reports",
    "stop_processes",
    "wait_for_ready_file",
]


def python_module(module: str, python: str = sys.executable) -> list[str]:
    """The command line that runs ``python -m module`` from the installed package, wherever it runs.

    ``-P`` (Python 3.11) keeps the working directory off ``sys.path``: run from the folder
    that holds a clone named ``mlfabric``, a plain ``python -m mlfabric`` would import that
    folder (a namespace package without ``__version__``) instead of the installed package.

    Examples
    --------
    >>> python_module("mlfabric", python="python3")
    ['python3', '-P', '-m', 'mlfabric']
    """
    return [python, "-P", "-m", module]


class ClusterError(RuntimeError):
    """A process of the cluster failed to start or died; the message quotes its log."""


@dataclass
class ManagedProcess:
    """A child process of the cluster with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] | None = field(default=None, repr=False)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the process's output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def wait_for_ready_file(path: Path, proc: ManagedProcess, timeout: float) -> dict[str, Any]:
    """Wait until ``proc`` writes its JSON ready file; raise :class:`ClusterError` if it dies first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.popen.poll() is not None:
            raise ClusterError(
                f"{proc.name} exited with code {proc.popen.returncode} before it was ready; "
                f"its log ({proc.log_path}):\n{proc.log_tail()}"
            )
        time.sleep(0.02)
    raise ClusterError(
        f"{proc.name} not ready after {timeout:.0f}s; its log ({proc.log_path}):\n{proc.log_tail()}"
    )


def stop_processes(procs: Sequence[ManagedProcess], grace: float = 10.0) -> None:
    """SIGTERM every process (last started first), SIGKILL what is left after ``grace`` s; reap all."""
    for proc in reversed(procs):
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in reversed(procs):
        try:
            proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()
        if proc._log is not None:
            proc._log.close()


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """Every transfer report in the daemons' report files (``*.jsonl``) under ``directory``.

    A line cut short by a daemon that was killed while writing it is skipped.
    """
    reports = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                reports.append(dict(json.loads(line)))
            except json.JSONDecodeError:
                continue
    return reports


def ingress_bytes(reports: Sequence[Mapping[str, Any]], host: str) -> int:
    """Bytes delivered into ``host`` by successful transfers (updates and aggregates).

    Examples
    --------
    >>> ingress_bytes([{"dst_host": "ps", "bytes": 8, "ok": True},
    ...                {"dst_host": "x", "bytes": 8, "ok": True},
    ...                {"dst_host": "ps", "bytes": 8, "ok": False}], "ps")
    8
    """
    return sum(int(r["bytes"]) for r in reports if r.get("dst_host") == host and r.get("ok"))


class LocalCluster:
    """A scheduler and one daemon per host, as child processes on loopback.

    Parameters
    ----------
    topology : str or Path
        A topology TOML file (see :mod:`mlfabric.scheduler.core.graph`); its hosts get daemons.
    policy : str
        The scheduler's policy (``"fair"`` or ``"stf"``).
    workdir : str or Path
        Where sockets, ready files and logs go (one run's private directory).
    hosts : sequence of str, optional
        The hosts to start daemons on (default: every host of the topology).
    enforce_nic_rates : bool
        Daemons enforce their host's NIC rates from the topology (token buckets), so that
        loopback has the topology's bottlenecks.
    python : str
        The interpreter for the child processes.
    extra_scheduler_args : sequence of str
        More arguments for ``mlfabric scheduler``.
    report_files : bool
        Daemons append their transfer reports to ``workdir/reports/<host>.jsonl``
        (:func:`read_reports` reads them back).
    ready_timeout : float
        Seconds to wait for each ready file.
    log_level : str
        Log level of the scheduler and the daemons (their logs go to ``workdir/logs``).

    Notes
    -----
    The constructor does no I/O; :meth:`start` launches, :meth:`stop` terminates every
    child (SIGTERM, then SIGKILL after a grace period) and reaps it. Where the processes run
    and which addresses they listen on are the hooks ``_popen``, ``_scheduler_listen``,
    ``_data_listen`` and ``_daemon_args`` (the namespace testbed overrides them).
    """

    def __init__(
        self,
        topology: str | Path,
        *,
        policy: str,
        workdir: str | Path,
        hosts: Sequence[str] | None = None,
        enforce_nic_rates: bool = False,
        python: str = sys.executable,
        extra_scheduler_args: Sequence[str] = (),
        report_files: bool = False,
        ready_timeout: float = 30.0,
        log_level: str = "INFO",
    ) -> None:
        self.topology = Path(topology)
        self.policy = policy
        self.workdir = Path(workdir)
        self._hosts = list(hosts) if hosts is not None else None
        self.enforce_nic_rates = enforce_nic_rates
        self.python = python
        self.extra_scheduler_args = list(extra_scheduler_args)
        self.report_files = report_files
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self.scheduler_address: str | None = None
        self.daemons: dict[str, dict[str, Any]] = {}
        self._procs: list[ManagedProcess] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def hosts(self) -> list[str]:
        """The hosts that have (or will have) a daemon."""
        if self._hosts is None:
            from mlfabric.scheduler.core.graph import hosts, load_topology

            self._hosts = hosts(load_topology(self.topology))
        return list(self._hosts)

    def start(self) -> Self:
        """Start the scheduler, then every daemon; return when all are ready."""
        for sub in ("logs", "ready", "sockets", "reports"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        try:
            ready = self.workdir / "ready" / "scheduler.json"
            sched = self._launch(
                None,
                "scheduler",
                [
                    *("scheduler", "--listen", self._scheduler_listen()),
                    *("--topology", str(self.topology), "--policy", self.policy, "--ready-file", str(ready)),
                    *self.extra_scheduler_args,
                ],
            )
            self.scheduler_address = str(wait_for_ready_file(ready, sched, self.ready_timeout)["address"])
            pending = []
            for host in self.hosts:
                ready = self.workdir / "ready" / f"daemon-{host}.json"
                argv = [
                    *("daemon", "--host", host, "--scheduler", self.scheduler_address),
                    *("--socket", self.socket(host), "--data-listen", self._data_listen(host)),
                    *("--ready-file", str(ready), *self._daemon_args(host)),
                ]
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

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ processes
    def socket(self, host: str) -> str:
        """The Unix socket path of ``host``'s daemon."""
        return str(self.workdir / "sockets" / f"{host}.sock")

    def spawn(
        self, host: str, argv: Sequence[str], *, name: str | None = None, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """Run a training process on ``host``: ``MLFABRIC_DAEMON`` points it at that host's daemon."""
        if host not in self.hosts:
            raise ClusterError(f"unknown host '{host}' (hosts with a daemon: {', '.join(self.hosts)})")
        child_env = {**os.environ, **(env or {}), "MLFABRIC_DAEMON": self.socket(host)}
        return self._start_process(host, name or f"{host}-{len(self._procs)}", list(argv), child_env)

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

    def processes(self) -> list[ManagedProcess]:
        """Every child process started so far (and not yet stopped)."""
        return list(self._procs)

    def check_alive(self) -> None:
        """Raise :class:`ClusterError` if the scheduler or a daemon has died."""
        for proc in self._procs:
            if proc.name.startswith(("scheduler", "daemon-")) and proc.popen.poll() is not None:
                raise ClusterError(
                    f"{proc.name} died with code {proc.popen.returncode}; its log:\n{proc.log_tail()}"
                )

    # ------------------------------------------------------------------ hooks
    def _scheduler_listen(self) -> str:
        """Where the scheduler listens."""
        return "127.0.0.1:0"

    def _data_listen(self, host: str) -> str:
        """Where ``host``'s daemon's data plane listens."""
        return "127.0.0.1:0"

    def _daemon_args(self, host: str) -> list[str]:
        """More ``mlfabric daemon`` arguments for ``host``."""
        args = ["--topology", str(self.topology), "--enforce-nic-rates"] if self.enforce_nic_rates else []
        if self.report_files:
            args += ["--report-file", str(self.workdir / "reports" / f"{host}.jsonl")]
        return args

    def _popen(
        self, host: str | None, argv: list[str], env: dict[str, str], log: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (None: the scheduler's place)."""
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def _launch(self, host: str | None, name: str, mlfabric_argv: list[str]) -> ManagedProcess:
        argv = [*python_module("mlfabric", self.python), "--log-level", self.log_level, *mlfabric_argv]
        return self._start_process(host, name, argv, dict(os.environ))

    def _start_process(
        self, host: str | None, name: str, argv: list[str], env: dict[str, str]
    ) -> ManagedProcess:
        log_path = self.workdir / "logs" / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            popen = self._popen(host, argv, env, log)
        except BaseException:
            log.close()
            raise
        proc = ManagedProcess(name, popen, log_path, log)
        self._procs.append(proc)
        return proc
