"""The daemon as a service: metrics endpoint, systemd notifications, reload (DESIGN §3).

:class:`DaemonService` is what ``mlfabric daemon`` adds around a
:class:`~mlfabric.daemon.host.Daemon`: ``/metrics`` on ``--metrics-port``
(:mod:`mlfabric.daemon.metrics`), ``READY=1`` once the scheduler welcomed the daemon,
``STATUS=`` lines, ``WATCHDOG=1`` from the main loop, ``STOPPING=1`` at shutdown, and
SIGHUP (``systemctl reload``): the config file is read again; its log level takes
effect at once, every other changed key is named in the log and the status as needing a
restart (the daemon's sockets and session stay up, so no push is lost by a reload).
"""

from __future__ import annotations

import argparse
import logging
import threading
from typing import TYPE_CHECKING, Any

from mlfabric.config import ConfigError, load_config
from mlfabric.systemd import Notifier, watchdog_interval

if TYPE_CHECKING:
    from mlfabric.daemon.host import Daemon

__all__ = ["DaemonService"]

_LOG = logging.getLogger("mlfabric.daemon")


class DaemonService:
    """The service side of one daemon process (no I/O before :meth:`start_metrics`).

    Parameters
    ----------
    args : argparse.Namespace
        The parsed ``mlfabric daemon`` arguments (``config``, ``metrics_port``, ...).
    notifier : Notifier, optional
        sd_notify sender (default: from ``$NOTIFY_SOCKET``).
    """

    def __init__(self, args: argparse.Namespace, notifier: Notifier | None = None) -> None:
        self.args = args
        self.notifier = Notifier() if notifier is None else notifier
        self.reload_requested = threading.Event()
        watchdog = watchdog_interval()
        #: seconds between two runs of :meth:`tick_once` by the main loop
        self.tick = min(0.5, watchdog) if watchdog else 0.5
        self._watchdog = watchdog is not None
        self._http: Any = None
        self.metrics_port: int | None = None
        self._status = ""

    def start_metrics(self, daemon: Daemon) -> None:
        """Serve ``/metrics`` of ``daemon`` when ``--metrics-port`` is set (OSError when it cannot bind).

        The registry holds one :class:`~mlfabric.daemon.metrics.DaemonCollector`, which reads
        ``daemon.stats()`` at every scrape.
        """
        if self.args.metrics_port is None:
            return
        from prometheus_client import CollectorRegistry, start_http_server

        from mlfabric.daemon.metrics import DaemonCollector

        registry = CollectorRegistry()
        registry.register(DaemonCollector(daemon.stats))
        host = self.args.data_listen.rpartition(":")[0].strip("[]") or "127.0.0.1"
        self._http, _ = start_http_server(self.args.metrics_port, addr=host, registry=registry)
        self.metrics_port = self._http.server_port

    def ready_info(self) -> dict[str, Any]:
        """Extra ready-file fields (``metrics_port`` when serving metrics)."""
        return {} if self.metrics_port is None else {"metrics_port": self.metrics_port}

    def ready(self, daemon: Daemon) -> None:
        """``READY=1``: registered with the scheduler and serving."""
        self._status = _status(daemon)
        self.notifier.ready(self._status)

    def tick_once(self, daemon: Daemon) -> None:
        """From the main loop: watchdog ping, status refresh, a pending reload."""
        if self._watchdog:
            self.notifier.watchdog()
        if self.reload_requested.is_set():
            self.reload_requested.clear()
            self.reload(daemon)
        status = _status(daemon)
        if status != self._status:
            self._status = status
            self.notifier.status(status)

    def reload(self, daemon: Daemon) -> list[str]:
        """Re-read ``--config``; apply the log level; the keys that need a restart."""
        self.notifier.reloading()
        if not self.args.config:
            self.notifier.ready(f"reloaded (no config file); {_status(daemon)}")
            return []
        try:
            values = load_config(self.args.config, "daemon")
        except ConfigError as exc:
            _LOG.error("reload failed, config unchanged: %s", exc)
            self.notifier.ready(f"reload failed: {exc}".splitlines()[0])
            return []
        level = values.pop("log_level", None)
        if level is not None and level != self.args.log_level:
            logging.getLogger().setLevel(level)
            self.args.log_level = level
            _LOG.warning("reload: log level now %s", level)
        restart = sorted(k for k, v in values.items() if getattr(self.args, k, v) != v)
        if restart:
            _LOG.warning("reload: changed keys need a restart to take effect: %s", ", ".join(restart))
        else:
            _LOG.info("reloaded %s", self.args.config)
        note = f" (restart needed for {', '.join(restart)})" if restart else ""
        self.notifier.ready(f"reloaded{note}; {_status(daemon)}")
        return restart

    def stopping(self) -> None:
        """``STOPPING=1``."""
        self.notifier.stopping()

    def stop(self) -> None:
        """Stop serving ``/metrics``."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _status(daemon: Daemon) -> str:
    return f"host {daemon.host}: data plane {daemon.data_address}, scheduler {daemon.config.scheduler}"
