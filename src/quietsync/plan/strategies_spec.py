"""``NAME[:FIELD=VALUE,...]`` strategy specs (as ``quietsync compare --strategies`` takes them) → typed knobs.

Values are parsed by the strategy's own config flags (:mod:`quietsync.cli.flags`), so ``diloco:
sync_every=16,overlap_delay=4`` gives ``{"sync_every": 16, "overlap_delay": 4}`` and a bad field or value is
an error naming the spec.
"""

from __future__ import annotations

import argparse
from typing import Any


class _Raising(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)  # argparse would print and exit; a bad spec is a ValueError


def _elsewhere(name: str, flags: list[str]) -> str | None:
    """As ``train`` says it: the first knob ``name`` does not have, and the strategies that have it (None when it
    is not a knob of another strategy, or every knob is ``name``'s)."""
    from ..strategies.config import knobs
    from ..strategies.registry import get, knob_owners

    mine = set(knobs(get(name)[1]))
    for flag in flags:
        key = flag.removeprefix("--").split("=")[0].replace("-", "_")
        if flag.startswith("--") and key not in mine:
            owners = knob_owners(key)
            return f"{key} is not a knob of strategy {name} (it belongs to {', '.join(owners)})" if owners else None
    return None


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"diloco:sync_every=16"`` → ``("diloco", {"sync_every": 16})`` (values checked by the config)."""
    from ..cli.flags import add_dataclass_flags, given_values
    from ..cli.spec import parse_strategy_spec
    from ..strategies.config import switches
    from ..strategies.registry import available, get

    name, _, flags = parse_strategy_spec(spec)
    if name not in available():
        where = f" (in {spec!r})" if spec != name else ""  # the name alone is the spec: said once
        raise ValueError(f"strategies: {name!r}{where} is not a strategy (choose from {', '.join(available())})")
    _, cls = get(name)
    on_off = {name.replace("_", "-") for name in switches(cls)}
    for flag, value in zip(flags, flags[1:]):
        # a switch spelled anything but true/false would reach argparse as a stray argument
        if flag.startswith("--") and flag[2:] in on_off and not value.startswith("--"):
            raise ValueError(f"strategies: {spec!r}: {flag[2:].replace('-', '_')} takes true or false, got {value!r}")
    parser = _Raising(prog=name, add_help=False)
    fields = add_dataclass_flags(parser, cls)
    try:
        args = parser.parse_args(flags)
    except ValueError as e:
        raise ValueError(f"strategies: {spec!r}: {_elsewhere(name, flags) or e}") from None
    values = given_values(args, fields)
    try:
        config = cls(**values)  # the config's own checks refuse a bad value now
    except (TypeError, ValueError) as e:
        raise ValueError(f"strategies: {spec!r}: {e}") from None
    if hasattr(config, "adapt") and not config.adapt:  # as quietsync train refuses it: the knob would be ignored
        unused = [k for k in values if k.startswith("adapt_")]
        if unused:
            raise ValueError(f"strategies: {spec!r}: {unused[0]} needs adapt=true (without it no knob is re-picked "
                             "during the run)")
    return name, values


def parse_specs(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """Every spec of ``specs``."""
    return [parse_spec(s) for s in specs]
