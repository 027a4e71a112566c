"""The runner's releases and wake-ups against the plain pass over every aggregate (issue 24).

:class:`~mlfabric.scheduler.policies.runner.DecisionRunner` keeps the aggregates all of whose
members are in, and for each the one of its ``after`` that held it back last, and looks only at
those. :class:`Scan` is the runner as it was before: every aggregate being gathered looked at,
every ``after`` scanned, on every release and wake-up. Seeded plans (aggregates after sends,
after other aggregates, after transfers in flight with and without an expected end, holds),
arrivals, forgets, new plans and clock steps must release the same aggregates and sends in the
same order and wake up at the same times.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import replace

import pytest

from mlfabric.scheduler.policies.base import Decision, InFlight, PlannedAggregate, Send
from mlfabric.scheduler.policies.dispatch import Dispatcher
from mlfabric.scheduler.policies.runner import DecisionRunner, Released, _Gathering, _Over


class Scan(DecisionRunner):
    """The runner before it kept its complete aggregates: every aggregate, every pass."""

    def release(self, now: float, in_flight: Mapping[str, InFlight]) -> Released:
        near = now + self.dispatcher.margin
        gathering = set(self._gathering)

        def busy(uid: str) -> bool:
            f = in_flight.get(uid)
            if f is not None and f.expected_end > near:
                return True
            return uid in gathering or uid in self.dispatcher

        forwarded: list[_Gathering] = []
        for aid, g in list(self._gathering.items()):
            if len(g.arrived) < len(g.members) or any(busy(a) for a in g.planned.after):
                continue
            if g.planned.hold_until > now:
                continue
            forwarded.append(self._gathering.pop(aid))
            up = self._gathering.get(self._member_of.get(aid, ""))
            if up is not None:
                up.started = True
            for m in g.members:
                self._member_of.pop(m, None)
        flying = _Over(self._placeholders(forwarded), in_flight)
        sends = self.dispatcher.release(now, flying)
        for r in sends:
            of = self._member_of.get(r.send.update_id)
            if of is not None:
                self._gathering[of].started = True
        aggregates = tuple(replace(g.planned, members=tuple(g.members)) for g in forwarded)
        return Released(tuple(sends), aggregates)

    def next_wakeup(self, in_flight: Mapping[str, InFlight]) -> float | None:
        wakes = [self.dispatcher.next_wakeup(_Over(self._placeholders(), in_flight))]
        for g in self._gathering.values():
            if len(g.arrived) < len(g.members):
                continue
            after = g.planned.after
            if any(a in self._gathering or a in self.dispatcher for a in after):
                continue
            ends = [in_flight[a].expected_end - self.dispatcher.margin for a in after if a in in_flight]
            wakes.append(max([g.planned.hold_until, *ends]))
        wake = min((w for w in wakes if w is not None and w > 0), default=None)
        return None if wake is None or math.isinf(wake) else wake


def _plan(rng: random.Random, pending: list[str], step: int, flying: list[str]) -> Decision:
    """Sends of some pending updates and aggregates of others, waiting on each other."""
    rng.shuffle(pending)
    k = rng.randint(0, len(pending))
    direct, gathered = pending[:k], pending[k:]
    aggs: list[PlannedAggregate] = []
    ids = [*direct, *flying]
    while gathered:
        n = rng.randint(1, 3)
        members, gathered = tuple(gathered[:n]), gathered[n:]
        aid = f"agg{step}.{len(aggs)}"
        after = tuple(rng.sample(ids, min(len(ids), rng.randint(0, 3))))
        hold = rng.choice((-math.inf, 0.0, step + rng.random()))
        aggs.append(PlannedAggregate(aid, "x", members, 1e6, "ps", after, hold_until=hold))
        ids.append(aid)
    sends = []
    for uid in direct:
        after = tuple(rng.sample(ids, min(len(ids), rng.randint(0, 2))))
        sends.append(Send(uid, "ps", ("w", "ps"), tuple(a for a in after if a != uid), 0.0, rng.random()))
    waits = [*direct, *flying]  # a member may wait too (then it can go away before it is sent)
    for a in aggs:
        for m in a.members:
            after = tuple(x for x in rng.sample(waits, min(len(waits), rng.randint(0, 1))) if x != m)
            sends.append(Send(m, "x", ("w", "x"), after, 0.0, rng.random()))
    rng.shuffle(sends)
    return Decision(sends=tuple(sends), aggregates=tuple(aggs))


@pytest.mark.parametrize("seed", range(80))
def test_releases_and_wakeups_are_the_plain_pass(seed: int) -> None:
    rng = random.Random(seed)
    margin = rng.choice((0.0, 0.002))
    new, old = DecisionRunner(None, dispatcher=Dispatcher(margin)), Scan(None, dispatcher=Dispatcher(margin))  # type: ignore[arg-type]
    pending = [f"u{i}" for i in range(rng.randint(4, 16))]
    released: list[str] = []
    at_x: list[str] = []  # those sent to the aggregator
    ends: dict[str, float] = {}  # id -> expected end of what is in flight
    members: list[str] = []  # of the aggregates of the last plan
    now = 0.0
    for step in range(120):
        action = rng.random()
        if action < 0.15 and pending:
            d = _plan(rng, list(pending), step, list(ends))
            members = [m for a in d.aggregates for m in a.members]
            new.adopt(d)
            old.adopt(d)
        elif action < 0.35 and (at_x or released):  # mostly a member sent to its aggregator
            m = rng.choice(at_x if at_x and rng.random() < 0.8 else released)
            new.arrived(m)
            old.arrived(m)
        elif action < 0.45 and pending:  # mostly a member not yet sent: its aggregate may be complete now
            waiting = [m for m in members if m in pending]
            gone = [rng.choice(waiting if waiting and rng.random() < 0.7 else pending)]
            pending = [p for p in pending if p not in gone]
            new.forget(gone)
            old.forget(gone)
        elif action < 0.55 and ends:  # a transfer's expected end moves, or it ends
            uid = rng.choice(list(ends))
            if rng.random() < 0.3:
                del ends[uid]
            else:
                ends[uid] = rng.choice((math.inf, now + rng.random(), now - 0.001))
        else:
            now += rng.choice((0.0, 0.001, 0.3))
        in_flight = {u: InFlight(u, "j", "s", ("w", "ps"), 1, 0.0, e) for u, e in ends.items()}
        first = rng.random() < 0.5  # a wake-up before the release, or none (as the engine asks)
        if first:
            assert new.next_wakeup(in_flight) == old.next_wakeup(in_flight), f"step {step}"
        got, want = new.release(now, in_flight), old.release(now, in_flight)
        assert got == want, f"step {step}"
        if not first:
            assert new.next_wakeup(in_flight) == old.next_wakeup(in_flight), f"step {step}"
        for r in got.sends:
            uid = r.send.update_id
            pending = [p for p in pending if p != uid]
            released.append(uid)
            if r.send.next_hop == "x":
                at_x.append(uid)
            ends[uid] = rng.choice((math.inf, r.expected_end))
        for a in got.aggregates:
            released.append(a.aggregate_id)
            ends[a.aggregate_id] = rng.choice((math.inf, now + rng.random()))
        assert new.gathering == old.gathering, f"step {step}"
