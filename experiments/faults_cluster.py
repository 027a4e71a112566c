"""A :class:`~mlfabric.cluster.LocalCluster` whose processes can be signalled and started again.

Used by ``faults.py``: every process is known by name (``scheduler``, ``daemon-<host>``,
or a name given to :meth:`FaultCluster.spawn_role`); :meth:`FaultCluster.restart` signals
the current process of that name, waits for it to exit and starts it again with the same
arguments: a daemon on the same socket (and a fresh data port), the scheduler on the same
address it had (so daemons reconnect to it), a training process with the same command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlfabric.cluster import ClusterError, LocalCluster, ManagedProcess, wait_for_ready_file
from mlfabric.testbed.launch import TestbedCluster


class Restartable:
    """Mixin for a :class:`~mlfabric.cluster.LocalCluster` (or a subclass): restart by name;
    only ``aggregator_host``'s daemon may aggregate."""

    if TYPE_CHECKING:  # provided by LocalCluster
        scheduler_address: str | None
        ready_timeout: float

        def processes(self) -> list[ManagedProcess]: ...
        def socket(self, host: str) -> str: ...
        def spawn(
            self,
            host: str,
            argv: Sequence[str],
            *,
            name: str | None = None,
            env: Mapping[str, str] | None = None,
        ) -> ManagedProcess: ...
        def _start_process(
            self, host: str | None, name: str, argv: list[str], env: dict[str, str]
        ) -> ManagedProcess: ...

    def __init__(self, *args: Any, aggregator_host: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aggregator_host = aggregator_host
        self._how: dict[str, tuple[str | None, list[str], dict[str, str]]] = {}

    def _daemon_args(self, host: str) -> list[str]:
        args: list[str] = super()._daemon_args(host)  # type: ignore[misc]
        if self.aggregator_host is not None and host != self.aggregator_host:
            args.append("--no-aggregator")
        return args

    def _launch(self, host: str | None, name: str, mlfabric_argv: list[str]) -> ManagedProcess:
        proc: ManagedProcess = super()._launch(host, name, mlfabric_argv)  # type: ignore[misc]
        self._how[name] = (host, list(proc.popen.args), dict(os.environ))  # type: ignore[arg-type]
        return proc

    def spawn_role(self, name: str, host: str, argv: Sequence[str]) -> ManagedProcess:
        """:meth:`spawn` a training process that :meth:`restart` can start again."""
        proc = self.spawn(host, argv, name=name)
        env = {**os.environ, "MLFABRIC_DAEMON": self.socket(host)}
        self._how[name] = (host, list(argv), env)
        return proc

    def current(self, name: str) -> ManagedProcess:
        """The latest process started under ``name``."""
        for proc in reversed(self.processes()):
            if proc.name == name:
                return proc
        raise ClusterError(f"no process named {name!r}")

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the current process ``name``."""
        self.current(name).popen.send_signal(sig)

    def restart(self, name: str, sig: int, down: float = 0.0) -> str:
        """Signal ``name``, wait for it to exit, wait ``down`` s, start it again; a note on anything odd."""
        proc = self.current(name)
        note = ""
        proc.popen.send_signal(sig)
        try:
            proc.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            note = f"did not exit within 15 s of signal {sig}; killed"
            proc.popen.kill()
            proc.popen.wait()
        if not note and sig == signal.SIGTERM and proc.popen.returncode not in (0, -signal.SIGTERM):
            note = f"exit code {proc.popen.returncode} after SIGTERM"
        if proc._log is not None:
            proc._log.close()
            proc._log = None
        time.sleep(down)
        host, argv, env = self._how[name]
        ready = _ready_file(argv)
        if ready is not None:
            ready.unlink(missing_ok=True)
        if name == "scheduler":  # the same address, so that every daemon finds it again
            assert self.scheduler_address is not None
            argv[argv.index("--listen") + 1] = self.scheduler_address
        new = self._start_process(host, name, argv, env)
        if ready is not None:
            wait_for_ready_file(ready, new, self.ready_timeout)
        return note

    def dead(self) -> list[str]:
        """Names of scheduler/daemon processes that are not running now (should be none)."""
        latest = {p.name: p for p in self.processes()}
        return [
            n
            for n, p in latest.items()
            if n.startswith(("scheduler", "daemon-")) and p.popen.poll() is not None
        ]


class FaultCluster(Restartable, LocalCluster):
    """A LocalCluster on loopback whose processes :meth:`Restartable.restart` starts again."""


class TestbedFaultCluster(Restartable, TestbedCluster):
    """The same on the namespace testbed (:class:`~mlfabric.testbed.launch.TestbedCluster`)."""


def _ready_file(argv: Sequence[str]) -> Path | None:
    return Path(argv[list(argv).index("--ready-file") + 1]) if "--ready-file" in argv else None
