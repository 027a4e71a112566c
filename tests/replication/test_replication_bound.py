"""The div_max gate of the server's replication log (no processes)."""

from __future__ import annotations

import threading

from mlfabric.daemon.replication import ReplicationLog
from mlfabric.daemon.roles import Verdict


def test_an_update_beyond_div_max_is_admitted_once_the_reservations_are_settled() -> None:
    """Reservations settled in another order than taken leave no float residue that blocks it.

    (0.0312 + 0.0347 + 0.0351 + 0.0329, released in another order, leaves 1.4e-17 in
    floating point; an update whose own norm exceeds div_max waits for a divergence of 0,
    and waited for ever: a stf+agg aggregate of many members in the testbed experiment.)
    """
    log = ReplicationLog("job", "ps", "rep", 0, lambda *a: None, lambda m: None, "ps")
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
