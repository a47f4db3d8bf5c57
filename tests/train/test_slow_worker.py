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


def test_sleeps_factor_minus_one_times_compute():
    timer = MicroBatchTimer(SlowWorker(0, 3.0), rank=0)
    assert timer.active
    t0 = time.perf_counter()
    timer.start()
    time.sleep(0.05)  # the "micro-batch"
    slept = timer.stop()
    total = time.perf_counter() - t0
    assert 0.09 <= slept <= 0.2 and total >= 0.14
    assert timer.slept_s == pytest.approx(slept)


def test_other_ranks_do_not_sleep():
    timer = MicroBatchTimer(SlowWorker(1, 3.0), rank=0)
    timer.start()
    time.sleep(0.01)
    assert not timer.active and timer.stop() == 0.0
    assert MicroBatchTimer(None, rank=0).stop() == 0.0
