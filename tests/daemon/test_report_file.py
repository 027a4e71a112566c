"""``mlfabric daemon --report-file``: every transfer report the daemon sends, one JSON line each.

Two ``mlfabric daemon`` processes (h0 hosts the server, h1 the worker) under the in-test
scheduler; this test process is the server and the worker (public API). Every process
started here is reaped.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mlfabric
from mlfabric.daemon.reports import TransferReportLog
from mlfabric.proto.v1 import control_pb2
from mlfabric.wire.reports import REPORT_FIELDS


def test_report_log_writes_one_flushed_line_per_report() -> None:
    buf = io.StringIO()
    log = TransferReportLog("mem", opener=lambda path: buf)
    with pytest.raises(RuntimeError, match="not open"):
        log.write(control_pb2.TransferReport(update_id="w0/1"))
    log.start()
    for i in (1, 2):
        log.write(
            control_pb2.TransferReport(
                update_id=f"w0/{i}", bytes=10 * i, ok=True, outcome=control_pb2.OUTCOME_DROPPED, delay=i
            )
        )
        assert len(buf.getvalue().splitlines()) == i  # flushed as it is written
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [list(line) for line in lines] == [list(REPORT_FIELDS)] * 2
    assert [(r["update_id"], r["bytes"], r["outcome"], r["delay"]) for r in lines] == [
        ("w0/1", 10, "DROPPED", 1),
        ("w0/2", 20, "DROPPED", 2),
    ]
    log.stop()
    log.stop()  # idempotent
    assert buf.closed


class _Daemons:
    """``mlfabric daemon`` processes; each is SIGTERMed (then killed) and reaped."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, host: str, scheduler: str, sockdir: str, *extra: str) -> dict[str, Any]:
        ready = self.workdir / f"{host}.json"
        with open(self.workdir / f"{host}.log", "wb") as log:
            self.procs[host] = proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "mlfabric", "--log-level", "INFO", "daemon", "--host", host),
                    *("--scheduler", scheduler, "--socket", os.path.join(sockdir, f"{host}.sock")),
                    *("--data-listen", "127.0.0.1:0", "--ready-file", str(ready), *extra),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, f"{host} exited: {self.log(host)}"
            assert time.monotonic() < deadline, f"{host} not ready: {self.log(host)}"
            time.sleep(0.05)
        return dict(json.loads(ready.read_text()))

    def log(self, host: str) -> str:
        return (self.workdir / f"{host}.log").read_text(errors="replace")[-3000:]

    def stop(self, host: str) -> int:
        proc = self.procs[host]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[_Daemons]:
    group = _Daemons(tmp_path)
    yield group
    for host in group.procs:
        group.stop(host)


@pytest.mark.slow
def test_report_file_has_a_line_per_transfer_after_real_pushes(
    scheduler: Any, sockdir: str, daemons: _Daemons, tmp_path: Path
) -> None:
    reports = {h: tmp_path / f"{h}.reports.jsonl" for h in ("h0", "h1")}
    h0 = daemons.start("h0", scheduler.address, sockdir, "--report-file", str(reports["h0"]))
    h1 = daemons.start("h1", scheduler.address, sockdir, "--report-file", str(reports["h1"]))
    shape = (64, 16)
    server = mlfabric.register_as_server(
        "job", "ps0", {"w": np.zeros(shape, np.float32)}, mlfabric.Params(tau_max=1), daemon=h0["socket"]
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    worker = mlfabric.register_as_worker("job", name="w1", daemon=h1["socket"], wait=10)
    before = time.time()
    # base versions 0, 0, 0: the third is 2 versions stale with tau_max 1 and is dropped
    results = [
        worker.push("ps0", {"w": np.ones(shape, np.float32)}, base_version=0).wait(20) for _ in range(3)
    ]
    after = time.time()
    assert [r.status for r in results] == [mlfabric.APPLIED, mlfabric.APPLIED, mlfabric.DROPPED]
    # the lines are flushed as the transfers end (just after the worker hears), before the daemon stops
    deadline = time.monotonic() + 5
    while len(reports["h1"].read_text().splitlines()) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    lines = [json.loads(line) for line in reports["h1"].read_text().splitlines()]
    assert [line["update_id"] for line in lines] == [r.update_id for r in results], daemons.log("h1")
    assert all(list(line) == list(REPORT_FIELDS) for line in lines)
    nbytes = int(np.prod(shape)) * 4
    for line, result in zip(lines, results, strict=True):
        assert (line["src_host"], line["dst_host"], line["bytes"], line["ok"]) == ("h1", "h0", nbytes, True)
        assert line["outcome"] == result.status
        assert line["server_version"] == result.version
        assert before <= line["start"] <= line["end"] <= after
        assert line["throughput"] > 0
    assert lines[1]["delay"] == 1 and lines[2]["reason"] == results[2].reason != ""
    # the same reports reached the scheduler (its stream may lag the file by a moment)
    deadline = time.monotonic() + 5
    while len(scheduler.reports) < len(results) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(r.update_id for r in scheduler.reports) == sorted(r.update_id for r in results)
    worker.close()
    server.stop()
    thread.join(5)
    server.close()
    assert daemons.stop("h1") == 0 and daemons.stop("h0") == 0, daemons.log("h1") + daemons.log("h0")
    assert reports["h0"].read_text() == ""  # h0 received, it sent nothing
    assert len(reports["h1"].read_text().splitlines()) == 3
