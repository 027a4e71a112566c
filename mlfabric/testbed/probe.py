"""A bulk TCP transfer between two emulated hosts, measured at the receiver.

Run inside the hosts' namespaces (no mlfabric daemon needed)::

    python -m mlfabric.testbed.probe recv --listen 198.18.0.2:0 --ready-file F
    python -m mlfabric.testbed.probe send --to 198.18.0.2:PORT --bytes 20000000

The receiver writes ``{"address": "ip:port"}`` to the ready file (atomically), accepts one
connection, reads to EOF and prints one JSON line: ``bytes``, ``first`` and ``last``
(monotonic seconds of the first and last byte) and ``throughput`` in bytes/s over that
interval — the rate the link delivered once the first byte was through.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "receive", "send"]

CHUNK = 1 << 20


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def receive(listen: str, ready_file: Path, timeout: float) -> dict[str, float]:
    """Accept one connection on ``listen`` and measure it until EOF."""
    with socket.create_server(_split(listen)) as server:
        server.settimeout(timeout)
        host, port = server.getsockname()[:2]
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "address": f"{host}:{port}"}))
        tmp.replace(ready_file)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout)
        buf = bytearray(CHUNK)
        total, first, last = 0, 0.0, 0.0
        while n := conn.recv_into(buf):
            last = time.monotonic()
            if total == 0:
                first = last
            total += n
    span = last - first
    return {"bytes": total, "first": first, "last": last, "throughput": total / span if span > 0 else 0.0}


def send(to: str, nbytes: int, timeout: float) -> dict[str, float]:
    """Send ``nbytes`` to ``to`` and close; return the sender's view of the time."""
    payload = memoryview(bytes(CHUNK))
    start = time.monotonic()
    with socket.create_connection(_split(to), timeout=timeout) as conn:
        left = nbytes
        while left > 0:
            n = min(left, CHUNK)
            conn.sendall(payload[:n])
            left -= n
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # wait for the receiver to close: every byte is through
    return {"bytes": nbytes, "seconds": time.monotonic() - start}


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m mlfabric.testbed.probe", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--listen", required=True)
    r.add_argument("--ready-file", type=Path, required=True)
    r.add_argument("--timeout", type=float, default=120.0)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--bytes", type=int, required=True)
    s.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.mode == "recv":
        result = receive(args.listen, args.ready_file, args.timeout)
    else:
        result = send(args.to, args.bytes, args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
