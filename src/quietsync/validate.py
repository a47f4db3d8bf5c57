"""One place for the checks every config runs on its fields, so every error reads the same way.

Each check raises ``ValueError("<name> must be ..., got <value>")`` naming the field, the allowed values and
what it got — the CLI turns that into ``--<flag> must be ...``. Booleans are never accepted as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
              allow_none: bool = False) -> None:
    """``value`` is an integer in ``[minimum, maximum]`` (either bound optional), or None if allowed."""
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        if minimum is not None and maximum is not None:
            want = f"an integer in [{minimum}, {maximum}]"
        elif minimum is not None:
            want = f"an integer >= {minimum}"
        elif maximum is not None:
            want = f"an integer <= {maximum}"
        else:
            want = "an integer"
        raise ValueError(f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


def check_float(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> None:
    """``value`` is a finite real number in the interval given by ``low``/``high`` (open ends optional)."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        if low is not None and high is not None:
            want = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        elif low is not None:
            want = f"{'>' if low_open else '>='} {low:g}"
        elif high is not None:
            want = f"{'<' if high_open else '<='} {high:g}"
        else:
            want = "a finite number"
        raise ValueError(f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
