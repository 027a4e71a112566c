"""The daemon's transfer-report file (``mlfabric daemon --report-file``; DESIGN §5).

:class:`TransferReportLog` appends every ``TransferReport`` the daemon sends to the scheduler
to a JSON-lines file, one :func:`~mlfabric.wire.reports.report_record` per line, for
experiments to collect.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import IO, Any

from mlfabric.wire.reports import report_record

__all__ = ["TransferReportLog"]


class TransferReportLog:
    """Appends every transfer report to a file, one JSON object per line, flushed per line.

    Parameters
    ----------
    path : str
        The file (appended to; created by :meth:`start`).
    opener : callable
        ``opener(path) -> text file`` (tests may pass their own).

    Notes
    -----
    The constructor does no I/O: :meth:`start` opens the file, :meth:`stop` closes it. Lines
    are written under a lock, so transfers finishing at once do not interleave.

    Examples
    --------
    >>> import io
    >>> from mlfabric.proto.v1 import control_pb2
    >>> buf = io.StringIO()
    >>> log = TransferReportLog("unused", opener=lambda path: buf)
    >>> log.start()
    >>> log.write(control_pb2.TransferReport(update_id="w0/1", src_host="w0", dst_host="ps"))
    >>> json.loads(buf.getvalue())["dst_host"]
    'ps'
    """

    def __init__(self, path: str, opener: Callable[[str], IO[str]] | None = None) -> None:
        self.path = path
        self._opener = opener or (lambda p: open(p, "a", encoding="utf-8"))  # noqa: SIM115
        self._lock = threading.Lock()
        self._file: IO[str] | None = None

    def start(self) -> None:
        """Open the file for appending.

        Raises
        ------
        OSError
            The file cannot be opened.
        """
        with self._lock:
            if self._file is None:
                self._file = self._opener(self.path)

    def write(self, report: Any) -> None:
        """Append ``report`` (a ``TransferReport``) as one JSON line and flush it.

        Raises
        ------
        RuntimeError
            Before :meth:`start` or after :meth:`stop`.
        """
        line = json.dumps(report_record(report), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"transfer report log {self.path} is not open")
            self._file.write(line)
            self._file.flush()

    def stop(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            file.close()
