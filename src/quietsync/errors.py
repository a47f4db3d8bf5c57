"""An exception's cause chain, walked once: what a torchft round's failure clears, a dropped round's vote and a
full disk under a checkpoint write are looked for in (``faults/quorum.py``, ``train/replica_nonfinite.py``,
``train/checkpoint.py``)."""

from __future__ import annotations

from collections.abc import Iterator


def cause_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from or while handling (``__cause__``, else ``__context__``),
    and so on: each one once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:  # a chain can loop back on itself
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


__all__ = ["cause_chain"]
