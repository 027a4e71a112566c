"""A TCP proxy to cut one daemon's scheduler session while both processes stay up (tests only).

:class:`ProxiedCluster` starts the daemon of one host (``proxied``) with its ``--scheduler``
pointing at a :class:`Proxy` in the test process; :meth:`Proxy.cut` closes the connections
it carries (both sides), so the scheduler sees that daemon's session end and the daemon
reconnects (through the proxy again), as after a network blip.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

from mlfabric.cluster import LocalCluster, ManagedProcess


class Proxy:
    """Forward TCP connections from a loopback port to ``target`` ("host:port")."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.cuts = 0
        self._refuse_until = 0.0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            if time.monotonic() < self._refuse_until:  # held: the daemon stays away
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), name="proxy-pump", daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def connections(self) -> int:
        """Connections carried so far (a reconnection adds one)."""
        with self._lock:
            return len(self._pairs)

    def cut(self, hold: float = 0.0) -> None:
        """Break every connection carried now; refuse new ones for ``hold`` seconds."""
        self._refuse_until = time.monotonic() + hold
        with self._lock:
            pairs = list(self._pairs)
            self.cuts += 1
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        """Stop accepting and break every connection."""
        self._listener.close()
        self.cut()


class ProxiedCluster(LocalCluster):
    """A :class:`LocalCluster` whose host ``proxied`` reaches the scheduler through a :class:`Proxy`."""

    proxied = "rep"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxy: Proxy | None = None

    def _launch(self, host: str | None, name: str, mlfabric_argv: list[str]) -> ManagedProcess:
        if name == f"daemon-{self.proxied}":
            assert self.scheduler_address is not None
            self.proxy = Proxy(self.scheduler_address)
            argv = list(mlfabric_argv)
            argv[argv.index("--scheduler") + 1] = self.proxy.address
            mlfabric_argv = argv
        return super()._launch(host, name, mlfabric_argv)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the processes, then the proxy."""
        super().stop(grace)
        if self.proxy is not None:
            self.proxy.close()
