"""One line of a transfer-report file: what the daemon writes and the testbed reads (DESIGN §5).

A daemon started with ``--report-file`` appends every ``TransferReport`` it sends to the
scheduler as one JSON object with the keys :data:`REPORT_FIELDS`
(:class:`mlfabric.daemon.reports.TransferReportLog`); experiments and the namespace testbed
(:mod:`mlfabric.testbed.launch`) read those files. Both sides import the definition from here.
"""

from __future__ import annotations

from typing import Any

from mlfabric.proto.v1 import control_pb2

__all__ = ["REPORT_FIELDS", "report_record"]

#: Keys of one line of a report file, in order (the ``TransferReport`` fields).
REPORT_FIELDS = (
    "update_id",
    "src_host",
    "dst_host",
    "bytes",
    "start",
    "end",
    "throughput",
    "ok",
    "error",
    "outcome",
    "delay",
    "server_version",
    "reason",
)


def report_record(report: Any) -> dict[str, Any]:
    """One ``TransferReport`` as a JSON-able dict with the keys :data:`REPORT_FIELDS`.

    Parameters
    ----------
    report : control_pb2.TransferReport
        A report as the daemon sends it to the scheduler (MLfabric §4: daemons report each
        transfer's bytes, times and measured throughput).

    Returns
    -------
    dict
        ``outcome`` is the enum's short name (``"APPLIED"``, ``"DROPPED"`` or
        ``"UNSPECIFIED"``); every other value is the field's value.

    Examples
    --------
    >>> r = control_pb2.TransferReport(update_id="w0/1", bytes=8, ok=True,
    ...                                outcome=control_pb2.OUTCOME_APPLIED)
    >>> rec = report_record(r)
    >>> rec["update_id"], rec["bytes"], rec["ok"], rec["outcome"]
    ('w0/1', 8, True, 'APPLIED')
    """
    record: dict[str, Any] = {name: getattr(report, name) for name in REPORT_FIELDS}
    record["outcome"] = control_pb2.Outcome.Name(report.outcome).removeprefix("OUTCOME_")
    return record
