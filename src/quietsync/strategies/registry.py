"""Strategy registry: name → (strategy class, config class), for the API (`make_strategy`) and the CLI.

Each strategy module registers itself with :func:`register`; ``quietsync.strategies`` imports every module
of the package, so a new strategy is a new file and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from .base import Strategy, StrategyConfig

_REGISTRY: dict[str, tuple[type[Strategy], type[StrategyConfig]]] = {}
S = TypeVar("S", bound="type[Strategy]")


def register(name: str, config_cls: type[StrategyConfig]) -> Callable[[S], S]:
    """Class decorator: make a strategy available as ``name``."""

    def deco(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name][0] is not cls:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        cls.config_cls = config_cls
        _REGISTRY[name] = (cls, config_cls)
        return cls

    return deco


def available() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_REGISTRY)


def get(name: str) -> tuple[type[Strategy], type[StrategyConfig]]:
    """``(strategy class, config class)`` of ``name``, with an error listing the choices."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"strategy must be one of {', '.join(available())}; got {name!r}") from None


def make_strategy(name: str, model: torch.nn.Module, optimizer: Any = None, **kwargs: Any) -> Strategy:
    """Build the strategy ``name`` (see :class:`~quietsync.strategies.base.Strategy` for the arguments)."""
    cls, _ = get(name)
    if optimizer is None:
        import torch

        optimizer = torch.optim.AdamW
    return cls(model, optimizer, **kwargs)
