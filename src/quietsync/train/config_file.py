"""``quietsync train --config FILE``: every flag from a TOML file, or a run replayed from its ``summary.json``.

A TOML file holds top-level keys named like the flags, with dashes or underscores (``max-steps = 300`` or
``max_steps = 300``): the job's (:class:`~quietsync.train.config.TrainConfig`) and the chosen strategy's,
a strategy field that a job flag already uses spelled as its flag is (``demo_seed``). A
``[strategy_config]`` table may hold the strategy's fields under their own names instead. Values have
the field's TOML type (``link`` a list of strings or one string; ``log_with`` a string or a list).

A JSON file is read the same way, except that a run's ``summary.json`` (it holds ``config`` and
``strategy_config``) replays that run: its job and strategy config, less ``resume`` and ``overwrite``
(a replay starts from step 0 and never replaces the run it reads).

Flags on the command line override the file. Unknown keys and values of the wrong type are one-line
errors naming them.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

__all__ = ["ConfigFile", "ConfigFileError", "read_config_file", "split_values"]

NOT_REPLAYED = ("resume", "overwrite")
"""Job fields of a ``summary.json`` that a replay leaves at their defaults."""


class ConfigFileError(ValueError):
    """A bad ``--config`` file; ``str()`` is one line."""


@dataclass
class ConfigFile:
    """What a ``--config`` file holds, before it is matched to the flags."""

    path: str
    """The file, as given."""
    values: dict[str, Any] = field(default_factory=dict)
    """Top-level keys (dashes turned into underscores) -> values."""
    strategy_values: dict[str, Any] = field(default_factory=dict)
    """Strategy fields under their own names (a ``[strategy_config]`` table or a summary's ``strategy_config``)."""
    replay: bool = False
    """The file is a run's ``summary.json``."""
    spelled: dict[str, str] = field(default_factory=dict)
    """Top-level key -> its spelling in the file (for error messages)."""

    @property
    def strategy(self) -> str | None:
        """The strategy the file names, if any."""
        value = self.values.get("strategy")
        return value if isinstance(value, str) else None


def _key(name: str) -> str:
    return str(name).replace("-", "_")


def _toml() -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigFileError("--config: a TOML file needs Python 3.11 or `pip install tomli`") from None
    return tomllib


def read_config_file(path: str) -> ConfigFile:
    """Read a TOML or JSON ``--config`` file (JSON when it ends in ``.json``)."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ConfigFileError(f"--config: cannot read {path}: {e.strerror or e}") from None
    try:
        if file.suffix.lower() == ".json":
            data = json.loads(raw.decode("utf-8"))
        else:
            data = _toml().loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        kind = "JSON" if file.suffix.lower() == ".json" else "TOML"
        raise ConfigFileError(f"--config {path}: not valid {kind}: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a table of flag names, got {type(data).__name__}")
    if isinstance(data.get("config"), dict) and "strategy_config" in data:  # a run's summary.json
        from .config import TrainConfig

        # a value at its default is not replayed as given: a prepared --dataset decides vocab_size and the split,
        # and the recorded defaults would contradict it (a run that set them to their defaults ran the same)
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)
                    if f.default is not dataclasses.MISSING}
        values = {_key(k): v for k, v in data["config"].items()
                  if _key(k) not in NOT_REPLAYED and not (_key(k) in defaults and defaults[_key(k)] == v)}
        strategy_values = data.get("strategy_config") or {}
        return ConfigFile(path, values, {_key(k): v for k, v in strategy_values.items()}, replay=True)
    twice = [k for k in data if k != _key(k) and _key(k) in data]
    if twice:  # max-steps and max_steps: one value would silently win
        raise ConfigFileError(f"--config {path}: {twice[0]} and {_key(twice[0])} name the same flag: keep one")
    values = {_key(k): v for k, v in data.items()}
    strategy_values = values.pop("strategy_config", {})
    if not isinstance(strategy_values, dict):
        raise ConfigFileError(f"--config {path}: strategy_config must be a table of the strategy's fields")
    return ConfigFile(path, values, {_key(k): v for k, v in strategy_values.items()},
                      spelled={_key(k): k for k in data})


def _optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (Union, types.UnionType):  # Optional[X] is a Union, X | None a types.UnionType
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(args)
    return tp, False


def _checked(path: str, key: str, tp: Any, value: Any) -> Any:
    """``value`` as field type ``tp`` (a few lenient spellings), or a :class:`ConfigFileError`."""
    tp, nullable = _optional(tp)
    if value is None:
        if nullable:
            return None
        raise ConfigFileError(f"--config {path}: {key} may not be null")
    origin = typing.get_origin(tp)

    def bad(what: str) -> ConfigFileError:
        return ConfigFileError(f"--config {path}: {key} must be {what}, got {value!r}")

    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise bad("one of " + ", ".join(map(str, choices)))
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):  # TOML true is a bool, and a bool is an int
            raise bad("an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)  # an integer (lr = 1) is a float value too
    if tp is str:
        if key == "resume" and isinstance(value, bool):  # a bare --resume: true takes the latest, false none
            return "latest" if value else None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return ",".join(value)  # a comma list (--log-with) written as a TOML array
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if origin is list or tp is list:
        if isinstance(value, str):
            return [value]  # link = "inter=...": one entry
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise bad("a list")
        return list(value)
    return value


def split_values(
    file: ConfigFile,
    job_cls: type,
    job_fields: dict[str, str],
    strategy: str,
    strategy_cls: type,
    strategy_fields: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's values as (job ``{field: value}``, strategy ``{field: value}``), type-checked.

    ``job_fields`` / ``strategy_fields`` are ``{field: flag}`` as
    :func:`~quietsync.cli.flags.add_dataclass_flags` returned them.
    """
    job_hints = typing.get_type_hints(job_cls)
    strategy_hints = typing.get_type_hints(strategy_cls)
    # top-level keys name strategy fields by their flag (demo_seed for demo's seed)
    by_flag = {flag[2:].replace("-", "_"): name for name, flag in strategy_fields.items()}
    job: dict[str, Any] = {}
    strat: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in file.values.items():
        if key in job_fields:
            job[key] = _checked(file.path, key, job_hints.get(key, Any), value)
        elif key in by_flag:
            name = by_flag[key]
            strat[name] = _checked(file.path, key, strategy_hints.get(name, Any), value)
        else:
            unknown.append(file.spelled.get(key, key))
    init_fields = {f.name for f in dataclasses.fields(strategy_cls) if f.init}
    for key, value in file.strategy_values.items():
        if key in strategy_fields:
            strat[key] = _checked(file.path, key, strategy_hints.get(key, Any), value)
        elif not (file.replay and (key not in init_fields or key.startswith("_"))):  # not flags
            unknown.append(f"strategy_config.{key}")
    if unknown:
        raise ConfigFileError(
            f"--config {file.path}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(not flags of quietsync train --strategy {strategy})"
        )
    return job, strat
