"""The NaN/inf check fused into the receiver's CRC pass: receive rate with it vs CRC only (DESIGN §9).

Issue #16 (defect 8) asks for non-finite updates to be refused where the payload is already
being read. The receiving daemon checks each received piece of 1 MiB right behind the socket
copy, while it is in cache: ``mlfabric.wire._native.check`` computes its CRC-32 and, with the
check, tests the exponent bits of its float values in the same pass (in 64 KiB steps).

Two measurements, cases interleaved per round (so load changes hit all alike), medians:

(a) ``receive`` -- an UPDATE frame sent by another process over TCP on 127.0.0.1 with
    ``os.sendfile`` from a memfd (CRC known, as a daemon forwards a push), received with
    :func:`recv_frame` into a reused buffer, ``check_finite=None`` (CRC only) vs the default
    (CRC + NaN/inf): wall-clock GB/s and the receiving process's CPU seconds per GB;
(b) ``in memory`` -- the same pass over a buffer already in memory, no socket, on one thread:
    CRC-32 only vs CRC-32 + check (the CPU cost of the check itself), and the way before
    this check: the CRC pass, then a separate pass of ``first_non_finite`` over the payload.

Under load from other processes the wall-clock rates vary; "ratio of best" compares the
fastest round of each mode, and the CPU seconds per GB are the steadier figure.

Run::

    python experiments/bench_finite.py                 # 128 MiB, float32/float16/bfloat16
    python experiments/bench_finite.py --mib 256 --repeats 9 --out experiments/results/bench_finite.md
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from mlfabric.daemon.channels.frames import FileSpan, FrameHeader, FrameLimits, recv_frame, send_frame
from mlfabric.daemon.channels.payloadio import RECV_PIECE_BYTES, payload_crc32
from mlfabric.proto.v1 import dataplane_pb2
from mlfabric.tensors import decode, first_non_finite, layouts_from_pb, pack_layout
from mlfabric.wire import _native

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _payload(dtype: str, nbytes: int) -> np.ndarray:
    """Finite values of ``dtype`` (bfloat16: raw words of finite values)."""
    rng = np.random.default_rng(0)
    values = rng.standard_normal(nbytes // np.dtype(DTYPES[dtype]).itemsize).astype(np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(DTYPES[dtype])


def _header(dtype: str, arr: np.ndarray) -> FrameHeader:
    h = FrameHeader(kind=dataplane_pb2.FRAME_KIND_UPDATE, update_id="bench/0/1", job="j", server="s")
    h.tensors.add(name="t", dtype=dtype, shape=[arr.size], offset=0, nbytes=arr.nbytes)
    return h


def _sender(address: tuple[str, int], nbytes: int, ctl: Connection) -> None:
    """Connect, then send the frame of each dtype ``ctl`` names, until it says stop."""
    spans = {}
    for dtype in DTYPES:
        arr = _payload(dtype, nbytes)
        fd = os.memfd_create(f"bench-{dtype}")
        os.write(fd, arr.tobytes())
        spans[dtype] = (
            FileSpan(fd, 0, arr.nbytes),
            _header(dtype, arr),
            payload_crc32(FileSpan(fd, 0, arr.nbytes)),
        )
    sock = socket.create_connection(address)
    ctl.send("ready")
    while (dtype := ctl.recv()) is not None:
        span, header, crc = spans[dtype]
        send_frame(sock, header, span, crc32=crc)
    sock.close()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def receive_rates(nbytes: int, repeats: int) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """(dtype, mode) -> [(GB/s, CPU s/GB)] per timed round; mode ``crc`` or ``crc+finite``."""
    server = socket.create_server(("127.0.0.1", 0))
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(server.getsockname(), nbytes, theirs), daemon=True)
    proc.start()
    sock, _ = server.accept()
    assert ours.recv() == "ready"
    buf = mmap.mmap(-1, nbytes)
    buf.write(b"\x01" * nbytes)  # touched once, reused: like the daemon's buffer pool
    limits = FrameLimits(max_payload_bytes=nbytes)
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for rnd in range(repeats + 1):  # round 0: warm-up
            for dtype in DTYPES:
                for mode, check in (("crc", None), ("crc+finite", "default")):
                    ours.send(dtype)
                    t0, c0 = time.perf_counter(), _cpu()
                    if check is None:
                        frame = recv_frame(sock, limits, lambda n: buf, check_finite=None)
                    else:
                        frame = recv_frame(sock, limits, lambda n: buf)
                    t1, c1 = time.perf_counter(), _cpu()
                    assert frame is not None and frame.non_finite is None
                    assert frame.finite_checked == (check is not None)
                    frame.payload.release()
                    if rnd:
                        out.setdefault((dtype, mode), []).append(
                            (nbytes / (t1 - t0) / 1e9, (c1 - c0) / (nbytes / 1e9))
                        )
    finally:
        ours.send(None)
        proc.join(10)
        sock.close()
        server.close()
    return out


def in_memory_rates(nbytes: int, repeats: int) -> dict[tuple[str, str], list[float]]:
    """(dtype, mode) -> [GB/s] of one pass over a buffer in memory, on this thread."""
    out: dict[tuple[str, str], list[float]] = {}
    for dtype in DTYPES:
        arr = _payload(dtype, nbytes)
        view = memoryview(arr.tobytes())
        layouts = layouts_from_pb(_header(dtype, arr).tensors)
        for rnd in range(repeats + 1):
            for mode in ("crc", "crc+finite", "crc, then pass"):
                layout = pack_layout(layouts) if mode == "crc+finite" else b""
                t0 = time.perf_counter()
                crc, bad = 0, -1
                for pos in range(0, view.nbytes, RECV_PIECE_BYTES):  # as recv_payload does
                    crc, bad = _native.check(view, pos, min(view.nbytes, pos + RECV_PIECE_BYTES), crc, layout)
                if mode == "crc, then pass":  # the old way: the server process's own read after
                    assert first_non_finite(decode(view, layouts, copy=False)) is None
                seconds = time.perf_counter() - t0
                if rnd:
                    out.setdefault((dtype, mode), []).append(view.nbytes / seconds / 1e9)
                assert bad < 0
    return out


def render(nbytes: int, repeats: int, rx: dict, mem: dict) -> str:
    lines = [
        f"Payload {nbytes >> 20} MiB, {repeats} timed rounds (medians), CRC-32 and NaN/inf test by "
        f"mlfabric.wire._native ({_native.implementation()}), {os.cpu_count()} CPUs.",
        "",
        "| dtype | receive GB/s: CRC only | CRC + NaN/inf | ratio | ratio of best | receiver CPU s/GB: "
        "CRC only | CRC + NaN/inf | in memory GB/s: CRC only | CRC + NaN/inf | ratio "
        "| CRC, then a separate pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype in DTYPES:
        a = statistics.median(r for r, _ in rx[(dtype, "crc")])
        b = statistics.median(r for r, _ in rx[(dtype, "crc+finite")])
        ca = statistics.median(c for _, c in rx[(dtype, "crc")])
        cb = statistics.median(c for _, c in rx[(dtype, "crc+finite")])
        best = max(r for r, _ in rx[(dtype, "crc+finite")]) / max(r for r, _ in rx[(dtype, "crc")])
        ma = statistics.median(mem[(dtype, "crc")])
        mb = statistics.median(mem[(dtype, "crc+finite")])
        mc = statistics.median(mem[(dtype, "crc, then pass")])
        lines.append(
            f"| {dtype} | {a:.2f} | {b:.2f} | {b / a:.2f} | {best:.2f} | {ca:.3f} | {cb:.3f} "
            f"| {ma:.2f} | {mb:.2f} | {mb / ma:.2f} | {mc:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="payload size in MiB (default 128)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    args = parser.parse_args(argv)
    nbytes = args.mib << 20
    rx = receive_rates(nbytes, args.repeats)
    mem = in_memory_rates(nbytes, args.repeats)
    table = render(nbytes, args.repeats, rx, mem)
    sys.stdout.write(table)
    if args.out is not None:
        args.out.write_text("# NaN/inf check in the CRC pass (`experiments/bench_finite.py`)\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
