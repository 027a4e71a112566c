"""The daemons' data path on loopback, side by side with gloo (DESIGN §5, §9).

In one run, for the same payload (default 256 MiB of finite float32 values, so the receivers'
NaN/inf test reads every byte), between processes on 127.0.0.1:

(a) ``push`` -- a plain push end to end: ``Worker.push`` in a training process, its daemon,
    the server's daemon and the server process applying it (``model += update``), until
    APPLIED, through a real cluster (``mlfabric scheduler`` and two ``mlfabric daemon``
    processes); CPU of those four processes (``/proc/PID/stat``);
(b) ``dataplane*`` -- the daemon hop alone: an UPDATE whose payload is a memfd (``FileSpan``)
    sent with ``PeerPool.request`` to a ``DataPlaneListener`` in another process, received into
    recycled memfds (``MemfdPool``), CRC-32 and NaN/inf checked, answered with ACK; variants for
    where the CRC is computed and for authenticated connections;
(c) ``relay`` / ``sum`` -- one daemon in the middle: it receives each frame (as in (b)) and
    forwards it to a third process (``relay``: ``os.sendfile`` from its receive buffer, as an
    aggregator forwards) or sums it into an accumulator (``sum``: ``Accumulator.add``, as an
    aggregator or an all-reduce hop sums); the middle process's CPU alone, as GB/s per core;
(d) ``gloo`` -- ``torch.distributed`` (gloo) ``send`` of the same bytes, then a 1-byte reply;
(e) ``raw_tcp`` -- a plain socket: ``sendall`` / ``recv_into`` a preallocated buffer, 1-byte reply.

All cases are set up first, then run interleaved, one transfer of each case per round, so a
change of the machine's load hits every case alike; the first round is a warm-up. The tables
show medians and spreads, GB/s (1e9 bytes/s), CPU seconds per GB (``getrusage``, or
``/proc/PID/stat`` for processes the bench did not fork: far less sensitive to other load than
the wall clock), the ratios to gloo, and the relay and sum rates per core next to 10, 25 and
100 Gbit/s. The hand-off from a training process to its daemon is ``bench_handoff.py``.

Run::

    python experiments/bench_dataplane.py --mib 128 --repeats 5 --out experiments/results/bench_dataplane.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
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

from mlfabric.aggregators.kernels import Accumulator
from mlfabric.daemon.channels.frames import FileSpan, Frame, FrameHeader, FrameLimits
from mlfabric.daemon.channels.listener import DataPlaneListener, Response
from mlfabric.daemon.channels.payloadio import payload_crc32
from mlfabric.daemon.channels.peers import PeerPool
from mlfabric.proto.v1 import control_pb2, dataplane_pb2
from mlfabric.wire.auth import DataPlaneAuth, load_secret
from mlfabric.wire.memfd import MemfdPool
from mlfabric.wire.tensors import Layout
from mlfabric.wire.tls import TlsFiles

ACK = b"k"

#: One timed transfer: wall seconds, and CPU seconds of the processes the row counts.
Sample = tuple[float, float | None]
#: A case's running session: each ``next()`` runs one transfer per row it measures.
Session = Generator[dict[str, Sample], None, None]
#: The processes of the sessions started, by role (``profile_dataplane.py`` records one).
PIDS: dict[str, int] = {}


def _cpu() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _proc_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system, all threads, live or gone) the processes ``pids`` have used."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def payload(nbytes: int) -> np.ndarray:
    """Deterministic finite float32 values as bytes (``nbytes`` rounded down to whole floats)."""
    values = np.random.default_rng(0).standard_normal(nbytes // 4, dtype=np.float32)
    return values.view(np.uint8)


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


def _update_header(nbytes: int) -> Any:
    """An UPDATE header of one float32 tensor of ``nbytes`` bytes."""
    header = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, job="bench", server="s")
    header.tensors.add(name="w", dtype="float32", shape=[nbytes // 4], offset=0, nbytes=nbytes)
    return header


def _ack(frame: Frame) -> Response:
    return Response(
        FrameHeader(
            kind=dataplane_pb2.FRAME_KIND_ACK,
            update_id=frame.header.update_id,
            outcome=control_pb2.OUTCOME_APPLIED,
        )
    )


# --------------------------------------------------------------------------- (b) the daemon hop
def _auth(mode: str, host: str, certs: str) -> DataPlaneAuth:
    """The data-plane authentication ``mode`` of ``host`` with the files ``mlfabric certs`` wrote."""
    if mode == "none":
        return DataPlaneAuth("none", host)
    d = Path(certs)
    files = TlsFiles(str(d / "ca.pem"), str(d / f"{host}.pem"), str(d / f"{host}.key"))
    return DataPlaneAuth(mode, host, load_secret(str(d / "dataplane.secret")), files)


def _receiver(
    role: str,
    ctl: Connection,
    results: Connection,
    auth: str = "none",
    certs: str = "",
) -> None:
    """A daemon's listener: ``sink`` ACKs each frame; ``relay`` forwards it, ``sum`` sums it first.

    The address it listens on goes to ``ctl``; ``relay`` then reads the next hop's address from
    ``ctl``. Per frame, the CPU this process used since the previous frame goes to ``results``.
    """
    receive_pool = MemfdPool(max_idle_bytes=2 << 30)
    alloc = receive_pool.allocate
    last = [_cpu()]
    pool = PeerPool(FrameLimits(), io_timeout=300)
    state: dict[str, Any] = {}

    def handler(frame: Frame) -> Response:
        h = frame.header
        if role == "relay":  # on, with its verified CRC, from the receive buffer (sendfile)
            span = FileSpan(frame.buffer.fd, 0, h.payload_bytes)
            reply = pool.request(state["next"], h, span, crc32=h.payload_crc32)
            reply.release()
        elif role == "sum":
            acc = state.get("acc")
            if acc is None:
                out = state["out"] = alloc(h.payload_bytes)
                acc = state["acc"] = Accumulator(
                    [Layout("w", "float32", (h.payload_bytes // 4,), 0, h.payload_bytes)], out
                )
            acc.add(frame.payload)
        frame.release()  # the server process (the next hop) is done with it
        now = _cpu()
        results.send(now - last[0])  # CPU since the previous frame: this frame's receive (+ work) + ACK
        last[0] = now
        return _ack(frame)

    listener = DataPlaneListener(
        "127.0.0.1:0", handler, FrameLimits(), alloc=alloc, auth=_auth(auth, "h0", certs)
    )
    ctl.send(listener.start())
    if role == "relay":
        state["next"] = ctl.recv()
    ctl.recv()  # wait for "stop"
    listener.stop()
    pool.close()
    receive_pool.close()


def _start_receiver(ctx: Any, *args: Any) -> tuple[Any, Connection, Connection, str]:
    """A :func:`_receiver` process; its process, control pipe, results pipe and address."""
    ctl, ctl_child = ctx.Pipe()
    results, results_child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_receiver, args=(args[0], ctl_child, results_child, *args[1:]))
    proc.start()
    return proc, ctl, results, ctl.recv()


def _memfd_payload(nbytes: int) -> tuple[int, FileSpan]:
    fd = os.memfd_create("bench-update")
    os.write(fd, memoryview(payload(nbytes).data))
    return fd, FileSpan(fd, 0, nbytes)


def dataplane_session(
    name: str,
    nbytes: int,
    ctx: Any,
    *,
    pass_crc: bool,
    auth: str = "none",
    certs: str = "",
) -> Session:
    """UPDATE -> ACK through the data plane (``PeerPool.request``; framing calls for sendfile).

    ``auth``: the connection authenticates (``hmac``: handshake, then sendfile as without;
    ``tls``: mTLS, every byte encrypted, no sendfile) with the files in ``certs``.
    """
    proc, ctl, results, address = _start_receiver(ctx, "sink", auth, certs)
    PIDS["receiver"] = proc.pid
    fd, span = _memfd_payload(nbytes)
    pool = PeerPool(FrameLimits(), io_timeout=300, auth=_auth(auth, "h1", certs))
    try:
        header = _update_header(nbytes)
        crc = payload_crc32(span) if pass_crc else None
        for i in itertools.count():
            header.update_id = f"u{i}"
            c0, t0 = _cpu(), time.perf_counter()
            kind = pool.request(address, header, span, crc32=crc).header.kind
            t1, c1 = time.perf_counter(), _cpu()
            if kind != dataplane_pb2.FRAME_KIND_ACK:
                raise RuntimeError(f"data plane replied {kind}")
            yield {name: (t1 - t0, c1 - c0 + results.recv())}
    finally:
        pool.close()
        os.close(fd)
        ctl.send("stop")
        proc.join(30)


# --------------------------------------------------------------------------- (c) relay and sum
def middle_session(name: str, nbytes: int, ctx: Any, *, role: str) -> Session:
    """Frames through a daemon that relays (``role="relay"``) or sums (``"sum"``) them.

    The sample's CPU is the middle process's alone: its receive, its forward or sum, its ACK.
    """
    sink = _start_receiver(ctx, "sink") if role == "relay" else None
    proc, ctl, results, address = _start_receiver(ctx, role)
    PIDS["middle"] = proc.pid
    if sink is not None:
        ctl.send(sink[3])
    fd, span = _memfd_payload(nbytes)
    pool = PeerPool(FrameLimits(), io_timeout=300)
    try:
        header = _update_header(nbytes)
        crc = payload_crc32(span)
        for i in itertools.count():
            header.update_id = f"u{i}"
            t0 = time.perf_counter()
            kind = pool.request(address, header, span, crc32=crc).header.kind
            wall = time.perf_counter() - t0
            if kind != dataplane_pb2.FRAME_KIND_ACK:
                raise RuntimeError(f"{role} replied {kind}")
            if sink is not None:
                sink[2].recv()
            yield {name: (wall, results.recv())}
    finally:
        pool.close()
        os.close(fd)
        for p, c, *_ in (x for x in ((proc, ctl), sink) if x is not None):
            c.send("stop")
            p.join(30)


# --------------------------------------------------------------------------- (a) a push end to end
#: The cluster of a push: the server's host and the worker's, 100 Gbit/s NICs on one switch.
_TOPOLOGY = {
    "hosts": ["ps", "w0"],
    "switches": ["sw"],
    "links": [{"a": "ps", "b": "sw", "gbps": 100}, {"a": "w0", "b": "sw", "gbps": 100}],
}


def _push_server(socket_path: str, nbytes: int, ctl: Connection) -> None:
    """The server process: applies each update in place (one read of it); publishes a tiny model."""
    import mlfabric

    model = {"w": np.zeros(nbytes // 4, np.float32)}
    server = mlfabric.register_as_server(
        "bench", "ps0", model, mlfabric.Params(tau_max=1 << 20), daemon=socket_path
    )
    server.on_request(lambda: {"v": np.zeros(1, np.float32)})  # not the pushes' cost: no model copy

    @server.on_update
    def apply(update: dict[str, Any], meta: Any) -> None:
        np.add(server.model["w"], update["w"], out=server.model["w"])

    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    ctl.send("ready")
    ctl.recv()  # "stop"
    server.stop()
    thread.join(10)
    server.close()


def _push_worker(socket_path: str, nbytes: int, ctl: Connection) -> None:
    """The training process: on each "go", one ``Worker.push`` until APPLIED; sends the wall time."""
    import mlfabric

    update = {"w": payload(nbytes).view(np.float32)}
    with mlfabric.register_as_worker("bench", name="w0", daemon=socket_path) as worker:
        ctl.send("ready")
        while ctl.recv() == "go":
            t0 = time.perf_counter()
            result = worker.push("ps0", update, norm=1.0).wait(300)
            if result.status != mlfabric.APPLIED:
                raise RuntimeError(f"push not applied: {result}")
            ctl.send(time.perf_counter() - t0)


def push_session(name: str, nbytes: int, ctx: Any) -> Session:
    """``Worker.push`` through a real cluster (scheduler + two daemon processes, policy fair).

    The sample's CPU is that of the training process, both daemons and the server process
    (``/proc/PID/stat``, 10 ms ticks: use a payload of 100 MB or more).
    """
    from mlfabric.cluster import LocalCluster
    from mlfabric.testbed.topologies import to_toml

    with tempfile.TemporaryDirectory(prefix="mlfb-") as tmp:
        topo = Path(tmp) / "topology.toml"
        topo.write_text(to_toml(_TOPOLOGY))
        with LocalCluster(topo, policy="fair", workdir=tmp) as cluster:
            pipes = [ctx.Pipe() for _ in range(2)]
            procs = [
                ctx.Process(target=target, args=(cluster.socket(host), nbytes, pipe[1]))
                for target, host, pipe in ((_push_server, "ps", pipes[0]), (_push_worker, "w0", pipes[1]))
            ]
            for p in procs:
                p.start()
            server, worker = (pipe[0] for pipe in pipes)
            try:
                server.recv()
                worker.recv()
                pids = [p.pid for p in procs] + [int(cluster.daemons[h]["pid"]) for h in ("ps", "w0")]
                PIDS.update(zip(("server", "worker", "receiver", "sender"), pids, strict=True))
                while True:
                    c0 = _proc_cpu(pids)
                    worker.send("go")
                    wall = worker.recv()
                    yield {name: (wall, _proc_cpu(pids) - c0)}
            finally:
                worker.send("stop")
                server.send("stop")
                for p in procs:
                    p.join(30)


# --------------------------------------------------------------------------- (d) gloo
def _gloo_rank(rank: int, init: str, nbytes: int, ctl: Connection) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    ack = torch.zeros(1, dtype=torch.uint8)
    tensor = torch.from_numpy(payload(nbytes)) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
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


# --------------------------------------------------------------------------- (e) raw TCP
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
    data = memoryview(payload(nbytes).data)
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


# --------------------------------------------------------------------------- report
NOTES = """## What the rows are

- `push`: `Worker.push` through a real cluster (scheduler and two `mlfabric daemon` processes)
  until APPLIED: the training process copies the update into a memfd of its pool (with its
  CRC-32), its daemon sends it (`os.sendfile`) after the scheduler's directive, the server's
  daemon receives it into a pooled memfd (CRC-32 and NaN/inf test) and passes the fd to the
  server process, which maps it and applies it in place (`model += update`, one read) and
  publishes a 4-byte model. CPU: those four processes (not the scheduler).
- `dataplane`: the daemon hop alone: `PeerPool.request` of an UPDATE whose payload is a memfd
  (`FileSpan`, `os.sendfile`) to a `DataPlaneListener` in another process that receives into
  recycled memfds (`MemfdPool`), checks the CRC-32 and the float32 values, and answers ACK.
  The CRC is passed in, as when it comes from the training process. CPU: both processes.
- `dataplane_trailer`: the CRC is not known; the sender computes it while sending.
- `dataplane_hmac` / `dataplane_tls`: the pooled connection authenticated once by the HMAC
  challenge/response (payload in the clear, still sendfile) / over mutual TLS (every byte
  encrypted in user space, no sendfile).
- `relay`: a middle daemon receives each frame as in `dataplane` and forwards it from its
  receive buffer (`os.sendfile`, the verified CRC passed on) to a third process before it
  ACKs: an aggregator's or a tree's forward. `sum`: the middle daemon sums each frame into an
  accumulator (`Accumulator.add`, float32 in place). CPU: the middle process alone; "GB/s per
  core" is payload bytes over that CPU time.
- `gloo`, `raw_tcp`: the same bytes, receiver reusing one buffer; a 1-byte reply ends each timing.

"CPU s per GB" adds the CPU time (user + system, all threads) of the processes a row counts
during each timed run. On a loaded 2-core machine the CPU a transfer needs is what limits it,
and it moves much less with other load than the wall clock. The cases run interleaved, one
transfer of each per round, so load changes hit all of them alike.
"""

Row = tuple[str, str, float, float, float, float | None, float]

#: Rows whose CPU is one daemon's (rates per core), not a transfer's ends.
PER_CORE = ("relay", "sum")
#: Link rates the per-core rates are set against (Gbit/s).
LINKS = (10, 25, 100)
RATIOS = [
    ("push", "gloo"),
    ("dataplane", "gloo"),
    ("dataplane_trailer", "gloo"),
    ("dataplane", "raw_tcp"),
    ("dataplane_hmac", "dataplane"),
    ("dataplane_tls", "dataplane"),
]


def _row(name: str, what: str, nbytes: int, samples: list[Sample]) -> Row:
    """Median seconds, GB/s, wall spread, median CPU s per GB (None: not measured), CPU spread."""
    walls = [w for w, _ in samples]
    cpus = [c for _, c in samples if c is not None]
    med = statistics.median(walls)
    cpu = statistics.median(cpus) / (nbytes / 1e9) if cpus else None
    cpu_spread = (
        (max(cpus) - min(cpus)) / statistics.median(cpus) if cpus and statistics.median(cpus) else 0.0
    )
    return name, what, med, nbytes / med / 1e9, (max(walls) - min(walls)) / med, cpu, cpu_spread


def render(rows: list[Row], nbytes: int, rounds: int, loads: str) -> str:
    """The results as Markdown tables: transfers, ratios to gloo, per-core relay and sum rates."""
    rate = {row[0]: row[3] for row in rows}
    cpu = {row[0]: row[5] for row in rows}
    lines = [
        f"payload {nbytes / 2**20:.0f} MiB float32, median of {rounds} interleaved rounds after a "
        f"warm-up; {os.cpu_count()} CPUs; load average {loads}",
        "",
        "| case | what | median s | GB/s | spread (max-min)/median | CPU s per GB | CPU spread |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {n} | {w} | {m:.3f} | {g:.2f} | {sp:.0%} | {'n/a' if c is None else f'{c:.2f}'} | {cs:.0%} |"
        for n, w, m, g, sp, c, cs in rows
        if n not in PER_CORE
    ]
    lines += ["", "| ratio | by wall clock | CPU s per GB: this / other |", "| --- | ---: | ---: |"]
    for num, den in RATIOS:
        if num in rate and den in rate:
            num_cpu, den_cpu = cpu[num], cpu[den]
            by_cpu = f"{num_cpu / den_cpu:.2f}" if num_cpu and den_cpu else "n/a"
            lines.append(f"| {num} / {den} | {rate[num] / rate[den]:.2f} | {by_cpu} |")
    per_core = [r for r in rows if r[0] in PER_CORE and r[5]]
    if per_core:
        links = " | ".join(f"{g} Gbit/s ({g / 8:.2f} GB/s)" for g in LINKS)
        lines += ["", f"| one daemon | GB/s per core | CPU s per GB | CPU spread | {links} |"]
        lines.append("| --- | ---: | ---: | ---: |" + " ---: |" * len(LINKS))
        for n, _w, _m, _g, _sp, c, cs in per_core:
            assert c is not None
            shares = " | ".join(f"{(1 / c) / (g / 8):.2f}x" for g in LINKS)
            lines.append(f"| {n} | {1 / c:.2f} | {c:.2f} | {cs:.0%} | {shares} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="payload size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="also write the tables to this Markdown file")
    parser.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    args = parser.parse_args(argv)
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

    def hop(name: str, *, auth: str = "none", pass_crc: bool = True) -> Callable[[], Session]:
        def start() -> Session:
            files = certs() if auth != "none" else ""
            return dataplane_session(name, n, ctx, pass_crc=pass_crc, auth=auth, certs=files)

        return start

    described: list[tuple[str, str, Callable[[], Session]]] = [
        ("push", "Worker.push until APPLIED (4 processes)", lambda: push_session("push", n, ctx)),
        ("dataplane", "memfd span -> listener into pooled memfds; CRC known", hop("dataplane")),
        (
            "dataplane_trailer",
            "same, CRC computed while sending (trailer)",
            hop("dataplane_trailer", pass_crc=False),
        ),
        (
            "dataplane_hmac",
            "same as dataplane, HMAC-authenticated connection",
            hop("dataplane_hmac", auth="hmac"),
        ),
        (
            "dataplane_tls",
            "same as dataplane, over mutual TLS (no sendfile)",
            hop("dataplane_tls", auth="tls"),
        ),
        ("relay", "receive, forward with sendfile", lambda: middle_session("relay", n, ctx, role="relay")),
        ("sum", "receive, sum into an accumulator", lambda: middle_session("sum", n, ctx, role="sum")),
        ("gloo", "torch.distributed send/recv", lambda: gloo_session("gloo", n, ctx)),
        ("raw_tcp", "sendall / recv_into", lambda: raw_tcp_session("raw_tcp", n, ctx)),
    ]
    wanted = set(args.only.split(",")) if args.only else {name for name, _, _ in described}
    what = {name: text for name, text, _ in described}
    samples: dict[str, list[Sample]] = {}
    before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        sessions: list[Session] = []
        for name, _, start in described:
            if name in wanted:
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
