"""``NAME[:FIELD=VALUE,...]``: one strategy with some of its config's fields, as ``quietsync compare --strategies``
and ``quietsync plan --strategies`` take it, turned into the strategy's name, a label and its flags (which the
strategy's generated config flags then parse, :mod:`~quietsync.cli.flags`)."""

from __future__ import annotations


def parse_strategy_spec(spec: str) -> tuple[str, str, list[str]]:
    """``"ddp:accumulation=2"`` → ``("ddp", "ddp-accumulation2", ["--accumulation", "2"])``."""
    name, _, rest = spec.partition(":")
    flags: list[str] = []
    label = name
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--strategies items must look like NAME[:FIELD=VALUE,...], got {spec!r}")
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        flags += [flag, value.strip()]
        label += f"-{key.strip().lstrip('-').replace('_', '-')}{value.strip()}"
    return name, label, flags
