"""One place for the checks every config runs on its fields, so every error reads the same way.

Each check raises ``ValueError("<name> must be ..., got <value>")`` naming the field, the allowed values and
what it got — the CLI turns that into ``--<flag> must be ...``. Booleans are never accepted as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def _interval(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    """``"in [a, b]"``, ``">= a"``, ``"<= b"`` or ``""`` for the bounds given."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def _inside(value: float, low: float | None, high: float | None, low_open: bool = False,
            high_open: bool = False) -> bool:
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    return above and below


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
              allow_none: bool = False) -> None:
    """``value`` is an integer in ``[minimum, maximum]`` (either bound optional), or None if allowed."""
    if value is None and allow_none:
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and _inside(value, minimum, maximum)):
        want = " ".join(w for w in ("an integer", _interval(minimum, maximum)) if w)
        raise ValueError(f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


def check_float(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> None:
    """``value`` is a finite real number in the interval given by ``low``/``high`` (open ends optional)."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and _inside(value, low, high, low_open, high_open)):
        want = _interval(low, high, low_open, high_open) or "a finite number"
        raise ValueError(f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
