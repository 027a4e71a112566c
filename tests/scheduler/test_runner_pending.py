"""The runner's index of the pending updates, kept between decisions (issue 24).

:meth:`DecisionRunner.decide` gives the policy the pending updates that are not resent and
checks that every send names a pending update. It keeps the update ids (and how many are
resent) from the last decision by the objects added and taken out since, where the new list
is the last one less some plus some after them (as the simulator lists them), else counts
them anew. Seeded sequences — in order and shuffled, with resent updates, ids listed twice,
policies that send an update that is not pending — must give the policy the same lists and
raise exactly where the plain passes over ``pending`` would.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Sequence

import networkx as nx
import pytest

from mlfabric.scheduler.core.graph import star
from mlfabric.scheduler.policies.base import Decision, PendingUpdate, Send, Snapshot
from mlfabric.scheduler.policies.runner import DecisionError, DecisionRunner


class Echo:
    """A policy that records what it is given and sends some of it (or an id it was not given)."""

    name = "echo"

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.given: list[list[PendingUpdate]] = []
        self.seen: list[str] = []

    def decide(self, snapshot: Snapshot, pending: Sequence[PendingUpdate]) -> Decision:
        self.given.append(list(pending))
        ids = [p.update_id for p in pending]
        self.seen += ids
        chosen = self.rng.sample(ids, min(len(ids), 3))
        if self.rng.random() < 0.2:  # maybe not pending (any more): then the runner must refuse
            chosen.append(self.rng.choice([*self.seen, "nobody"]))
        return Decision(sends=tuple(Send(u, "ps", ("w", "ps")) for u in chosen))


def pending_update(uid: str, resent: bool) -> PendingUpdate:
    p = PendingUpdate(uid, "j", "s", "a", "a", "ps", 1, 1.0, 0, 0.0)
    return dataclasses.replace(p, resent=True) if resent else p


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_policy_gets_and_the_check_refuses_what_the_plain_passes_give(seed: int, shuffle: bool) -> None:
    rng = random.Random(seed)
    graph: nx.DiGraph = star(["ps", "a"], 8e6)
    policy = Echo(random.Random(seed))
    runner = DecisionRunner(policy)
    listed: dict[str, PendingUpdate] = {}
    serial = itertools.count()
    refused = 0
    for _ in range(80):
        for uid in rng.sample(sorted(listed), min(len(listed), rng.choice((0, 1, 3)))):
            del listed[uid]
        for _ in range(rng.choice((0, 1, 4))):
            uid = f"u{next(serial)}"
            listed[uid] = pending_update(uid, rng.random() < 0.1)
        pending = list(listed.values())
        if pending and rng.random() < 0.1:
            pending.append(pending_update(pending[0].update_id, False))  # an id listed twice
        if shuffle:
            rng.shuffle(pending)
        want = [p for p in pending if not p.resent]
        ids = {p.update_id for p in pending}
        before = len(policy.given)
        try:
            decision = runner.decide(Snapshot(0.0, graph), pending)
        except DecisionError as exc:
            refused += 1
            assert str(exc).split("'")[3] not in ids  # the send it names is not pending
        else:
            assert all(s.update_id in ids for s in decision.sends)
            assert [s.update_id for s in decision.sends[: len(pending) - len(want)]] == [
                p.update_id for p in pending if p.resent
            ]
        if want:
            assert policy.given[before] == want
        else:
            assert len(policy.given) == before
    assert refused > 0
