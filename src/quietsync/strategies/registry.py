"""Strategy registry: name → (strategy class, config class, cost schedule), for the API (`make_strategy`), the CLI
and the planner.

Each strategy module registers itself with :func:`register`, naming its config dataclass and the function that
writes its communication schedule (its family's ``cost.py``); each family's ``__init__`` imports its strategy
modules and ``quietsync.strategies`` imports every family, so ``available()`` lists them all. A strategy of your
own registers when you import its module; :func:`unregister` takes it away again and :func:`restored` puts the
registry back as it was when a block ends (tests, notebooks that try a strategy out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import is_dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

    from ..cost.schedule import Schedule
    from .base import Strategy
    from .config import StrategyConfig

_REGISTRY: dict[str, tuple[type[Strategy], type[StrategyConfig]]] = {}
_SCHEDULES: dict[str, Callable[..., Schedule]] = {}
_TABLES: tuple[dict[str, Any], ...] = (_REGISTRY, _SCHEDULES)
"""Every table a registration writes: what :func:`unregister` and :func:`restored` clear and restore."""
S = TypeVar("S", bound="type[Strategy]")


def register(name: str, config_cls: type[StrategyConfig],
             schedule: Callable[..., Schedule] | None = None) -> Callable[[S], S]:
    """Class decorator: make a strategy available as ``name`` with its config dataclass and, for the planner, its
    schedule ``f(workload, topology, config) -> Schedule`` (None: the planner cannot predict it)."""

    def deco(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name][0] is not cls:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        cls.config_cls = config_cls
        _REGISTRY[name] = (cls, config_cls)
        if schedule is not None:
            _SCHEDULES[name] = schedule
        return cls

    return deco


def unregister(name: str) -> None:
    """Forget strategy ``name`` (registered by :func:`register`), with an error listing the choices if unknown."""
    get(name)
    for table in _TABLES:
        table.pop(name, None)


@contextmanager
def restored() -> Iterator[None]:
    """Within the block, register or unregister at will; when it ends (even by an exception) the registry holds
    exactly what it held when the block began."""
    saved = [dict(table) for table in _TABLES]
    try:
        yield
    finally:
        for table, before in zip(_TABLES, saved):
            table.clear()
            table.update(before)


def available() -> list[str]:
    """Names of the registered strategies."""
    return sorted(_REGISTRY)


def get(name: str) -> tuple[type[Strategy], type[StrategyConfig]]:
    """``(strategy class, config class)`` of ``name``, with an error listing the choices."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"strategy must be one of {', '.join(available())}; got {name!r}") from None


def schedules() -> dict[str, Callable[..., Schedule]]:
    """Strategy name → its schedule function, for every registered strategy that has one."""
    return dict(_SCHEDULES)


def schedule_of(name: str) -> Callable[..., Schedule]:
    """The schedule function of strategy ``name``, with an error saying why there is none."""
    get(name)
    if name not in _SCHEDULES:
        raise ValueError(f"strategy {name!r} has no schedule: the planner cannot predict it (register it with "
                         f"@register({name!r}, Config, schedule=...))")
    return _SCHEDULES[name]


def strategy_config(name: str, config: Any = None) -> StrategyConfig:
    """The strategy's own config dataclass from a dict of its fields (validated by the strategy's checks)."""
    _, cls = get(name)
    if config is None:
        return cls()
    if is_dataclass(config) and isinstance(config, cls):
        return config
    if isinstance(config, dict):
        return cls(**config)
    raise TypeError(f"config must be a {cls.__name__} or a dict of its fields, got {type(config).__name__}")


def make_strategy(name: str, model: torch.nn.Module, optimizer: Any = None, **kwargs: Any) -> Strategy:
    """Build the strategy ``name`` (see :class:`~quietsync.strategies.base.Strategy` for the arguments)."""
    cls, _ = get(name)
    if optimizer is None:
        import torch

        optimizer = torch.optim.AdamW
    return cls(model, optimizer, **kwargs)
