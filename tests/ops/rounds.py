"""Synchronous rounds through two daemons, as a script: ``python rounds.py SERVER_SOCKET WORKER_SOCKET N``.

A server of job ``rounds`` registers on the first daemon with ``sync_workers=2``; two workers
on the second each push, wait for the verdict, get the round's model (``min_version``) and
push again, ``N`` rounds. Prints one JSON line ``{"applied": a, "version": v}``; exits 0 when
every push was applied.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

import mlfabric


def main(server_socket: str, worker_socket: str, rounds: int) -> int:
    model = {"w": np.zeros(1024, dtype=np.float32)}
    stop = threading.Event()
    server = mlfabric.register_as_server(
        "rounds", "ps0", model, mlfabric.Params(sync_workers=2), daemon=server_socket
    )

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        server.model["w"] += update["w"]

    serving = threading.Thread(target=server.serve, kwargs={"until": stop}, daemon=True)
    serving.start()
    applied: list[int] = []

    def work(name: str) -> None:
        with mlfabric.register_as_worker("rounds", name=name, daemon=worker_socket, wait=60.0) as worker:
            floor = None
            for _ in range(rounds):
                worker.get("ps0", min_version=floor)
                result = worker.push("ps0", {"w": np.ones(1024, dtype=np.float32)}).wait(timeout=60)
                if result.status != mlfabric.APPLIED:
                    print(f"{name}: {result.status}: {result.reason}", file=sys.stderr, flush=True)
                    return
                applied.append(result.version)
                floor = result.version

    try:
        workers = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(120)
    finally:
        stop.set()
        serving.join(10)
        server.close()
    print(json.dumps({"applied": len(applied), "version": max(applied, default=0)}), flush=True)
    return 0 if len(applied) == 2 * rounds else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
