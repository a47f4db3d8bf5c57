"""The base of every strategy's config dataclass (each strategy subclasses it with its own knobs, one docstring
under each field, checks in ``__post_init__``); the command line makes its flags from the fields."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StrategyConfig:
    """Base class of strategy configs (each strategy subclasses it with its own knobs)."""

    def replace(self, **changes: Any) -> StrategyConfig:
        return dataclasses.replace(self, **changes)
