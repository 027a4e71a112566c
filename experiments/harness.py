"""Process helpers shared by the experiments (run as scripts: ``import harness`` from beside them).

- :func:`start`: run ``python -m mlfabric CMD --ready-file F`` and wait for its ready file
  (``bench_memory.py``, ``soak.py``);
- :func:`stop_all`: SIGTERM the processes still running, wait, kill those that do not stop
  (``testbed_e2e.py``, ``testbed_aggregation.py``: ranks stuck in gloo);
- :func:`init_gloo`: a gloo process group whose rank 0 serves the store on a free port and
  says which in its ready file (written atomically: a reader never sees it half written);
- :func:`proc_stats`, :func:`cpu_seconds`: a process's RSS and open fds, its CPU time;
- :func:`decision_buckets`, :func:`quantile_bound`: the scheduler's decision-time histogram
  from its ``/metrics``, and the bucket a quantile falls in between two scrapes
  (``soak.py``, ``bench_service_scale.py``);
- :func:`write_csv`, :func:`save_results`: an experiment's rows as CSV, and with its Markdown
  summary beside them (the testbed experiments).
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlfabric.cluster import python_module

__all__ = [
    "cpu_seconds",
    "decision_buckets",
    "init_gloo",
    "proc_stats",
    "quantile_bound",
    "save_results",
    "start",
    "stop_all",
    "wait_file",
    "write_csv",
]


def start(
    cmd: list[str], ready: Path, log: Path, timeout: float = 60.0, profile: Path | None = None
) -> tuple[subprocess.Popen[bytes], Any]:
    """Start ``mlfabric`` ``cmd`` with ``--ready-file ready``; the process and its ready JSON.

    Its stdout and stderr go to ``log``. Raises ``RuntimeError`` with the log's tail when it
    exits or writes no ready file within ``timeout`` seconds (it is killed). With ``profile``
    it runs under ``cProfile``, which writes its statistics there when the process exits.
    """
    launcher = python_module("mlfabric")
    if profile is not None:
        launcher = [*python_module("cProfile"), "-o", str(profile), "-m", "mlfabric"]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*launcher, *cmd, "--ready-file", str(ready)], stdout=out, stderr=out)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def stop_all(procs: Iterable[Any], grace: float = 10.0) -> None:
    """SIGTERM every process of ``procs`` still running, then wait ``grace`` s each; kill the rest.

    ``procs`` are ``subprocess.Popen``-like (``poll``, ``send_signal``, ``wait``, ``kill``).
    """
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:  # e.g. a rank stuck in gloo
            p.kill()
            p.wait()


def init_gloo(store: str, rank: int, world: int, ready_file: str) -> Any:
    """Join the ranks' gloo process group; ``torch.distributed``, initialised.

    ``store`` is ``"host:port"`` of rank 0's store (rank 0 itself gives port 0: it binds a free
    port and writes ``{"port": ...}`` to ``ready_file`` with
    :func:`mlfabric.readyfile.write_ready_file`; the launcher reads it to start the others).
    """
    import torch.distributed as dist

    from mlfabric.readyfile import write_ready_file

    host, port = store.rsplit(":", 1)
    if rank == 0:
        tcp = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        write_ready_file(ready_file, {"port": tcp.port})
    else:
        tcp = dist.TCPStore(host, int(port), world, is_master=False)
    dist.init_process_group("gloo", store=tcp, rank=rank, world_size=world)
    return dist


def proc_stats(pid: int) -> tuple[int, int]:
    """(VmRSS bytes, open fds) of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return (int(found.group(1)) * 1024 if found else 0), len(os.listdir(f"/proc/{pid}/fd"))


def decision_buckets(metrics_port: int, timeout: float = 10.0) -> dict[float, float]:
    """Cumulative ``mlfabric_decision_seconds`` bucket counts by upper bound."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    out = {}
    for le, count in re.findall(r'^mlfabric_decision_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        out[float(le)] = float(count)
    return out


def quantile_bound(
    before: dict[float, float], after: dict[float, float], q: float = 0.99
) -> tuple[float, int]:
    """Upper bound of the bucket holding the ``q`` quantile of the decisions between two scrapes.

    Examples
    --------
    >>> quantile_bound({0.001: 0, 0.01: 0, float("inf"): 0}, {0.001: 990, 0.01: 1000, float("inf"): 1000})
    (0.001, 1000)
    >>> quantile_bound({}, {0.001: 500, 0.01: 1000, float("inf"): 1000}, q=0.5)
    (0.001, 1000)
    >>> quantile_bound({}, {0.001: 0, float("inf"): 0})
    (0.0, 0)
    """
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = int(counts[-1]) if counts else 0
    if total == 0:
        return 0.0, 0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * total:
            return bound, total
    return bounds[-1], total


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write ``rows`` (their first row's keys as the columns) to ``path``, its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def save_results(out: Path, name: str, rows: Sequence[Mapping[str, Any]], text: str) -> None:
    """Write ``rows`` to ``out/<name>.csv`` and the summary ``text`` to ``out/<name>.md``."""
    write_csv(out / f"{name}.csv", rows)
    (out / f"{name}.md").write_text(text)


def wait_file(path: Path, popen: Any, timeout: float) -> str:
    """Wait for ``path`` to appear; a RuntimeError if ``popen`` exits or ``timeout`` s pass first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} never appeared (process exit code {popen.poll()})")
        time.sleep(0.05)
    return path.read_text()
