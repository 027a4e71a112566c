"""Token bucket (daemon/channels/ratelimit.py): rate accuracy with a fake clock, sharing, thread safety."""

from __future__ import annotations

import threading

import pytest

from mlfabric.daemon.channels.ratelimit import TokenBucket


class FakeClock:
    """A clock whose ``sleep`` advances time instantly, recording every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def make(rate: float | None, burst: float | None = None) -> tuple[TokenBucket, FakeClock]:
    fake = FakeClock()
    return TokenBucket(rate, burst, clock=fake.clock, sleep=fake.sleep), fake


def test_disabled_bucket_never_sleeps() -> None:
    bucket, fake = make(None)
    assert not bucket.enabled
    for _ in range(10):
        assert bucket.consume(1 << 30) == 0.0
    assert fake.sleeps == []


@pytest.mark.parametrize("rate", [1e3, 2.5e6, 1.25e9])
@pytest.mark.parametrize("chunks_per_second", [1, 100, 3000])
def test_long_run_rate_matches(rate: float, chunks_per_second: int) -> None:
    chunk = max(1, int(rate / chunks_per_second))
    burst = rate / 10
    bucket, fake = make(rate, burst)
    total = int(rate * 3)  # three seconds' worth
    start = fake.now
    sent = 0
    while sent < total:
        n = min(chunk, total - sent)
        bucket.consume(n)
        sent += n
    elapsed = fake.now - start
    # burst bytes go free; the rest at exactly the rate
    assert elapsed == pytest.approx((total - burst) / rate, rel=1e-6)


def test_burst_then_rate_and_refill_caps_at_burst() -> None:
    bucket, fake = make(1000.0, burst=200.0)
    assert bucket.consume(200) == 0.0  # the full burst, free
    assert bucket.consume(100) == pytest.approx(0.1)
    fake.now += 10.0  # idle a long time: refills to the burst, not beyond
    assert bucket.consume(200) == 0.0
    assert bucket.consume(1) == pytest.approx(0.001)


def test_partial_refill() -> None:
    bucket, fake = make(1000.0, burst=1000.0)
    bucket.consume(1000)
    fake.now += 0.25  # 250 tokens back
    assert bucket.consume(250) == 0.0
    assert bucket.consume(500) == pytest.approx(0.5)


def test_reserve_queues_callers_in_order() -> None:
    """Concurrent reservations stack: each waits for everyone ahead of it."""
    bucket, _ = make(100.0, burst=0.0)
    assert [bucket.reserve(50) for _ in range(4)] == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_default_burst() -> None:
    assert TokenBucket(1e9).burst == pytest.approx(1e7)
    assert TokenBucket(1e3).burst == 64 * 1024


@pytest.mark.parametrize(("rate", "burst", "nbytes"), [(0.0, None, 1), (-5.0, None, 1), (10.0, -1.0, 1)])
def test_bad_arguments(rate: float, burst: float | None, nbytes: int) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


def test_negative_consume_rejected() -> None:
    bucket, _ = make(10.0)
    with pytest.raises(ValueError):
        bucket.consume(-1)


def test_shared_by_threads_total_rate() -> None:
    """Threads sharing a bucket get the rate in total: the sum of their waits adds up exactly."""
    lock = threading.Lock()
    now = [0.0]

    def clock() -> float:
        with lock:
            return now[0]

    bucket = TokenBucket(1000.0, burst=0.0, clock=clock, sleep=lambda s: None)
    waits: list[float] = []

    def worker() -> None:
        for _ in range(100):
            w = bucket.reserve(10)
            with lock:
                waits.append(w)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 4000 bytes reserved at a frozen clock: the last caller waits 4 s, and every 10 ms slot is used once
    assert max(waits) == pytest.approx(4.0)
    assert sorted(round(w * 100) for w in waits) == list(range(1, 401))
