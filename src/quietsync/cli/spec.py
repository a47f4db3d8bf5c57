"""``NAME[:FIELD=VALUE,...]``: one strategy with some of its config's fields, as ``quietsync compare --strategies``
and ``quietsync plan --strategies`` take it, turned into the strategy's name, a label and its flags (which the
strategy's generated config flags then parse, :mod:`~quietsync.cli.flags`)."""

from __future__ import annotations

BOOLEAN = {"true": True, "false": False}
"""How a spec spells an on/off field's value (the planner writes them so): ``demo:sign=false`` → ``--no-sign``."""


def parse_strategy_spec(spec: str) -> tuple[str, str, list[str]]:
    """``"ddp:accumulation=2"`` → ``("ddp", "ddp-accumulation2", ["--accumulation", "2"])``; an on/off field
    spelled ``true``/``false`` becomes its ``--field``/``--no-field`` flag."""
    name, _, rest = spec.partition(":")
    flags: list[str] = []
    label = name
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--strategies items must look like NAME[:FIELD=VALUE,...], got {spec!r}")
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        on = BOOLEAN.get(value.strip().lower())
        flags += [flag, value.strip()] if on is None else [flag if on else "--no-" + flag[2:]]
        label += f"-{key.strip().lstrip('-').replace('_', '-')}{value.strip()}"
    return name, label, flags
