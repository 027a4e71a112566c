"""Run the coverage-guided fuzz targets under ``fuzz/`` for a while each and tabulate the numbers.

Usage::

    python experiments/fuzz_long.py [--seconds 180] [--targets dataplane local control] [--out DIR]

Each target (``fuzz/fuzz_<name>.py``, atheris + libFuzzer) runs as its own process for
``--seconds`` with a corpus directory under ``--out`` (default: a temporary directory), so a
second run continues from the corpus of the first when ``--out`` is kept. Prints one Markdown
table row per target: inputs run, inputs per second, coverage (libFuzzer's ``cov``/``ft``),
corpus size and crashes (``crash-*``/``timeout-*``/``oom-*`` files, kept in ``--out``). Exit
status 1 when any target crashed. Needs ``pip install atheris`` (a manylinux wheel for
CPython 3.11 exists, so no C++ toolchain is needed).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["dataplane", "local", "control"]
_STATUS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")


def seeds(name: str) -> list[bytes]:
    """A few well-formed inputs to start the corpus of ``name`` from."""
    import socket
    import struct

    from mlfabric.daemon.channels.frames import send_frame
    from mlfabric.proto.v1 import control_pb2, dataplane_pb2, local_pb2

    if name == "dataplane":
        out = []
        for kind, payload in (
            (dataplane_pb2.FRAME_KIND_UPDATE, bytes(64)),
            (dataplane_pb2.FRAME_KIND_GET, b""),
        ):
            header = dataplane_pb2.FrameHeader(kind=kind, job="job", server="ps0", update_id="w0/1")
            if payload:
                header.tensors.add(name="w", dtype="float64", shape=[8], offset=0, nbytes=64)
            a, b = socket.socketpair()
            with a, b:
                send_frame(a, header, payload or None)
                a.shutdown(socket.SHUT_WR)
                out.append(b.recv(1 << 16))
        return out
    if name == "local":
        push = local_pb2.PushRequest(server="ps0", payload_bytes=64, has_payload=True)
        push.tensors.add(name="w", dtype="float64", shape=[8], offset=0, nbytes=64)
        requests = [
            local_pb2.LocalRequest(request_id=1, register_worker=local_pb2.RegisterWorkerRequest(job="job")),
            local_pb2.LocalRequest(request_id=2, push=push),
        ]
        bodies = [r.SerializeToString() for r in requests]
        return [b"".join(struct.pack(">I", len(body)) + body for body in bodies)]
    ready = control_pb2.UpdateReady(update_id="w0/1", job="job", server="ps0", worker="w0", bytes=64)
    return [b"\x01" + control_pb2.DaemonMessage(update_ready=ready).SerializeToString()]


def run_target(name: str, seconds: int, out: Path) -> dict[str, object]:
    """Run ``fuzz/fuzz_<name>.py`` for ``seconds``; its numbers from libFuzzer's output."""
    corpus = out / "corpus" / name
    artifacts = out / "artifacts" / name
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds(name)):
        (corpus / f"seed-{i}").write_bytes(seed)
    artifacts.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        str(ROOT / "fuzz" / f"fuzz_{name}.py"),
        f"-max_total_time={seconds}",
        f"-artifact_prefix={artifacts}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=ROOT)
    wall = time.monotonic() - start
    log = proc.stdout + proc.stderr
    (out / f"{name}.log").write_text(log)
    status = _STATUS.findall(log)
    done = _DONE.search(log)
    runs = int(done.group(1)) if done else (int(status[-1][0]) if status else 0)
    fuzzing = int(done.group(2)) if done else wall  # libFuzzer's own clock: start-up excluded
    crashes = sorted(p.name for p in artifacts.iterdir())
    return {
        "target": name,
        "runs": runs,
        "seconds": wall,
        "per_second": runs / fuzzing if fuzzing > 0 else 0.0,
        "cov": int(status[-1][1]) if status else 0,
        "ft": int(status[-1][2]) if status else 0,
        "corpus": len(list(corpus.iterdir())),
        "crashes": crashes,
        "exit": proc.returncode,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=180, help="seconds per target (default 180)")
    parser.add_argument("--targets", nargs="+", default=TARGETS, choices=TARGETS)
    parser.add_argument("--out", type=Path, help="corpus, logs and crashes (default: a temporary directory)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="mlfabric-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"# coverage-guided fuzzing, {args.seconds} s per target; corpus, logs and crashes in {out}")
    print("| target | inputs | inputs/s | cov | ft | corpus | crashes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    crashed = False
    for name in args.targets:
        r = run_target(name, args.seconds, out)
        crashes = [str(c) for c in r["crashes"]]  # type: ignore[attr-defined]
        crashed |= bool(crashes) or r["exit"] != 0
        print(
            f"| {name} | {r['runs']:,} | {r['per_second']:,.0f} | {r['cov']} | {r['ft']} | {r['corpus']} "
            f"| {', '.join(crashes) or 0} |",
            flush=True,
        )
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
