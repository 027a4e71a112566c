"""Process helpers shared by the experiments (run as scripts: ``import harness`` from beside them).

- :func:`start`: run ``python -m mlfabric CMD --ready-file F`` and wait for its ready file
  (``bench_memory.py``, ``soak.py``);
- :func:`stop_all`: SIGTERM the processes still running, wait, kill those that do not stop
  (``testbed_e2e.py``, ``testbed_aggregation.py``: ranks stuck in gloo);
- :func:`init_gloo`: a gloo process group whose rank 0 serves the store on a free port and
  says which in its ready file (written atomically: a reader never sees it half written).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlfabric.cluster import python_module

__all__ = ["init_gloo", "start", "stop_all"]


def start(
    cmd: list[str], ready: Path, log: Path, timeout: float = 60.0
) -> tuple[subprocess.Popen[bytes], Any]:
    """Start ``mlfabric`` ``cmd`` with ``--ready-file ready``; the process and its ready JSON.

    Its stdout and stderr go to ``log``. Raises ``RuntimeError`` with the log's tail when it
    exits or writes no ready file within ``timeout`` seconds (it is killed).
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*python_module("mlfabric"), *cmd, "--ready-file", str(ready)], stdout=out, stderr=out
        )
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
