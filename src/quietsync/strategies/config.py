"""The base of every strategy's config dataclass (each strategy subclasses it with its own knobs, one docstring
under each field, checks in ``__post_init__``); the command line makes its flags from the fields."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


def knobs(cls: Any) -> list[str]:
    """A config class's fields a user sets (what its flags and a config dict may name), in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def config_from_dict(cls: Any, values: dict[str, Any]) -> Any:
    """``cls(**values)``, a field it does not have refused by name (with the close match, and the valid fields)
    rather than by the raw ``TypeError`` of ``__init__``."""
    import difflib

    known = knobs(cls)
    unknown = [k for k in values if k not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"config: {unknown[0]!r} is not a field of {cls.__name__}{hint}; its fields: "
                         f"{', '.join(known)}")
    return cls(**values)


def switches(cls: Any) -> dict[str, bool]:
    """A config class's on/off fields, each with whether it may also be None (annotated ``bool | None``)."""
    out = {}
    for f in dataclasses.fields(cls):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if kind in ("bool", "bool | None"):
            out[f.name] = kind != "bool"
    return out


def _check_switches(config: Any) -> None:
    """Every on/off field holds a bool: from Python a string such as ``"false"`` is truthy and would switch the knob
    on."""
    for name, nullable in switches(config).items():
        value = getattr(config, name)
        if not isinstance(value, bool) and not (nullable and value is None):
            raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclasses.dataclass
class StrategyConfig:
    """Base class of strategy configs (each strategy subclasses it with its own knobs)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_checks_switches", False):
            # the dataclass __init__ calls the subclass's own __post_init__ only: the switches are checked first there
            @functools.wraps(own)
            def post_init(self: Any, *args: Any) -> None:
                _check_switches(self)
                own(self, *args)

            post_init._checks_switches = True  # type: ignore[attr-defined]
            cls.__post_init__ = post_init  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        _check_switches(self)

    def replace(self, **changes: Any) -> StrategyConfig:
        return dataclasses.replace(self, **changes)

    def uneven_steps(self) -> str | None:
        """Why the workers of this config call ``step()`` a different number of times between two syncs (a phrase
        naming the knob), or None where every worker calls it as often as the others. Such workers are not in
        lockstep (``Strategy.lockstep``), and a loop that runs a collective of its own at every step (the HF
        Trainer's gathers) cannot drive them: each worker would meet it a different number of times."""
        return None
