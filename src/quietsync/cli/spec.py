"""``NAME[:FIELD=VALUE,...]``: one strategy with some of its config's fields, as ``quietsync compare --strategies``
and ``quietsync plan --strategies`` take it, turned into the strategy's name, a label and its flags (which the
strategy's generated config flags then parse, :mod:`~quietsync.cli.flags`)."""

from __future__ import annotations

BOOLEAN = {"true": True, "false": False}
"""How a spec spells an on/off field's value (the planner writes them so): ``demo:sign=false`` → ``--no-sign``."""


def parse_strategy_spec(spec: str) -> tuple[str, str, list[str]]:
    """``"ddp:accumulation=2"`` → ``("ddp", "ddp-accumulation2", ["--accumulation", "2"])``; an on/off field
    spelled ``true``/``false`` becomes its ``--field``/``--no-field`` flag (label ``-field``/``-no-field``), and a
    word is set off from its field in the label (``localsgd:inner_steps=adaptive`` → ``localsgd-inner-steps-adaptive``,
    not ``...-inner-stepsadaptive``). A value may hold commas (a list, as
    ``adapt_sync_every=8,16,32`` or ``adapt_tokens=16:2e6,32:3e6``): an item without ``=`` continues the value
    before it."""
    name, colon, rest = spec.partition(":")
    if colon and any(not s.strip() for s in rest.split(",")):  # "diloco:", "a=1,,b=2": a field left out
        raise ValueError(f"--strategies items must look like NAME[:FIELD=VALUE,...] with no empty field, got {spec!r}")
    items: list[tuple[str, str]] = []
    for item in (s.strip() for s in rest.split(",") if s.strip()):
        key, sep, value = item.partition("=")
        if not sep and items:
            items[-1] = (items[-1][0], f"{items[-1][1]},{item}")
            continue
        if not sep or not key:
            raise ValueError(f"--strategies items must look like NAME[:FIELD=VALUE,...], got {spec!r}")
        items.append((key.strip().lstrip("-").replace("_", "-"), value.strip()))
    flags: list[str] = []
    label = name
    for key, value in items:
        on = BOOLEAN.get(value.lower())
        flags += [f"--{key}", value] if on is None else [f"--{key}" if on else f"--no-{key}"]
        if on is not None:
            label += f"-{key}" if on else f"-no-{key}"
        else:
            label += f"-{key}-{value}" if value[:1].isalpha() else f"-{key}{value}"
    return name, label, flags
