"""Data-plane throughput on loopback, side by side (issue 2, "Performance"; DESIGN.md §5).

In one run, for the same payload (default 256 MiB), between two processes on 127.0.0.1:

(a) ``dataplane``  -- mlfabric's data plane as a daemon uses it: the payload in a memfd sent with
    ``PeerPool.request`` (``os.sendfile``), received by a ``DataPlaneListener`` into the daemon's
    memfd-backed buffer, CRC-32 checked, answered with ACK;
(b) ``gloo``       -- ``torch.distributed`` (gloo) ``send`` of a uint8 tensor, then a 1-byte reply;
(c) ``raw_tcp``    -- a plain socket: ``sendall`` / ``recv_into`` a preallocated buffer, 1-byte reply;
(d) ``handoff``    -- a training process handing the update to its daemon: the tensors written
    into a memfd (``mlfabric.tensors.to_memfd``) and the fd passed over a Unix socket with
    SCM_RIGHTS (the local API's mechanism), the receiver maps it and replies. This measures the
    mechanism directly, not a full ``mlfabric.api`` push through a running daemon (that would
    add the scheduler round trip, which is not a hand-off cost).

Each timing runs from the sender's first byte to the receiver's reply (so each includes one
small round trip). Every case repeats ``--repeats`` times after one warm-up; the table shows
medians, GB/s (1e9 bytes/s), and the ratios dataplane/gloo (target >= 0.8) and
handoff/dataplane (target >= 2).

Run::

    python experiments/bench_dataplane.py [--mib 256] [--repeats 5] [--out experiments/results/bench_dataplane.md]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.daemon.bufferpool import MemfdPool
from mlfabric.daemon.dataplane import FileSpan, Frame, FrameHeader, FrameLimits
from mlfabric.daemon.transport import DataPlaneListener, PeerPool, Response
from mlfabric.proto.v1 import control_pb2, dataplane_pb2

ACK = b"k"


def _payload(nbytes: int) -> np.ndarray:
    """Deterministic, incompressible-enough bytes (loopback does not compress anyway)."""
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


# --------------------------------------------------------------------------- (a) the data plane
def _allocator(mode: str) -> tuple[Callable[[int], Any], Callable[[], None]]:
    """The receiving daemon's allocator: recycled memfds (``pool``) or a new memfd per frame."""
    if mode == "pool":
        pool = MemfdPool(max_idle_bytes=2 << 30)
        return pool.allocate, pool.close
    try:
        from mlfabric.daemon.daemon import MemfdBuffer
    except ImportError:  # the daemon module is not there: the same mechanism, written here
        return MemfdPool(max_idle_bytes=0).allocate, lambda: None
    return MemfdBuffer.allocate, lambda: None


def _dataplane_receiver(mode: str, ctl: Connection) -> None:
    alloc, close = _allocator(mode)

    def handler(frame: Frame) -> Response:
        if frame.buffer is not None:
            frame.payload.release()
            frame.buffer.release()  # the server process is done with it
        return Response(
            FrameHeader(
                kind=dataplane_pb2.FRAME_KIND_ACK,
                update_id=frame.header.update_id,
                outcome=control_pb2.OUTCOME_APPLIED,
            )
        )

    listener = DataPlaneListener("127.0.0.1:0", handler, FrameLimits(), alloc=alloc)
    ctl.send(listener.start())
    ctl.recv()  # wait for "stop"
    listener.stop()
    close()


def bench_dataplane(nbytes: int, repeats: int, ctx: Any, *, pass_crc: bool, alloc: str) -> list[float]:
    """Seconds per update sent UPDATE -> ACK through the data plane."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dataplane_receiver, args=(alloc, child))
    proc.start()
    address = parent.recv()
    data = _payload(nbytes)
    fd = os.memfd_create("bench-update")
    times: list[float] = []
    try:
        os.write(fd, data.tobytes())
        span = FileSpan(fd, 0, nbytes)
        header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, job="bench", server="s")
        header.tensors.add(name="w", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
        crc = zlib.crc32(data) if pass_crc else None
        pool = PeerPool(FrameLimits(), io_timeout=120)
        for i in range(repeats + 1):
            header.update_id = f"u{i}"
            t0 = time.perf_counter()
            reply = pool.request(address, header, span, crc32=crc)
            t1 = time.perf_counter()
            if reply.header.kind != dataplane_pb2.FRAME_KIND_ACK:
                raise RuntimeError(f"data plane replied {reply.header}")
            if i:
                times.append(t1 - t0)
        pool.close()
    finally:
        os.close(fd)
        parent.send("stop")
        proc.join(30)
    return times


# --------------------------------------------------------------------------- (b) gloo
def _gloo_rank(rank: int, init: str, nbytes: int, repeats: int, out: Connection) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ack = torch.zeros(1, dtype=torch.uint8)
    times: list[float] = []
    if rank == 0:
        tensor = torch.from_numpy(_payload(nbytes))
        for i in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.send(tensor, dst=1)
            dist.recv(ack, src=1)
            if i:
                times.append(time.perf_counter() - t0)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        for _ in range(repeats + 1):
            dist.barrier()
            dist.recv(buf, src=0)
            dist.send(ack, dst=0)
    dist.destroy_process_group()
    out.send(times)


def bench_gloo(nbytes: int, repeats: int, ctx: Any) -> list[float]:
    """Seconds per transfer with torch.distributed gloo send/recv (+ a 1-byte reply)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=_gloo_rank, args=(r, init, nbytes, repeats, pipes[r][1])) for r in range(2)
        ]
        for p in procs:
            p.start()
        times: list[float] = pipes[0][0].recv()
        pipes[1][0].recv()
        for p in procs:
            p.join(60)
    return times


# --------------------------------------------------------------------------- (c) raw TCP
def _tcp_receiver(nbytes: int, repeats: int, ctl: Connection) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    ctl.send(server.getsockname()[1])
    conn, _ = server.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(repeats + 1):
        _recv_exact_into(conn, view)
        conn.sendall(ACK)
    conn.close()
    server.close()


def bench_raw_tcp(nbytes: int, repeats: int, ctx: Any) -> list[float]:
    """Seconds per transfer over a plain TCP socket (+ a 1-byte reply)."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_tcp_receiver, args=(nbytes, repeats, child))
    proc.start()
    port = parent.recv()
    data = memoryview(_payload(nbytes))
    times: list[float] = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            sock.sendall(data)
            if sock.recv(1) != ACK:
                raise RuntimeError("raw TCP receiver closed")
            if i:
                times.append(time.perf_counter() - t0)
    proc.join(30)
    return times


# --------------------------------------------------------------------------- (d) hand-off
def _handoff_daemon(path: str, repeats: int, ctl: Connection) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    ctl.send("ready")
    conn, _ = server.accept()
    for _ in range(repeats + 1):
        msg, fds, _flags, _addr = socket.recv_fds(conn, 64, 1)
        nbytes = int(msg.decode())
        with mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ):
            pass  # the daemon maps the update to send it on; reading it is the data plane's job
        os.close(fds[0])
        conn.sendall(ACK)
    conn.close()
    server.close()


def bench_handoff(nbytes: int, repeats: int, ctx: Any) -> list[float]:
    """Seconds per hand-off: tensors -> memfd (``mlfabric.tensors.to_memfd``) -> SCM_RIGHTS -> reply."""
    from mlfabric import tensors as tcodec

    update = {"w": _payload(nbytes).view(np.float32)}
    times: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/daemon.sock"
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_handoff_daemon, args=(path, repeats, child))
        proc.start()
        parent.recv()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                fd, _layouts, total = tcodec.to_memfd(update, name="bench-update")
                socket.send_fds(sock, [str(total).encode()], [fd])
                os.close(fd)
                if sock.recv(1) != ACK:
                    raise RuntimeError("hand-off receiver closed")
                if i:
                    times.append(time.perf_counter() - t0)
        proc.join(30)
    return times


# --------------------------------------------------------------------------- report
def _row(name: str, what: str, nbytes: int, times: list[float]) -> tuple[str, str, float, float, float]:
    med = statistics.median(times)
    return name, what, med, nbytes / med / 1e9, (max(times) - min(times)) / med


def render(rows: list[tuple[str, str, float, float, float]], nbytes: int, repeats: int, loads: str) -> str:
    """The results as a Markdown table plus the two target ratios."""
    rate = {name: gbps for name, _, _, gbps, _ in rows}
    lines = [
        f"payload {nbytes / 2**20:.0f} MiB, median of {repeats} runs after a warm-up; "
        f"{os.cpu_count()} CPUs; load average {loads}",
        "",
        "| case | what | median s | GB/s | spread (max-min)/median |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {w} | {m:.3f} | {g:.2f} | {s:.0%} |" for n, w, m, g, s in rows]
    lines += ["", "| ratio | value | target |", "| --- | ---: | ---: |"]
    for num, den, target in [
        ("dataplane", "gloo", 0.8),
        ("dataplane_crc_in", "gloo", 0.8),
        ("dataplane_fresh", "gloo", 0.8),
        ("dataplane", "raw_tcp", None),
        ("handoff", "dataplane", 2.0),
        ("handoff", "dataplane_crc_in", 2.0),
    ]:
        if num in rate and den in rate:
            value = rate[num] / rate[den]
            goal = "" if target is None else f">= {target:g} " + ("(met)" if value >= target else "(NOT met)")
            lines.append(f"| {num} / {den} | {value:.2f} | {goal} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    parser.add_argument("--skip-gloo", action="store_true", help="leave out torch.distributed")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    before = os.getloadavg()
    rows = []
    cases: list[tuple[str, str, Callable[[], list[float]]]] = [
        (
            "dataplane",
            "memfd sendfile -> listener (pooled memfds); CRC by sender and receiver",
            lambda: bench_dataplane(nbytes, args.repeats, ctx, pass_crc=False, alloc="pool"),
        ),
        (
            "dataplane_crc_in",
            "same, the pushing process's CRC passed in",
            lambda: bench_dataplane(nbytes, args.repeats, ctx, pass_crc=True, alloc="pool"),
        ),
        (
            "dataplane_fresh",
            "same as dataplane, a new memfd per frame (MemfdBuffer.allocate)",
            lambda: bench_dataplane(nbytes, args.repeats, ctx, pass_crc=False, alloc="fresh"),
        ),
        ("raw_tcp", "sendall / recv_into", lambda: bench_raw_tcp(nbytes, args.repeats, ctx)),
        ("handoff", "to_memfd + SCM_RIGHTS (mechanism)", lambda: bench_handoff(nbytes, args.repeats, ctx)),
    ]
    if not args.skip_gloo:
        cases.insert(
            2, ("gloo", "torch.distributed send/recv", lambda: bench_gloo(nbytes, args.repeats, ctx))
        )
    for name, what, run in cases:
        times = run()
        rows.append(_row(name, what, nbytes, times))
        print(f"{name:>20}: median {statistics.median(times):.3f} s  {rows[-1][3]:.2f} GB/s", file=sys.stderr)
    after = os.getloadavg()
    loads = f"{before[0]:.2f} before, {after[0]:.2f} after (1-min)"
    table = render(rows, nbytes, args.repeats, loads)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Data-plane benchmark\n\n`python {' '.join(sys.argv)}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
