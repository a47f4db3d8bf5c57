"""One place for the checks every config runs on its fields, so every error reads the same way.

Each check raises ``ValueError("<name> must be ..., got <value>")`` naming the field, the allowed values and
what it got — the CLI turns that into ``--<flag> must be ...``. Booleans are never accepted as numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


def _bounds(low: float | None, high: float | None, low_open: bool = False, high_open: bool = False) -> str:
    """``"in [low, high)"``, ``">= low"``, ``"< high"``... or ``""`` when unbounded."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_num(low)}, {_num(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_num(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_num(high)}"
    return ""


def _num(x: float) -> str:
    """An integer bound as written (``:g`` would print 2**32 - 1 as 4.29497e+09), any other number short."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def _fail(name: str, want: str, value: Any, allow_none: bool) -> None:
    raise ValueError(f"{name} must be {want}{' or None' if allow_none else ''}, got {value!r}")


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None, *,
              allow_none: bool = False, special: Mapping[int, str] | None = None) -> None:
    """``value`` is an integer in ``[minimum, maximum]`` (either bound optional), or None if allowed.

    ``special`` maps integers outside the range that are accepted too to what they mean, e.g.
    ``check_int("skip_every", v, 2, special={0: "never skip"})`` reads
    ``skip_every must be 0 (never skip) or an integer >= 2, got 1``.
    """
    if value is None and allow_none:
        return
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and special and value in special:
        return
    if not (is_int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)):
        want = f"an integer {_bounds(minimum, maximum)}".rstrip()
        if special:
            want = " or ".join([*(f"{k} ({meaning})" for k, meaning in special.items()), want])
        _fail(name, want, value, allow_none)


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
        _fail(name, _bounds(low, high, low_open, high_open) or "a finite number", value, allow_none)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """``value`` is one of ``choices`` (``True``/``False`` do not stand for ``1``/``0``)."""
    choices = tuple(choices)
    if not any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
