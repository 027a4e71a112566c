"""A training process handing an update to its daemon, measured directly (DESIGN §3, §9).

The tensors are copied into a memfd (with the payload's CRC-32, as ``Worker.push`` does) and
the fd passed over a Unix socket with SCM_RIGHTS (the local API's mechanism); the receiver
(the daemon's stand-in) maps it and replies. Cases, interleaved one transfer each per round
after a warm-up, medians:

- ``handoff``: ``mlfabric.tensorio.to_memfd`` (a new memfd per push: every page allocated and
  zeroed on first touch), CRC-32 computed after the copy;
- ``handoff_pooled``: what ``Worker.push`` does: the update copied into a recycled memfd of its
  pool (``tensorio.encode_pooled(..., crc=True)``), the CRC-32 computed piece by piece with the
  copy (``mlfabric.wire._native.copy_crc``).

CPU seconds per GB are both processes' (``getrusage``). The daemons' data path itself is
``bench_dataplane.py``, whose helpers this script shares.

Run::

    python experiments/bench_handoff.py --mib 128 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dataplane import ACK, Sample, Session, _cpu, _row, payload, render

from mlfabric.wire.memfd import MemfdPool


def _handoff_daemon(path: str, ctl: Connection, results: Connection) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    ctl.send("ready")
    conn, _ = server.accept()
    while True:
        c0 = _cpu()
        msg, fds, _flags, _addr = socket.recv_fds(conn, 64, 1)
        if not msg:
            break
        with mmap.mmap(fds[0], int(msg.decode()), prot=mmap.PROT_READ):
            pass  # the daemon maps the update to send it on; reading it is the data plane's job
        os.close(fds[0])
        conn.sendall(ACK)
        results.send(_cpu() - c0)
    conn.close()
    server.close()


def handoff_session(name: str, nbytes: int, ctx: Any, *, pooled: bool) -> Session:
    """The update into a memfd with its CRC-32, the fd over SCM_RIGHTS, the daemon's reply."""
    from mlfabric import tensorio
    from mlfabric.wire.crc import crc32

    update = {"w": payload(nbytes).view(np.float32)}
    kept = MemfdPool(max_idle_bytes=2 * nbytes + (1 << 20))
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/daemon.sock"
        ctl, ctl_child = ctx.Pipe()
        results, results_child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_handoff_daemon, args=(path, ctl_child, results_child))
        proc.start()
        try:
            ctl.recv()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(path)
                while True:
                    c0, t0 = _cpu(), time.perf_counter()
                    if pooled:
                        buf, _layouts, total, _crc = tensorio.encode_pooled(kept, update, crc=True)
                        fd = buf.fd
                    else:
                        fd, _layouts, total = tensorio.to_memfd(update, name="bench-update")
                        with mmap.mmap(fd, total, prot=mmap.PROT_READ) as m:
                            crc32(m)
                    socket.send_fds(sock, [str(total).encode()], [fd])
                    if sock.recv(1) != ACK:
                        raise RuntimeError("hand-off receiver closed")
                    t1, c1 = time.perf_counter(), _cpu()
                    if pooled:
                        buf.release()
                    else:
                        os.close(fd)
                    yield {name: (t1 - t0, c1 - c0 + results.recv())}
        finally:
            proc.join(30)
            kept.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=128, help="payload size in MiB (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    args = parser.parse_args(argv)
    n = args.mib << 20
    ctx = mp.get_context("spawn")
    cases = {
        "handoff": ("to_memfd (new memfd), CRC after, SCM_RIGHTS", False),
        "handoff_pooled": ("copy + CRC into a recycled memfd, SCM_RIGHTS", True),
    }
    samples: dict[str, list[Sample]] = {}
    before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        sessions = []
        for name, (_, pooled) in cases.items():
            session = handoff_session(name, n, ctx, pooled=pooled)
            stack.callback(session.close)
            sessions.append(session)
        for round_ in range(args.repeats + 1):
            for session in sessions:
                for name, sample in next(session).items():
                    if round_:
                        samples.setdefault(name, []).append(sample)
    after = os.getloadavg()
    rows = [_row(name, cases[name][0], n, got) for name, got in samples.items()]
    print(render(rows, n, args.repeats, f"{before[0]:.2f} before, {after[0]:.2f} after (1-min)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
