"""Push through two daemons, as a script: ``python pushes.py SERVER_SOCKET WORKER_SOCKET N [JOB]``.

A server registers on the first daemon, a worker on the second; the worker pushes ``N``
small float32 updates and waits for every verdict. Prints one JSON line:
``{"applied": a, "dropped": d, "reasons": [...]}``; exits 0 when every push resolved.
Used by the ops tests both on the host and inside the systemd sandbox.
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np

import mlfabric


def main(server_socket: str, worker_socket: str, pushes: int, job: str = "ops") -> int:
    model = {"w": np.zeros(64 * 1024, dtype=np.float32)}
    stop = threading.Event()
    server = mlfabric.register_as_server(
        job, "ps0", model, mlfabric.Params(tau_max=1000), daemon=server_socket
    )

    @server.on_update
    def apply(update: dict[str, np.ndarray], meta: mlfabric.UpdateMeta) -> None:
        server.model["w"] -= update["w"]

    serving = threading.Thread(target=server.serve, kwargs={"until": stop}, daemon=True)
    serving.start()
    applied, reasons = 0, []
    try:
        with mlfabric.register_as_worker(job, name="w0", daemon=worker_socket, wait=60.0) as worker:
            handles = [worker.push("ps0", {"w": np.ones(64 * 1024, dtype=np.float32)}) for _ in range(pushes)]
            for h in handles:
                result = h.wait(timeout=60)
                if result.status == mlfabric.APPLIED:
                    applied += 1
                else:
                    reasons.append(result.reason)
    finally:
        stop.set()
        serving.join(10)
        server.close()
    print(json.dumps({"applied": applied, "dropped": len(reasons), "reasons": reasons}), flush=True)
    return 0 if applied + len(reasons) == pushes else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:]))
