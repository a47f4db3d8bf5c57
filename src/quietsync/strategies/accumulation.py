"""Fixed gradient accumulation: the ``accumulation`` knob and its round counter (a part).

Strategies that step every ``accumulation`` micro-batches (ddp, zero1, demo, flexdemo, localsgd, ...) take
their config from :class:`AccumulationConfig` and hold an :class:`Accumulator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..validate import check_int
from .base import StrategyConfig


@dataclass
class AccumulationConfig(StrategyConfig):
    """Configs of strategies with fixed gradient accumulation."""

    accumulation: int = 1
    """Micro-batches per step on each worker (gradient accumulation)."""

    def __post_init__(self) -> None:
        check_int("accumulation", self.accumulation, 1)


class Accumulator:
    """Counts the micro-batches of the current round; a round is full after ``size`` of them."""

    def __init__(self, size: int) -> None:
        check_int("accumulation", size, 1)
        self.size = size
        self.count = 0

    def add(self) -> None:
        self.count += 1

    @property
    def full(self) -> bool:
        """Whether the round holds ``size`` micro-batches (time to step)."""
        return self.count >= self.size

    @property
    def next_is_last(self) -> bool:
        """Whether the next micro-batch completes the round."""
        return self.count == self.size - 1

    def reset(self) -> None:
        self.count = 0

    def position(self) -> dict[str, int]:
        return {"round": self.count}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_int("checkpoint accumulation count", state["count"], 0, self.size)
        self.count = int(state["count"])
