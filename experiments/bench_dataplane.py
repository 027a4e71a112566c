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

    python experiments/bench_dataplane.py --out experiments/results/bench_dataplane.md
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
from mlfabric.daemon.dataplane import FileSpan, Frame, FrameHeader, FrameLimits, recv_frame, send_frame
from mlfabric.daemon.transport import DataPlaneListener, PeerPool, Response, parse_address
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


def bench_dataplane(
    nbytes: int, repeats: int, ctx: Any, *, pass_crc: bool, alloc: str, zero_copy: bool = True
) -> list[float]:
    """Seconds per update sent UPDATE -> ACK through the data plane (``PeerPool.request``)."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dataplane_receiver, args=(alloc, child))
    proc.start()
    address = parent.recv()
    data = _payload(nbytes)
    fd = os.memfd_create("bench-update")
    times: list[float] = []
    pool = PeerPool(FrameLimits(), io_timeout=120)
    try:
        os.write(fd, memoryview(data.data))
        span = FileSpan(fd, 0, nbytes)
        header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, job="bench", server="s")
        header.tensors.add(name="w", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
        crc = zlib.crc32(memoryview(data.data)) if pass_crc else None
        sock = None if zero_copy else socket.create_connection(parse_address(address))
        for i in range(repeats + 1):
            header.update_id = f"u{i}"
            t0 = time.perf_counter()
            if sock is None:
                kind = pool.request(address, header, span, crc32=crc).header.kind
            else:  # the same frames, sent from a mapping
                send_frame(sock, header, span, crc32=crc, zero_copy=False)
                reply = recv_frame(sock, FrameLimits())
                kind = reply.header.kind if reply is not None else dataplane_pb2.FRAME_KIND_ERROR
            t1 = time.perf_counter()
            if kind != dataplane_pb2.FRAME_KIND_ACK:
                raise RuntimeError(f"data plane replied {kind}")
            if i:
                times.append(t1 - t0)
        if sock is not None:
            sock.close()
    finally:
        pool.close()
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
    data = memoryview(_payload(nbytes).data)
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


def bench_handoff(nbytes: int, repeats: int, ctx: Any, *, reuse: bool) -> list[float]:
    """Seconds per hand-off: the update into a memfd, the fd over SCM_RIGHTS, the daemon's reply.

    ``reuse=False`` is ``mlfabric.tensors.to_memfd`` (a new memfd per push, as ``Worker.push``
    does today); ``reuse=True`` copies into one memfd kept from push to push (what a worker can
    do once its daemon has sent the previous update), so no page is allocated and zeroed.
    """
    from mlfabric import tensors as tcodec

    update = {"w": _payload(nbytes).view(np.float32)}
    times: list[float] = []
    kept = MemfdPool(max_idle_bytes=2 * nbytes + (1 << 20))
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
                if reuse:
                    layouts, total = tcodec.plan_layout(update)
                    buf = kept.allocate(total)
                    tcodec.encode_into(buf, update, layouts)
                    fd = buf.fd
                else:
                    fd, _layouts, total = tcodec.to_memfd(update, name="bench-update")
                socket.send_fds(sock, [str(total).encode()], [fd])
                if sock.recv(1) != ACK:
                    raise RuntimeError("hand-off receiver closed")
                t1 = time.perf_counter()
                if reuse:
                    buf.release()
                else:
                    os.close(fd)
                if i:
                    times.append(t1 - t0)
        proc.join(30)
    kept.close()
    return times


# --------------------------------------------------------------------------- (e) through mlfabric.api
_TOPOLOGY = """
hosts = ["ps", "w0"]
switches = ["sw"]

[[links]]
a = "ps"
b = "sw"
gbps = 100

[[links]]
a = "w0"
b = "sw"
gbps = 100
"""


def _api_server(socket_path: str, nbytes: int, ctl: Connection) -> None:
    import threading

    import mlfabric

    model = {"w": np.zeros(nbytes // 4, np.float32)}
    server = mlfabric.register_as_server(
        "bench", "ps0", model, mlfabric.Params(tau_max=1 << 20), daemon=socket_path
    )
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    ctl.send("ready")
    ctl.recv()  # "stop"
    server.stop()
    thread.join(10)
    server.close()


def bench_api(nbytes: int, repeats: int, ctx: Any) -> tuple[list[float], list[float]]:
    """``Worker.push`` through a real cluster (scheduler + two daemon processes, policy fair).

    Returns the seconds from ``push()`` until the worker's daemon accepted the update (the
    hand-off through the local API) and until it was APPLIED at the server (hand-off, the
    scheduler's directive, the data-plane transfer between the two daemons, the server's
    ``on_update`` and the verdict's way back).
    """
    import mlfabric
    from mlfabric.cluster import LocalCluster

    handoff: list[float] = []
    applied: list[float] = []
    update = {"w": np.ones(nbytes // 4, np.float32)}
    with tempfile.TemporaryDirectory(prefix="mlfb-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(_TOPOLOGY)
        with LocalCluster(topo, policy="fair", workdir=tmp) as cluster:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_api_server, args=(cluster.socket("ps"), nbytes, child))
            proc.start()
            try:
                parent.recv()
                with mlfabric.register_as_worker("bench", name="w0", daemon=cluster.socket("w0")) as worker:
                    for i in range(repeats + 1):
                        t0 = time.perf_counter()
                        handle = worker.push("ps0", update, norm=1.0)
                        while not handle.update_id and not handle.done():
                            time.sleep(0.0005)
                        t1 = time.perf_counter()
                        result = handle.wait(120)
                        t2 = time.perf_counter()
                        if result.status != mlfabric.APPLIED:
                            raise RuntimeError(f"push {i} not applied: {result}")
                        if i:
                            handoff.append(t1 - t0)
                            applied.append(t2 - t0)
            finally:
                parent.send("stop")
                proc.join(30)
    return handoff, applied


# --------------------------------------------------------------------------- report
NOTES = """## What the rows are

- `dataplane`: `PeerPool.request` of an UPDATE whose payload is a memfd (`FileSpan`, sent with
  `os.sendfile`) to a `DataPlaneListener` in another process that receives into recycled memfds
  (`MemfdPool`), checks the CRC-32 on a helper thread and answers ACK. The CRC is passed in, as
  when it is computed at hand-off time (while the update waits for the scheduler's directive).
- `dataplane_trailer`: the CRC is not known; the sender computes it while sending and appends it.
- `dataplane_mapped`: the span sent from a mapping with `sendall` instead of `sendfile`.
- `dataplane_fresh`: the receiver allocates a new memfd per frame (the daemon's `MemfdBuffer`):
  every page is allocated and zeroed on first touch.
- `gloo`, `raw_tcp`: the same bytes, receiver reusing one buffer; a 1-byte reply ends each timing.
- `handoff`: `mlfabric.tensors.to_memfd` (new memfd) + SCM_RIGHTS + reply, measured directly;
  `handoff_reuse`: the update copied into a memfd kept from push to push.
- `api_handoff`: `Worker.push` through a real cluster (scheduler and two `mlfabric daemon`
  processes) until the worker's daemon accepted the update; `api_push_applied`: until APPLIED
  (includes the scheduler, the transfer between the daemons and the server's `on_update`).

Every case runs between processes on one 2-core machine shared with other work, so absolute
rates and ratios move with the load (printed above); compare rows of one run.
"""


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
        ("dataplane_trailer", "gloo", 0.8),
        ("dataplane_mapped", "gloo", 0.8),
        ("dataplane_fresh", "gloo", 0.8),
        ("dataplane", "raw_tcp", None),
        ("handoff", "dataplane", 2.0),
        ("handoff_reuse", "dataplane", 2.0),
        ("api_handoff", "dataplane", 2.0),
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
    parser.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    ctx = mp.get_context("spawn")
    before = os.getloadavg()
    rows = []
    n, r = nbytes, args.repeats
    cases: list[tuple[str, str, Callable[[], list[float]]]] = [
        (
            "dataplane",
            "memfd span (sendfile) -> listener into pooled memfds; CRC known at hand-off",
            lambda: bench_dataplane(n, r, ctx, pass_crc=True, alloc="pool"),
        ),
        (
            "dataplane_trailer",
            "same, CRC computed while sending (trailer)",
            lambda: bench_dataplane(n, r, ctx, pass_crc=False, alloc="pool"),
        ),
        (
            "dataplane_mapped",
            "same as dataplane, mmap + sendall instead of sendfile (zero_copy=False)",
            lambda: bench_dataplane(n, r, ctx, pass_crc=True, alloc="pool", zero_copy=False),
        ),
        (
            "dataplane_fresh",
            "same as dataplane, a new memfd per frame (MemfdBuffer.allocate)",
            lambda: bench_dataplane(n, r, ctx, pass_crc=True, alloc="fresh"),
        ),
        ("gloo", "torch.distributed send/recv", lambda: bench_gloo(n, r, ctx)),
        ("raw_tcp", "sendall / recv_into", lambda: bench_raw_tcp(n, r, ctx)),
        ("handoff", "to_memfd (new memfd) + SCM_RIGHTS", lambda: bench_handoff(n, r, ctx, reuse=False)),
        (
            "handoff_reuse",
            "copy into a recycled memfd + SCM_RIGHTS",
            lambda: bench_handoff(n, r, ctx, reuse=True),
        ),
    ]
    api: dict[str, list[float]] = {}

    def run_api(key: str) -> list[float]:
        if not api:
            api["handoff"], api["applied"] = bench_api(n, r, ctx)
        return api[key]

    cases += [
        ("api_handoff", "Worker.push until its daemon accepted it", lambda: run_api("handoff")),
        ("api_push_applied", "Worker.push until APPLIED (2 daemon processes)", lambda: run_api("applied")),
    ]
    if args.skip_gloo:
        cases = [c for c in cases if c[0] != "gloo"]
    if args.only:
        cases = [c for c in cases if c[0] in args.only.split(",")]
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
        args.out.write_text(
            f"# Data-plane benchmark\n\n`python {' '.join(sys.argv)}`\n\n{table}\n\n{NOTES}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
