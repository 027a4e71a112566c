"""systemd integration: the readiness protocol (``sd_notify``) and the watchdog.

Under a ``Type=notify`` unit systemd sets ``$NOTIFY_SOCKET`` to a Unix datagram socket
(a path, or ``@name`` for an abstract one); a service sends it newline-separated
``KEY=VALUE`` lines: ``READY=1`` once it serves (only then is the unit *active*),
``RELOADING=1`` / ``READY=1`` around a reload, ``STOPPING=1`` when it starts to shut
down, ``STATUS=...`` a one-line human status (``systemctl status``), ``WATCHDOG=1`` at
least every ``$WATCHDOG_USEC`` microseconds when the unit has ``WatchdogSec=``.

Why the stdlib and not a library: the protocol is one ``sendto`` of a few bytes on an
``AF_UNIX``/``SOCK_DGRAM`` socket (documented as a stable interface in sd_notify(3)); the
libraries (``systemd-python`` needs libsystemd headers and a compiler, ``sdnotify`` is
the same twenty lines unmaintained since 2017) add a dependency for no behaviour. Outside
systemd (no ``$NOTIFY_SOCKET``) every call is a no-op, so the processes run unchanged by
hand, in tests and under other supervisors.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["JournalFormatter", "Notifier", "configure_logging", "watchdog_interval"]


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET`` (a no-op when it is unset).

    Parameters
    ----------
    environ : mapping, optional
        Where ``NOTIFY_SOCKET`` is read (default ``os.environ``); read once, at construction.

    Examples
    --------
    >>> n = Notifier(environ={})
    >>> n.enabled, n.notify(READY=1)
    (False, False)
    >>> import socket, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "notify")
    >>> rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); rx.bind(path)
    >>> Notifier(environ={"NOTIFY_SOCKET": path}).notify(READY=1, STATUS="serving")
    True
    >>> rx.recv(100)
    b'READY=1\\nSTATUS=serving'
    >>> rx.close()
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket: a leading NUL byte on the wire
        self._address = "\0" + address[1:] if address.startswith("@") else address

    @property
    def enabled(self) -> bool:
        """Whether a notify socket was given (the process runs under ``Type=notify``)."""
        return bool(self._address)

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (``notify(READY=1, STATUS="...")``); False when disabled.

        Raises
        ------
        ValueError
            A value holds a newline (it would start a new field).
        OSError
            The socket exists but refuses the datagram (systemd gone).
        """
        if not self._address:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value)
            if "\n" in text:
                raise ValueError(f"sd_notify field {key} must be one line, got {text!r}")
            lines.append(f"{key}={text}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), self._address)
        return True

    def ready(self, status: str) -> bool:
        """``READY=1`` with a ``STATUS=`` line: the service serves."""
        return self.notify(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        """A ``STATUS=`` line: what the service is doing now."""
        return self.notify(STATUS=status)

    def reloading(self) -> bool:
        """``RELOADING=1``: a reload began (send :meth:`ready` when it is done)."""
        return self.notify(RELOADING=1, STATUS="reloading")

    def stopping(self) -> bool:
        """``STOPPING=1``: the shutdown began."""
        return self.notify(STOPPING=1, STATUS="stopping")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the event loop is alive."""
        return self.notify(WATCHDOG=1)


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``$WATCHDOG_USEC``, or None when off.

    ``$WATCHDOG_PID``, when set, must be this process (``pid``, default ``os.getpid()``).

    Examples
    --------
    >>> watchdog_interval({"WATCHDOG_USEC": "10000000"}, pid=1)
    5.0
    >>> watchdog_interval({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "2"}, pid=1) is None
    True
    >>> watchdog_interval({}) is None
    True
    """
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = env.get("WATCHDOG_PID", "")
    if owner and int(owner) != (os.getpid() if pid is None else pid):
        return None
    return int(usec) / 2e6


#: syslog priorities of the logging levels (the journal reads a ``<N>`` line prefix)
_PRIORITIES = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))


class JournalFormatter(logging.Formatter):
    """Prefixes each line with its syslog priority (``<3>`` error ... ``<7>`` debug).

    systemd's journal reads the prefix from a service's stderr (``SyslogLevelPrefix=``,
    on by default), so ``journalctl -p warning`` filters by level.

    Examples
    --------
    >>> rec = logging.LogRecord("mlfabric", logging.WARNING, __file__, 1, "slow link", None, None)
    >>> JournalFormatter("%(levelname)s %(message)s").format(rec)
    '<4>WARNING slow link'
    """

    def format(self, record: logging.LogRecord) -> str:
        """The record's line with its priority prefix."""
        prio = next((p for level, p in _PRIORITIES if record.levelno >= level), 7)
        return f"<{prio}>{super().format(record)}"


def configure_logging(level: str, environ: Mapping[str, str] | None = None) -> None:
    """Log to stderr at ``level``; under systemd (``$JOURNAL_STREAM``) with journal priorities.

    Under systemd the time stamp is left to the journal.
    """
    env = os.environ if environ is None else environ
    handler = logging.StreamHandler()
    if env.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler])
