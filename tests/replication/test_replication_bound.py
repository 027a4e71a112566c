"""The div_max gate of the server's replication log (no processes)."""

from __future__ import annotations

import threading
import time

from mlfabric.daemon.roles.base import Verdict
from mlfabric.daemon.roles.replica.log import ReplicationLog


def test_an_update_beyond_div_max_is_admitted_once_the_reservations_are_settled() -> None:
    """Reservations settled in another order than taken leave no float residue that blocks it.

    (0.0312 + 0.0347 + 0.0351 + 0.0329, released in another order, leaves 1.4e-17 in
    floating point; an update whose own norm exceeds div_max waits for a divergence of 0,
    and waited for ever: a stf+agg aggregate of many members in the testbed experiment.)
    """
    log = ReplicationLog("job", "ps", "rep", 0, lambda *a: None, lambda m: False, "ps")
    try:
        log.configure("", 0.14)
        norms = [0.0312, 0.0347, 0.0351, 0.0329]
        reserved = [log.admit(n) for n in norms]
        for i in (1, 3, 0, 2):  # the verdicts come back in another order (not applied: no entry)
            log.settle(reserved[i], f"u{i}", None, Verdict.dropped("test"), -1, 0, norms[i])
        admitted = threading.Event()

        def admit_beyond() -> None:
            log.admit(0.2)
            admitted.set()

        threading.Thread(target=admit_beyond, daemon=True).start()
        assert admitted.wait(3.0), "an update of norm 0.2 > div_max 0.14 waited although nothing is pending"
    finally:
        log.close()


def test_admission_is_first_come_so_an_update_beyond_div_max_is_not_overtaken() -> None:
    """An update that fits beside the reserved ones waits while an older one (beyond div_max,
    needing a divergence of 0) waits; both are admitted in their order once the first settles."""
    log = ReplicationLog("job", "ps", "rep", 0, lambda *a: None, lambda m: False, "ps")
    try:
        log.configure("", 1.0)
        first = log.admit(0.6)
        order: list[str] = []

        def admit(name: str, norm: float) -> None:
            log.admit(norm)
            order.append(name)

        large = threading.Thread(target=admit, args=("large", 2.0), daemon=True)
        large.start()
        time.sleep(0.2)  # the large update is at the gate first
        small = threading.Thread(target=admit, args=("small", 0.3), daemon=True)
        small.start()
        small.join(0.5)
        assert order == [], "the small update (0.6 + 0.3 <= 1.0) overtook the older large one"
        log.settle(first, "u0", None, Verdict.dropped("test"), -1, 0, 0.6)
        large.join(3.0)
        assert order == ["large"]
        log.settle(2.0, "u1", None, Verdict.dropped("test"), -1, 0, 2.0)
        small.join(3.0)
        assert order == ["large", "small"]
    finally:
        log.close()
