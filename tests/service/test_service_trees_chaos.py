"""Multi-level aggregates under random faults: every worker update resolves exactly once.

The scheduler core runs ``stf+tree`` against the fake daemons of ``test_service_trees`` on two
racks with two aggregator hosts each (``ax``, ``ay``, ``bx``, ``by``; the workers' hosts do not
aggregate). Before every step, seeded chaos SIGKILLs an aggregator's daemon (at most two), makes
a daemon give up an aggregate it gathers (``AggregateFailed``), or lets an aggregator die right
after its sum reached its parent aggregate (before its report). Every worker update resolves
exactly once, APPLIED only if the server applied it, never applied twice.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from mlfabric.proto.v1 import control_pb2 as pb
from tests.service.test_service_trees import FakeDaemons, run

WORKERS = ["a0", "a1", "a2", "b0", "b1", "b2"]
AGGREGATORS = {"ax", "ay", "bx", "by"}
RACK = {h: "ra" if h[0] == "a" else "rb" for h in [*WORKERS, *AGGREGATORS]}
TOPOLOGY = {
    "hosts": ["ps", *WORKERS, *sorted(AGGREGATORS)],
    "switches": ["core", "ra", "rb"],
    "links": [
        {"a": "ps", "b": "core", "mbps": 10},
        {"a": "ra", "b": "core", "mbps": 40},
        {"a": "rb", "b": "core", "mbps": 40},
        *({"a": h, "b": rack, "mbps": 1000} for h, rack in sorted(RACK.items())),
    ],
}


def chaos(seed: int) -> Callable[[FakeDaemons], None]:
    """Seeded faults, one draw per step (see the module docstring)."""
    rng = random.Random(seed)
    kills = 2

    def hit(fake: FakeDaemons) -> None:
        nonlocal kills
        live = sorted(h for h in AGGREGATORS if h not in fake.dead)
        r = rng.random()
        if r < 0.15 and kills and live:
            kills -= 1
            fake.kill(rng.choice(live))
        elif r < 0.4:
            gathering = sorted(
                aid for aid, a in fake.aggs.items() if a["state"] == "collecting" and a["host"] in live
            )
            if gathering:
                fake.fail(rng.choice(gathering))
        elif r < 0.55 and kills and live and not fake.kill_on_forward:
            kills -= 1
            fake.kill_on_forward, fake.deliver_then_die = rng.choice(live), rng.random() < 0.5

    return hit


def check_exactly_once_or_unknown(fake: FakeDaemons, pushes: int) -> None:
    """Each update resolved once; APPLIED: applied once; DROPPED: never; UNKNOWN: at most once.

    UNKNOWN is the honest answer when the aggregator of a root aggregate released to the server
    died (its frame may have reached the server), as for ``stf+agg`` (docs/exactly-once.md).
    """
    ids = {f"{w}/{k}" for w in WORKERS for k in range(pushes)}
    applied = [w for _, ws in fake.applied for w in ws]
    assert len(applied) == len(set(applied)), "a worker update reached the server twice"
    assert set(fake.resolved) == ids
    for uid, verdicts in fake.resolved.items():
        assert len(verdicts) == 1, (uid, verdicts)
        if verdicts[0] == pb.OUTCOME_APPLIED:
            assert uid in applied, uid
        elif verdicts[0] == pb.OUTCOME_DROPPED:
            assert uid not in applied, uid
        else:
            assert verdicts[0] == pb.OUTCOME_UNKNOWN, (uid, verdicts)


@pytest.mark.parametrize("seed", range(40))
def test_random_faults_in_two_level_trees_keep_every_update_exactly_once(seed: int) -> None:
    fake = run(pushes=2, topology=TOPOLOGY, aggregators=AGGREGATORS, workers=WORKERS, chaos=chaos(seed))
    check_exactly_once_or_unknown(fake, 2)
    assert not fake.core.aggregates.executions
