"""Data-plane throughput on loopback, side by side (DESIGN §5, §9).

In one run, for the same payload (default 256 MiB), between two processes on 127.0.0.1:

(a) ``dataplane*`` -- mlfabric's data plane as a daemon uses it: an UPDATE whose payload is a memfd
    (``FileSpan``, mapped) sent with ``PeerPool.request`` to a ``DataPlaneListener`` in another process,
    received into recycled memfds (``MemfdPool``), CRC-32 checked, answered with ACK; variants
    for where the CRC is computed, sendfile vs mapping, and fresh receive buffers;
(b) ``gloo``       -- ``torch.distributed`` (gloo) ``send`` of a uint8 tensor, then a 1-byte reply;
(c) ``raw_tcp``    -- a plain socket: ``sendall`` / ``recv_into`` a preallocated buffer, 1-byte reply;
(d) ``handoff*``   -- a training process handing the update to its daemon, measured directly:
    the tensors written into a memfd and the fd passed over a Unix socket with SCM_RIGHTS (the
    local API's mechanism), the receiver maps it and replies;
(e) ``api_*``      -- the same through ``mlfabric.api``: ``Worker.push`` on a real cluster
    (``mlfabric scheduler`` and two ``mlfabric daemon`` processes), until the worker's daemon
    accepted the update, and until it was APPLIED at the server.

All cases are set up first, then run interleaved, one transfer of each case per round, so a
change of the machine's load hits every case alike; the first round is a warm-up. The table
shows medians, GB/s (1e9 bytes/s), CPU seconds per GB of both processes (``getrusage``: far less
sensitive to other load than the wall clock), and the ratios dataplane/gloo (target >= 0.8) and
handoff/dataplane (target >= 2), by wall clock and by CPU cost.

Run::

    python experiments/bench_dataplane.py --out experiments/results/bench_dataplane.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import mmap
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from mlfabric.daemon.channels.frames import FileSpan, Frame, FrameHeader, FrameLimits, recv_frame, send_frame
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.payloadio import payload_crc32
from mlfabric.daemon.channels.peers import PeerPool, parse_address
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire.auth import DataPlaneAuth, load_secret
from mlfabric.wire.crc import crc32_implementation, use_crc32
from mlfabric.wire.memfd import MemfdPool, allocate
from mlfabric.wire.tls import TlsFiles

ACK = b"k"

#: One timed transfer: wall seconds, and CPU seconds of both processes (None: not measured).
Sample = tuple[float, float | None]
#: A case's running session: each ``next()`` runs one transfer per row it measures.
Session = Generator[dict[str, Sample], None, None]


def _cpu() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _payload(nbytes: int) -> np.ndarray:
    """Deterministic bytes (loopback does not compress anyway)."""
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False when the peer closed before the first byte."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-transfer")
        got += k
    return True


# --------------------------------------------------------------------------- (a) the data plane
def _allocator(mode: str) -> tuple[Callable[[int], Any], Callable[[], None]]:
    """The receiving daemon's allocator: recycled memfds (``pool``) or a new memfd per frame."""
    if mode == "pool":
        pool = MemfdPool(max_idle_bytes=2 << 30)
        return pool.allocate, pool.close
    return allocate, lambda: None


def _auth(mode: str, host: str, certs: str) -> DataPlaneAuth:
    """The data-plane authentication ``mode`` of ``host`` with the files ``mlfabric certs`` wrote."""
    if mode == "none":
        return DataPlaneAuth("none", host)
    d = Path(certs)
    files = TlsFiles(str(d / "ca.pem"), str(d / f"{host}.pem"), str(d / f"{host}.key"))
    return DataPlaneAuth(mode, host, load_secret(str(d / "dataplane.secret")), files)


def _dataplane_receiver(
    mode: str, crc_impl: str, ctl: Connection, results: Connection, auth: str = "none", certs: str = ""
) -> None:
    use_crc32(crc_impl)
    alloc, close = _allocator(mode)
    last = [_cpu()]

    def handler(frame: Frame) -> Response:
        now = _cpu()
        results.send(now - last[0])  # CPU since the previous frame: this frame's receive + ACK
        last[0] = now
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

    listener = DataPlaneListener(
        "127.0.0.1:0", handler, FrameLimits(), alloc=alloc, auth=_auth(auth, "h0", certs)
    )
    ctl.send(listener.start())
    ctl.recv()  # wait for "stop"
    listener.stop()
    close()


def dataplane_session(
    name: str,
    nbytes: int,
    ctx: Any,
    *,
    pass_crc: bool,
    alloc: str,
    mapped: bool = False,
    auth: str = "none",
    certs: str = "",
) -> Session:
    """UPDATE -> ACK through the data plane (``PeerPool.request``; framing calls for sendfile).

    ``auth``: the connection authenticates (``hmac``: handshake, then sendfile as without;
    ``tls``: mTLS, every byte encrypted, no sendfile) with the files in ``certs``.
    """
    ctl, ctl_child = ctx.Pipe()
    results, results_child = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_dataplane_receiver,
        args=(alloc, crc32_implementation(), ctl_child, results_child, auth, certs),
    )
    proc.start()
    fd = os.memfd_create("bench-update")
    pool = PeerPool(FrameLimits(), io_timeout=300, auth=_auth(auth, "h1", certs))
    sock: socket.socket | None = None
    try:
        address = ctl.recv()
        os.write(fd, memoryview(_payload(nbytes).data))
        span = FileSpan(fd, 0, nbytes)
        header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, job="bench", server="s")
        header.tensors.add(name="w", dtype="uint8", shape=[nbytes], offset=0, nbytes=nbytes)
        crc = payload_crc32(span) if pass_crc else None
        if mapped:
            sock = socket.create_connection(parse_address(address))
        for i in itertools.count():
            header.update_id = f"u{i}"
            c0, t0 = _cpu(), time.perf_counter()
            if sock is None:
                kind = pool.request(address, header, span, crc32=crc).header.kind
            else:  # the same frames, sent from a mapping with sendall instead of os.sendfile
                send_frame(sock, header, span, crc32=crc, zero_copy=False)
                reply = recv_frame(sock, FrameLimits())
                kind = reply.header.kind if reply is not None else dataplane_pb2.FRAME_KIND_ERROR
            t1, c1 = time.perf_counter(), _cpu()
            if kind != dataplane_pb2.FRAME_KIND_ACK:
                raise RuntimeError(f"data plane replied {kind}")
            yield {name: (t1 - t0, c1 - c0 + results.recv())}
    finally:
        if sock is not None:
            sock.close()
        pool.close()
        os.close(fd)
        ctl.send("stop")
        proc.join(30)


# --------------------------------------------------------------------------- (b) gloo
def _gloo_rank(rank: int, init: str, nbytes: int, ctl: Connection) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ack = torch.zeros(1, dtype=torch.uint8)
    tensor = torch.from_numpy(_payload(nbytes)) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    ctl.send("ready")
    while ctl.recv() == "go":
        c0, t0 = _cpu(), time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(ack, src=1)
        else:
            dist.recv(tensor, src=0)
            dist.send(ack, dst=0)
        ctl.send((time.perf_counter() - t0, _cpu() - c0))
    dist.destroy_process_group()


def gloo_session(name: str, nbytes: int, ctx: Any) -> Session:
    """torch.distributed gloo send/recv (+ a 1-byte reply)."""
    with tempfile.TemporaryDirectory() as tmp:
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [
            ctx.Process(target=_gloo_rank, args=(r, f"file://{tmp}/store", nbytes, pipes[r][1]))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        try:
            for ctl, _ in pipes:
                ctl.recv()
            while True:
                for ctl, _ in pipes:
                    ctl.send("go")
                (wall, cpu0), (_, cpu1) = pipes[0][0].recv(), pipes[1][0].recv()
                yield {name: (wall, cpu0 + cpu1)}
        finally:
            for ctl, _ in pipes:
                ctl.send("stop")
            for p in procs:
                p.join(60)


# --------------------------------------------------------------------------- (c) raw TCP
def _tcp_receiver(nbytes: int, ctl: Connection, results: Connection) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    ctl.send(server.getsockname()[1])
    conn, _ = server.accept()
    view = memoryview(bytearray(nbytes))
    while True:
        c0 = _cpu()
        if not _recv_exact_into(conn, view):
            break
        conn.sendall(ACK)
        results.send(_cpu() - c0)
    conn.close()
    server.close()


def raw_tcp_session(name: str, nbytes: int, ctx: Any) -> Session:
    """A plain TCP socket: sendall / recv_into (+ a 1-byte reply)."""
    ctl, ctl_child = ctx.Pipe()
    results, results_child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_tcp_receiver, args=(nbytes, ctl_child, results_child))
    proc.start()
    data = memoryview(_payload(nbytes).data)
    try:
        with socket.create_connection(("127.0.0.1", ctl.recv())) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                c0, t0 = _cpu(), time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != ACK:
                    raise RuntimeError("raw TCP receiver closed")
                t1, c1 = time.perf_counter(), _cpu()
                yield {name: (t1 - t0, c1 - c0 + results.recv())}
    finally:
        proc.join(30)


# --------------------------------------------------------------------------- (d) hand-off
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


def handoff_session(name: str, nbytes: int, ctx: Any, *, reuse: bool) -> Session:
    """The update into a memfd, the fd over SCM_RIGHTS, the daemon's reply.

    ``reuse=False`` is ``mlfabric.tensorio.to_memfd`` (a new memfd per push, as ``Worker.push``
    did before its memfd pool); ``reuse=True`` copies into a recycled memfd (what ``Worker.push``
    does once the previous push resolved), so no page is allocated and zeroed.
    """
    from mlfabric import tensorio
    from mlfabric import tensors as tcodec

    update = {"w": np.ones(nbytes // 4, np.float32)}
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
                    if reuse:
                        layouts, total = tcodec.plan_layout(update)
                        buf = kept.allocate(total)
                        tcodec.encode_into(buf, update, layouts)
                        fd = buf.fd
                    else:
                        fd, _layouts, total = tensorio.to_memfd(update, name="bench-update")
                    socket.send_fds(sock, [str(total).encode()], [fd])
                    if sock.recv(1) != ACK:
                        raise RuntimeError("hand-off receiver closed")
                    t1, c1 = time.perf_counter(), _cpu()
                    if reuse:
                        buf.release()
                    else:
                        os.close(fd)
                    yield {name: (t1 - t0, c1 - c0 + results.recv())}
        finally:
            proc.join(30)
            kept.close()


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


def api_session(nbytes: int, ctx: Any) -> Session:
    """``Worker.push`` through a real cluster (scheduler + two daemon processes, policy fair).

    Yields the seconds from ``push()`` until the worker's daemon accepted the update (the
    hand-off through the local API) and until it was APPLIED at the server (hand-off, the
    scheduler's directive, the data-plane transfer between the two daemons, the server's
    ``on_update`` and the verdict's way back).
    """
    import mlfabric
    from mlfabric.cluster import LocalCluster

    update = {"w": np.ones(nbytes // 4, np.float32)}
    with tempfile.TemporaryDirectory(prefix="mlfb-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(_TOPOLOGY)
        with LocalCluster(topo, policy="fair", workdir=tmp) as cluster:
            ctl, ctl_child = ctx.Pipe()
            proc = ctx.Process(target=_api_server, args=(cluster.socket("ps"), nbytes, ctl_child))
            proc.start()
            try:
                ctl.recv()
                with mlfabric.register_as_worker("bench", name="w0", daemon=cluster.socket("w0")) as worker:
                    while True:
                        t0 = time.perf_counter()
                        handle = worker.push("ps0", update, norm=1.0)
                        while not handle.update_id and not handle.done():
                            time.sleep(0.0005)
                        t1 = time.perf_counter()
                        result = handle.wait(300)
                        t2 = time.perf_counter()
                        if result.status != mlfabric.APPLIED:
                            raise RuntimeError(f"push not applied: {result}")
                        yield {"api_handoff": (t1 - t0, None), "api_push_applied": (t2 - t0, None)}
            finally:
                ctl.send("stop")
                proc.join(30)


# --------------------------------------------------------------------------- report
NOTES = """## What the rows are

- `dataplane`: `PeerPool.request` of an UPDATE whose payload is a memfd (`FileSpan`, sent with
  `os.sendfile`) to a `DataPlaneListener` in another process that receives into recycled memfds
  (`MemfdPool`), checks the CRC-32 and answers ACK. The CRC is passed in, as when it is computed
  at hand-off time (while the update waits for the scheduler's directive).
- `dataplane_trailer`: the CRC is not known; the sender computes it while sending and appends it.
- `dataplane_mapped`: the span sent from a mapping with `sendall` (`zero_copy=False`) instead
  of `os.sendfile`.
- `dataplane_fresh`: the receiver allocates a new memfd per frame (`mlfabric.wire.memfd.allocate`,
  what the daemon did before it received into a `MemfdPool`): every page is allocated and zeroed
  on first touch.
- `dataplane_hmac`: as `dataplane`, the pooled connection authenticated once by the HMAC
  challenge/response (`data_auth = "hmac"`); payload bytes in the clear, still `os.sendfile`.
- `dataplane_tls`: as `dataplane` over mutual TLS (`data_auth = "tls"`, TLS 1.3 AES-GCM by
  default): every byte encrypted and decrypted in user space; no `sendfile` through TLS.
- `gloo`, `raw_tcp`: the same bytes, receiver reusing one buffer; a 1-byte reply ends each timing.
- `handoff`: `mlfabric.tensorio.to_memfd` (new memfd) + SCM_RIGHTS + reply, measured directly;
  `handoff_reuse`: the update copied into a memfd kept from push to push.
- `api_handoff`: `Worker.push` through a real cluster (scheduler and two `mlfabric daemon`
  processes) until the worker's daemon accepted the update: the update is copied into a memfd
  of the worker's pool (recycled once the previous push resolved) and passed with SCM_RIGHTS.
  `api_push_applied`: until APPLIED (the hand-off, the scheduler's directive, the transfer into
  the server daemon's pooled receive buffer, the server process mapping it and applying it
  with `model -= update`, publishing the new model (one copy into a new memfd) and the verdict's
  way back).

"CPU s per GB" adds the CPU time (user + system, all threads) of the sending and the receiving
process during each timed run (`getrusage`). On a loaded 2-core machine the CPU a transfer needs
is what limits it, and it moves much less with other load than the wall clock: the "by CPU"
ratio (the other case's CPU per GB over this one's) is the steadier comparison. The cases run
interleaved, one transfer of each per round, so load changes hit all of them alike.
"""

Row = tuple[str, str, float, float, float, float | None]


def _row(name: str, what: str, nbytes: int, samples: list[Sample]) -> Row:
    """Median seconds, GB/s, spread, and median CPU seconds per GB (None when not measured)."""
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples if c is not None]
    med = statistics.median(walls)
    cpu = statistics.median(cpus) / (nbytes / 1e9) if cpus else None
    return name, what, med, nbytes / med / 1e9, (max(walls) - min(walls)) / med, cpu


RATIOS = [
    ("dataplane", "gloo", 0.8),
    ("dataplane_trailer", "gloo", 0.8),
    ("dataplane_mapped", "gloo", 0.8),
    ("dataplane_fresh", "gloo", 0.8),
    ("dataplane", "raw_tcp", None),
    ("dataplane_hmac", "dataplane", None),
    ("dataplane_tls", "dataplane", None),
    ("handoff", "dataplane", 2.0),
    ("handoff_reuse", "dataplane", 2.0),
    ("api_handoff", "dataplane", 2.0),
    ("api_push_applied", "dataplane", None),
]


def render(rows: list[Row], nbytes: int, rounds: int, loads: str) -> str:
    """The results as Markdown tables: one row per case, then the target ratios."""
    rate = {row[0]: row[3] for row in rows}
    cpu = {row[0]: row[5] for row in rows}
    lines = [
        f"payload {nbytes / 2**20:.0f} MiB, median of {rounds} interleaved rounds after a warm-up; "
        f"{os.cpu_count()} CPUs; load average {loads}; CRC-32 by {crc32_implementation()}",
        "",
        "| case | what | median s | GB/s | spread (max-min)/median | CPU s per GB (both ends) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {n} | {w} | {m:.3f} | {g:.2f} | {sp:.0%} | {'n/a' if c is None else f'{c:.2f}'} |"
        for n, w, m, g, sp, c in rows
    ]
    lines += ["", "| ratio | by wall clock | by CPU s per GB | target |", "| --- | ---: | ---: | --- |"]
    for num, den, target in RATIOS:
        if num not in rate or den not in rate:
            continue
        value = rate[num] / rate[den]
        num_cpu, den_cpu = cpu[num], cpu[den]
        by_cpu = f"{den_cpu / num_cpu:.2f}" if num_cpu and den_cpu else "n/a"
        goal = "" if target is None else f">= {target:g} " + ("(met)" if value >= target else "(NOT met)")
        lines.append(f"| {num} / {den} | {value:.2f} | {by_cpu} | {goal} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    parser.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    parser.add_argument(
        "--crc", choices=["auto", "isal", "zlib"], default="auto", help="CRC-32 implementation"
    )
    args = parser.parse_args(argv)
    if args.crc != "auto":
        use_crc32(args.crc)
    n = args.mib << 20
    ctx = mp.get_context("spawn")
    made: list[str] = []

    def certs() -> str:
        """A test CA, h0/h1 certificates and a secret (``mlfabric certs``), made once."""
        if not made:
            from mlfabric.certs import make_certs

            made.append(tempfile.mkdtemp(prefix="bench-certs-"))
            make_certs(made[0], ["h0", "h1"], ["bench-scheduler"])
        return made[0]

    # (row, description, how to start its session; None: measured by the session of another row)
    described: list[tuple[str, str, Callable[[], Session] | None]] = [
        (
            "dataplane",
            "memfd span -> listener into pooled memfds; CRC known at hand-off",
            lambda: dataplane_session("dataplane", n, ctx, pass_crc=True, alloc="pool"),
        ),
        (
            "dataplane_trailer",
            "same, CRC computed while sending (trailer)",
            lambda: dataplane_session("dataplane_trailer", n, ctx, pass_crc=False, alloc="pool"),
        ),
        (
            "dataplane_mapped",
            "same as dataplane, mmap + sendall instead of os.sendfile",
            lambda: dataplane_session("dataplane_mapped", n, ctx, pass_crc=True, alloc="pool", mapped=True),
        ),
        (
            "dataplane_fresh",
            "same as dataplane, a new memfd per frame (mlfabric.wire.memfd.allocate)",
            lambda: dataplane_session("dataplane_fresh", n, ctx, pass_crc=True, alloc="fresh"),
        ),
        (
            "dataplane_hmac",
            "same as dataplane, connection authenticated (HMAC handshake), sendfile",
            lambda: dataplane_session(
                "dataplane_hmac", n, ctx, pass_crc=True, alloc="pool", auth="hmac", certs=certs()
            ),
        ),
        (
            "dataplane_tls",
            "same as dataplane, over mutual TLS (encrypted, no sendfile)",
            lambda: dataplane_session(
                "dataplane_tls", n, ctx, pass_crc=True, alloc="pool", auth="tls", certs=certs()
            ),
        ),
        ("gloo", "torch.distributed send/recv", lambda: gloo_session("gloo", n, ctx)),
        ("raw_tcp", "sendall / recv_into", lambda: raw_tcp_session("raw_tcp", n, ctx)),
        (
            "handoff",
            "to_memfd (new memfd) + SCM_RIGHTS",
            lambda: handoff_session("handoff", n, ctx, reuse=False),
        ),
        (
            "handoff_reuse",
            "copy into a recycled memfd + SCM_RIGHTS",
            lambda: handoff_session("handoff_reuse", n, ctx, reuse=True),
        ),
        ("api_handoff", "Worker.push until its daemon accepted it", lambda: api_session(n, ctx)),
        ("api_push_applied", "Worker.push until APPLIED (2 daemon processes)", None),
    ]
    wanted = set(args.only.split(",")) if args.only else {name for name, _, _ in described}
    if "api_push_applied" in wanted:
        wanted.add("api_handoff")  # one session measures both
    what = {name: text for name, text, _ in described}
    samples: dict[str, list[Sample]] = {}
    before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        sessions: list[Session] = []
        for name, _, start in described:
            if name in wanted and start is not None:
                session = start()
                stack.callback(session.close)  # teardown: reap the case's processes
                sessions.append(session)
        for round_ in range(args.repeats + 1):
            for session in sessions:
                for name, sample in next(session).items():
                    if round_:  # round 0 is the warm-up
                        samples.setdefault(name, []).append(sample)
            print(f"round {round_}/{args.repeats} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    after = os.getloadavg()
    rows = [_row(name, what[name], n, got) for name, got in samples.items()]
    loads = f"{before[0]:.2f} before, {after[0]:.2f} after (1-min)"
    table = render(rows, n, args.repeats, loads)
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# Data-plane benchmark\n\n`python {' '.join(sys.argv)}`\n\n{table}\n\n{NOTES}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
