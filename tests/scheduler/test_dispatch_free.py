"""The dispatcher's releases and wake-ups against the plain scan of every planned send (issue 24).

:class:`~mlfabric.scheduler.policies.dispatch.Dispatcher` keeps, with its plan, which sends no
planned send holds back, and looks only at those. :class:`Scan` is the dispatcher as it was
before: every planned send looked at, pass after pass, in the plan's order. Seeded plans (chains,
sends after several others, after transfers in flight, after themselves, after unknown ids),
forgets, clock steps and new plans must release the same sends in the same order, with the same
expected ends, and wake up at the same times.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

import pytest

from mlfabric.scheduler.policies import dispatch
from mlfabric.scheduler.policies.base import Decision, InFlight, Send
from mlfabric.scheduler.policies.dispatch import Dispatcher, Release, _Ends


class Scan(Dispatcher):
    """The dispatcher before it kept its free sends: every planned send, every pass."""

    def release(self, now: float, in_flight: Mapping[str, InFlight]) -> list[Release]:
        released: list[Release] = []
        ends = _Ends(in_flight)
        progress = True
        while progress and self._planned:
            progress = False
            for uid, send in list(self._planned.items()):
                if self._blocked(send, now, ends):
                    continue
                duration = max(0.0, send.expected_end - send.expected_start)
                start = max([now, *(e for e in map(ends.get, send.after) if e is not None)])
                r = Release(send, now, start + duration)
                released.append(r)
                ends[uid] = r.expected_end
                del self._planned[uid]
                progress = True
        return released

    def next_wakeup(self, in_flight: Mapping[str, InFlight]) -> float | None:
        best: float | None = None
        for send in self._planned.values():
            if any(a in self._planned for a in send.after):
                continue
            ends = [in_flight[a].expected_end for a in send.after if a in in_flight]
            at = max(ends, default=float("-inf")) - self.margin
            best = at if best is None else min(best, at)
        return best

    def forget(self, update_ids: Iterable[str]) -> None:
        for uid in update_ids:
            self._planned.pop(uid, None)


def plan(rng: random.Random, serial: list[int], flying: dict[str, InFlight], now: float) -> Decision:
    sends = []
    ids: list[str] = []
    for _ in range(rng.randrange(0, 30)):
        uid = f"u{serial[0]}"
        serial[0] += 1
        pool = ids + list(flying) + ["gone"]
        after = tuple(sorted(set(rng.sample(pool, min(len(pool), rng.choice((0, 1, 1, 2, 3)))))))
        if rng.random() < 0.03:
            after = (*after, uid)  # after itself: never released
        if after and rng.random() < 0.05:
            after = (*after, after[0])  # a predecessor listed twice (counted twice)
        start = now + rng.random() * 0.01
        sends.append(Send(uid, "ps", ("w", "ps"), after, start, start + rng.random() * 0.005))
        ids.append(uid)
    rng.shuffle(sends)  # the plan's order is not the order of `after`
    if sends and rng.random() < 0.2:
        sends.append(sends[0])  # listed twice
    return Decision(sends=tuple(sends))


@pytest.mark.parametrize("seed", range(30))
def test_releases_and_wakeups_are_the_plain_scans(seed: int) -> None:
    rng = random.Random(seed)
    margin = rng.choice((0.0, 0.001))
    new, old = Dispatcher(margin), Scan(margin)
    flying: dict[str, InFlight] = {}
    now, serial, released = 0.0, [0], 0
    for step in range(60):
        if step % 10 == 0:
            d = plan(rng, serial, flying, now)
            new.adopt(d)
            old.adopt(d)
        if rng.random() < 0.2 and len(new):
            gone = rng.sample([s.update_id for s in new.planned], 1 + rng.randrange(min(3, len(new))))
            new.forget(gone)
            old.forget(gone)
        assert new.next_wakeup(flying) == old.next_wakeup(flying)
        got, want = new.release(now, flying), old.release(now, flying)
        assert got == want
        assert new.planned == old.planned and len(new) == len(old)
        released += len(got)
        for r in got:
            flying[r.send.update_id] = InFlight(
                r.send.update_id, "j", "s", r.send.path, 1, now, r.expected_end
            )
        for uid in [u for u, f in flying.items() if f.expected_end <= now or rng.random() < 0.1]:
            del flying[uid]
        now += rng.choice((0.0, 0.0005, 0.002, 0.004))
    assert released > 0


def index(d: Decision, python: bool) -> tuple[object, ...]:
    """A dispatcher's plan index after adopting ``d``, each dict and set with its order."""
    disp = Dispatcher()
    saved = dispatch._plan_native
    try:
        if python:
            dispatch._plan_native = None  # type: ignore[assignment]
        disp.adopt(d)
    finally:
        dispatch._plan_native = saved
    parts = (disp._planned, disp._pos, disp._held, disp._waiting)
    return (*((list(x.items()), [type(v) for v in x.values()]) for x in parts), sorted(disp._free))


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_index_in_c_is_the_python_loops(seed: int) -> None:
    """Dispatcher.adopt's index (``_plan_native.dispatch_index``) as the Python loops make it (issue 24)."""
    assert dispatch._plan_native is not None
    rng = random.Random(seed)
    serial = [0]
    flying = {f"f{k}": InFlight(f"f{k}", "j", "s", ("w", "ps"), 1, 0.0, 0.01) for k in range(3)}
    for _ in range(5):
        d = plan(rng, serial, flying, 0.0)
        assert index(d, python=False) == index(d, python=True)


def test_a_plan_the_c_does_not_read_is_indexed_by_the_python_loops() -> None:
    a = Send("a", "ps", ("w", "ps"))
    b = Send("b", "ps", ("w", "ps"), ["a"])  # type: ignore[arg-type]  # after as a list
    c = Send(7, "ps", ("w", "ps"), ("a",))  # type: ignore[arg-type]  # an id that is no str
    for sends in ((a, b), (a, c)):
        d = Decision(sends=sends)
        assert dispatch._plan_native.dispatch_index(sends) is None
        assert index(d, python=False) == index(d, python=True)
