"""--slow-worker RANK:FACTOR parsing and the (FACTOR-1)x compute-time sleep."""

from __future__ import annotations

import time

import pytest

from quietsync.train.slow_worker import MicroBatchTimer, SlowWorker, parse_slow_worker

pytestmark = pytest.mark.timeout(30)


def test_parse():
    assert parse_slow_worker("1:2.5") == SlowWorker(1, 2.5)
    for bad in ("1", "a:2", "1:x", "1:0.5", "-1:2"):
        with pytest.raises(ValueError, match="slow_worker"):
            parse_slow_worker(bad)


class _Clock:
    """A fake ``time`` for the timer: ``perf_counter`` reads it, ``sleep`` records the pause and advances it."""

    def __init__(self) -> None:
        self.now, self.sleeps = 100.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_sleeps_factor_minus_one_times_compute(monkeypatch):
    """On a fake clock (exact, whatever the machine's load): a micro-batch of c seconds is followed by a sleep of
    (factor - 1) * c, so the worker takes factor * c; a second micro-batch adds up."""
    import quietsync.train.slow_worker as slow_worker

    clock = _Clock()
    monkeypatch.setattr(slow_worker, "time", clock)
    timer = MicroBatchTimer(SlowWorker(0, 3.0), rank=0)
    assert timer.active
    for compute, total in ((0.05, 0.1), (0.2, 0.5)):
        t0 = clock.now
        timer.start()
        clock.now += compute  # the micro-batch
        slept = timer.stop()
        assert slept == pytest.approx(2 * compute) and clock.sleeps[-1] == slept
        assert clock.now - t0 == pytest.approx(3 * compute)
        assert timer.slept_s == pytest.approx(total)
    assert len(clock.sleeps) == 2


def test_sleeps_on_the_real_clock():
    """The real sleep happens: a 3x worker's 50 ms micro-batch takes at least 150 ms (a lower bound only: a
    loaded machine makes it longer, never shorter)."""
    timer = MicroBatchTimer(SlowWorker(0, 3.0), rank=0)
    t0 = time.perf_counter()
    timer.start()
    time.sleep(0.05)  # the "micro-batch"
    slept = timer.stop()
    total = time.perf_counter() - t0
    assert slept >= 0.1 and total >= 0.15 and total >= 1.49 * slept  # total >= c + 2c = 1.5 x slept
    assert timer.slept_s == slept


def test_other_ranks_do_not_sleep():
    timer = MicroBatchTimer(SlowWorker(1, 3.0), rank=0)
    timer.start()
    time.sleep(0.01)
    assert not timer.active and timer.stop() == 0.0
    assert MicroBatchTimer(None, rank=0).stop() == 0.0
