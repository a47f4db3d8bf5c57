"""quietsync.validate: the one set of field checks every config runs (messages, bools, None, nan/inf)."""

from __future__ import annotations

import math

import pytest

from quietsync.validate import check_choice, check_float, check_int


@pytest.mark.parametrize("value", [0, 1, 5, 10])
def test_check_int_accepts_in_range(value):
    check_int("n", value, 0, 10)


@pytest.mark.parametrize("kwargs, value, message", [
    ({"minimum": 1}, 0, "n must be an integer >= 1, got 0"),
    ({"maximum": 3}, 4, "n must be an integer <= 3, got 4"),
    ({"minimum": 1, "maximum": 3}, 7, "n must be an integer in [1, 3], got 7"),
    ({}, 1.0, "n must be an integer, got 1.0"),
    ({}, "2", "n must be an integer, got '2'"),
    ({"minimum": 0}, True, "n must be an integer >= 0, got True"),  # bools are not numbers
    ({"minimum": 0}, None, "n must be an integer >= 0, got None"),
    ({"minimum": 0, "allow_none": True}, -1, "n must be an integer >= 0 or None, got -1"),
    ({"minimum": 2, "special": {0: "never"}}, 1, "n must be 0 (never) or an integer >= 2, got 1"),
    ({"minimum": 2, "special": {0: "never"}}, False, "n must be 0 (never) or an integer >= 2, got False"),
])
def test_check_int_rejects(kwargs, value, message):
    with pytest.raises(ValueError) as e:
        check_int("n", value, **kwargs)
    assert str(e.value) == message


def test_check_int_none_and_special():
    check_int("n", None, 1, allow_none=True)
    check_int("n", 0, 2, special={0: "never"})
    check_int("n", 2, 2, special={0: "never"})


@pytest.mark.parametrize("value", [0, 0.5, 1, 1.0])
def test_check_float_accepts(value):
    check_float("x", value, 0, 1)


@pytest.mark.parametrize("kwargs, value, message", [
    ({"low": 0, "low_open": True}, 0, "x must be > 0, got 0"),
    ({"low": 0}, -0.5, "x must be >= 0, got -0.5"),
    ({"high": 1, "high_open": True}, 1.0, "x must be < 1, got 1.0"),
    ({"low": 0, "high": 0.5, "low_open": True, "high_open": True}, 0.5, "x must be in (0, 0.5), got 0.5"),
    ({"low": 0, "high": 1}, math.nan, "x must be in [0, 1], got nan"),
    ({}, math.inf, "x must be a finite number, got inf"),
    ({}, -math.inf, "x must be a finite number, got -inf"),
    ({}, True, "x must be a finite number, got True"),
    ({}, "1", "x must be a finite number, got '1'"),
    ({}, None, "x must be a finite number, got None"),
    ({"low": 0, "allow_none": True}, -1, "x must be >= 0 or None, got -1"),
])
def test_check_float_rejects(kwargs, value, message):
    with pytest.raises(ValueError) as e:
        check_float("x", value, **kwargs)
    assert str(e.value) == message


def test_check_float_none_allowed():
    check_float("x", None, 0, allow_none=True)


def test_check_choice():
    check_choice("c", "b", ("a", "b"))
    check_choice("c", 2, iter([1, 2]))  # any iterable, read once
    with pytest.raises(ValueError) as e:
        check_choice("c", "z", ("a", "b"))
    assert str(e.value) == "c must be one of a, b, got 'z'"
    with pytest.raises(ValueError, match="c must be one of a, b, got None"):
        check_choice("c", None, ("a", "b"))
    with pytest.raises(ValueError, match="c must be one of 0, 1, got True"):
        check_choice("c", True, (0, 1))
