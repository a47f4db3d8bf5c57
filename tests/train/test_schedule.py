"""Warm-up + cosine multiplier."""

from __future__ import annotations

import math
import pickle

import pytest

from quietsync.train.schedule import WarmupCosine, warmup_cosine

pytestmark = pytest.mark.timeout(30)


def test_values():
    f = warmup_cosine(10, 110, 0.1)
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))


def test_no_warmup_and_picklable():
    f = warmup_cosine(0, 10, 0.0)
    assert f(0) == 1.0 and f(10) == 0.0
    assert pickle.loads(pickle.dumps(f))(5) == f(5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(warmup_steps=-1, total_steps=10), "warmup_steps"),
    (dict(warmup_steps=0, total_steps=0), "total_steps"),
    (dict(warmup_steps=0, total_steps=10, min_ratio=2.0), "min_ratio"),
])
def test_invalid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupCosine(**kwargs)
