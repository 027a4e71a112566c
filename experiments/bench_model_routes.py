"""The model-route refresh at registration: CPU time of ``ModelRouteBook.refresh`` as workers register.

Every worker registration makes the scheduler refresh the model routes (docs/model-relays.md).
Here one server on a 128 x 32 two-tier graph (4,096 hosts, 4:1 uplinks) and N workers on
other hosts register one by one, each followed by a refresh, as the service does; printed:
CPU seconds in all and per registration, and the directives sent (they must not change when
the refresh gets faster).

Not collected by pytest (no ``test_`` prefix). Run::

    python experiments/bench_model_routes.py --workers 1000 4000

Measured (2 shared cores, load ~2; 4958fcc against the code before it): 1,000 workers 4.34
-> 1.58 ms per registration, 4,000 workers 15.5 -> 7.0 ms (62 -> 28 CPU-s in all); 948 and
3,854 directives both times.
"""

from __future__ import annotations

import argparse
import time

from mlfabric.scheduler.core.graph import hosts, two_tier
from mlfabric.scheduler.service.model_routes import ModelRouteBook
from mlfabric.scheduler.service.records import JobParams
from mlfabric.scheduler.service.state import SchedulerState


def measure(workers: int) -> tuple[float, int]:
    """CPU seconds of the refreshes over ``workers`` registrations, and the directives sent."""
    graph = two_tier(128, 32, 10e9, oversubscription=4.0)
    names = hosts(graph)
    if workers + 1 > len(names):
        raise SystemExit(f"--workers {workers}: the graph has {len(names)} hosts, one is the server's")
    state = SchedulerState(graph)
    for i, h in enumerate(names[: workers + 1]):
        state.connect(h, f"127.0.0.1:{10000 + i}")
    state.register_server(names[0], "j", "ps", (), JobParams(), 0)
    book = ModelRouteBook(state)
    sent = 0
    t0 = time.process_time()
    for i, h in enumerate(names[1 : workers + 1]):
        state.register_worker(h, "j", f"w{i}")
        sent += len(book.refresh().directives)
    return time.process_time() - t0, sent


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1000, 4000])
    args = parser.parse_args()
    for n in args.workers:
        cpu, sent = measure(n)
        print(f"{n:>5} registrations: {cpu:6.2f} CPU-s, {1e3 * cpu / n:6.2f} ms each; {sent} directives")


if __name__ == "__main__":
    main()
