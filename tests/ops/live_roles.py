"""A server on one daemon and workers "fast" and "slow" on another, pushing until SIGTERM.

``python live_roles.py SERVER_SOCKET WORKER_SOCKET``: "fast" pushes every 0.02 s, "slow"
every 0.4 s (a straggler by its iteration time); prints ``ready`` once both pushed twice.
"""

from __future__ import annotations

import signal
import sys
import threading

import numpy as np

import mlfabric


def main(server_socket: str, worker_socket: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = mlfabric.register_as_server(
        "ops",
        "ps0",
        {"w": np.zeros(1024, dtype=np.float32)},
        mlfabric.Params(tau_max=10**6),
        daemon=server_socket,
    )
    serving = threading.Thread(target=server.serve, kwargs={"until": stop}, daemon=True)
    serving.start()
    pushed = {"fast": 0, "slow": 0}
    ready = threading.Event()

    def work(name: str, every: float) -> None:
        with mlfabric.register_as_worker("ops", name=name, daemon=worker_socket, wait=60.0) as w:
            while not stop.is_set():
                w.push("ps0", {"w": np.ones(1024, dtype=np.float32)}).wait(timeout=30)
                pushed[name] += 1
                if min(pushed.values()) >= 2:
                    ready.set()
                stop.wait(every)

    workers = [threading.Thread(target=work, args=a) for a in (("fast", 0.02), ("slow", 0.4))]
    for t in workers:
        t.start()
    ready.wait(60)
    print("ready", flush=True)
    stop.wait()
    for t in workers:
        t.join(10)
    serving.join(10)
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
