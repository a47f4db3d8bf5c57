"""Strategy registry: name → (strategy class, config class, declaration), for the API (`make_strategy`), the CLI,
the planner, the fault tolerance and the GPU check.

Each strategy module registers itself with :func:`register`, naming its config dataclass and its
:class:`~quietsync.strategies.declaration.Declaration` (its family's ``facts.py``: the cost schedule of its
``cost.py``, the planner's facts, its policy under torchft, ...); each family's ``__init__`` imports its strategy
modules and ``quietsync.strategies`` imports every family, so ``available()`` lists them all. A strategy of your
own registers when you import its module (``quietsync train --strategy-module FILE`` imports it for the CLI);
:func:`unregister` takes it away again and :func:`restored` puts the registry back as it was when a block ends
(tests, notebooks that try a strategy out). Everything outside ``strategies/`` asks :func:`declaration` about a
strategy instead of comparing its name.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .config import StrategyConfig, config_from_dict, knobs
from .declaration import Declaration

if TYPE_CHECKING:
    import torch

    from ..cost.schedule import Schedule
    from .base import Strategy

_REGISTRY: dict[str, tuple[type[Strategy], type[StrategyConfig]]] = {}
_SCHEDULES: dict[str, Callable[..., Schedule]] = {}
_TABLES: tuple[dict[str, Any], ...] = (_REGISTRY, _SCHEDULES)
"""Every table a registration writes: what :func:`unregister` and :func:`restored` clear and restore."""
S = TypeVar("S", bound="type[Strategy]")


def register(name: str, config_cls: type[StrategyConfig], schedule: Callable[..., Schedule] | None = None,
             facts: Declaration | None = None) -> Callable[[S], S]:
    """Class decorator: make a strategy available as ``name`` with its config dataclass and its declaration
    ``facts`` (:class:`~quietsync.strategies.declaration.Declaration`: what the planner, the fault tolerance and
    the checks must know of it); ``schedule`` — ``f(workload, topology, config) -> Schedule`` — is the
    declaration's cost schedule (None: the planner cannot predict it)."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, StrategyConfig)
            and dataclasses.is_dataclass(config_cls)):
        # the front doors call its methods (replace, uneven_steps): a plain dataclass would fail there, not here
        raise TypeError(f"register({name!r}, ...): the config must be a dataclass subclassing "
                        f"quietsync.strategies.StrategyConfig (or AccumulationConfig), got {config_cls!r}")
    declared = facts if facts is not None else Declaration()
    if schedule is not None:
        declared = dataclasses.replace(declared, schedule=schedule)

    def deco(cls: S) -> S:
        if name in _REGISTRY and _REGISTRY[name][0] is not cls:
            raise ValueError(f"strategy {name!r} registered twice")
        cls.name = name
        cls.config_cls = config_cls
        cls.declaration = declared
        _REGISTRY[name] = (cls, config_cls)
        if declared.schedule is not None:
            _SCHEDULES[name] = declared.schedule
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
            # in place: _TABLES holds these very dicts
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


def knob_owners(knob: str) -> list[str]:
    """The registered strategies whose config has the knob (field) ``knob``."""
    return [name for name in available() if knob in knobs(_REGISTRY[name][1])]


def declaration(name: str) -> Declaration:
    """What strategy ``name`` declares (its :class:`~quietsync.strategies.declaration.Declaration`), with an error
    listing the choices."""
    return get(name)[0].declaration


def ordered() -> list[str]:
    """The registered strategies in the order listings show them (each declaration's ``order``, then by name)."""
    return sorted(_REGISTRY, key=lambda n: (_REGISTRY[n][0].declaration.order, n))


def baselines() -> list[str]:
    """The strategies that may be the synchronous baseline, the preferred one first (``PlanFacts.baseline``)."""
    found = [(d.plan.baseline, n) for n in _REGISTRY if (d := declaration(n)).plan.baseline is not None]
    return [n for _, n in sorted(found)]


def load_module(path: str) -> None:
    """Import the strategy file or module ``path`` (``examples/custom_strategy.py``, or ``package.module``) so that
    the strategies it registers are available; a bad path is a ``ValueError`` naming it."""
    if path.endswith(".py") or "/" in path or "\\" in path:
        file = Path(path).resolve()
        if not file.is_file():
            raise ValueError(f"--strategy-module: no such file: {path}")
        module_name = file.stem
        if getattr(sys.modules.get(module_name), "__file__", None) == str(file) and any(
                cls.__module__ == module_name for cls, _ in _REGISTRY.values()):
            return  # imported already, its strategies registered
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"--strategy-module: cannot import {path}")
        if str(file.parent) not in sys.path:  # spawned workers import it by name to unpickle its config
            sys.path.append(str(file.parent))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # a dataclass in it looks its module up while it is built
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]  # no half-built module left for the check above to find
            raise
        return
    try:
        importlib.import_module(path)
    except ImportError as e:
        raise ValueError(f"--strategy-module: cannot import {path}: {e}") from None


def module_flags(name: str) -> list[str]:
    """The ``quietsync train`` flags that make strategy ``name`` available in a child process: ``--strategy-module
    FILE`` for a strategy registered from outside quietsync, nothing for a built-in one."""
    module = get(name)[0].__module__
    if module.split(".")[0] == "quietsync":  # a child registers the built-ins when it imports quietsync
        return []
    file = getattr(sys.modules.get(module), "__file__", None)
    return ["--strategy-module", file or module]


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
        return config_from_dict(cls, config)
    raise TypeError(f"config must be a {cls.__name__} or a dict of its fields, got {type(config).__name__}")


def make_strategy(name: str, model: torch.nn.Module, optimizer: Any = None, **kwargs: Any) -> Strategy:
    """Build the strategy ``name`` (see :class:`~quietsync.strategies.base.Strategy` for the arguments)."""
    cls, _ = get(name)
    if optimizer is None:
        import torch

        optimizer = torch.optim.AdamW
    return cls(model, optimizer, **kwargs)
