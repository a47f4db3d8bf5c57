"""Command-line flags generated from ``@dataclass`` configs, and a parser whose errors are one line.

Every field becomes a flag: ``foo_bar`` → ``--foo-bar``; a ``bool`` field gets ``--foo-bar/--no-foo-bar``;
a ``Literal[...]`` field gets its choices; the help text is the attribute docstring written right under the
field (read from the source with :mod:`ast`). A field may refine its flag with
``field(metadata={"flag": {...argparse kwargs...}})``.

Flags default to ``None`` ("not given"), so the dataclass keeps its own defaults, which the help shows.
:func:`build_config` turns a config's ``ValueError("<field> must be ...")`` into a :class:`FlagError`
that names the flag instead of the field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from typing import Any, Literal, NoReturn, Union

PROG = "quietsync"
"""The command's name in its messages."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


class FlagError(ValueError):
    """A bad command-line value; ``str()`` is a one-line message starting with the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


def flag_name(field_name: str) -> str:
    """``foo_bar`` → ``--foo-bar``."""
    return "--" + field_name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of ``cls`` and its bases: ``{field: first paragraph of the docstring}``."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # bases first: a subclass's docstring for a field wins
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a built-in, made at runtime): no help text
            continue
        tree = ast.parse(source)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef)), None)
        if node is None:
            continue
        body = node.body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                text = inspect.cleandoc(nxt.value.value).split("\n\n")[0]
                docs[stmt.target.id] = " ".join(text.split())
    return docs


def _unwrap_optional(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    return str(value)


def _kwargs_for(f: dataclasses.Field, tp: Any, doc: str) -> dict[str, Any]:
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    kwargs: dict[str, Any] = {"default": None, "dest": f.name}
    help_text = doc.rstrip(".") if doc else f.name.replace("_", " ")
    default = _default_text(f)
    # a help text that explains its own default needs no '(default: none)'
    if not (default == "none" and "default" in help_text.lower()):
        help_text = f"{help_text} (default: {default})"
    kwargs["help"] = help_text.replace("%", "%%")  # argparse %-formats help strings
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif origin is Literal:
        choices = list(typing.get_args(tp))
        kwargs["choices"] = choices
        kwargs["type"] = type(choices[0])
        kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
    elif origin in (list, tuple) or tp in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        kwargs["type"] = args[0] if args and args[0] in (int, float, str) else str
        kwargs["action"] = "append"
    elif tp in (int, float, str):
        kwargs["type"] = tp
        kwargs["metavar"] = {int: "N", float: "X", str: "S"}[tp]
    else:
        kwargs["type"] = str
    kwargs.update(f.metadata.get("flag", {}))
    return kwargs


def add_dataclass_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: typing.Iterable[str] = (),
    prefix_for: typing.Iterable[str] = (),
    prefix: str = "",
) -> dict[str, str]:
    """Add one flag per field of dataclass ``cls`` (except ``skip``); return ``{field: flag}``.

    Fields in ``prefix_for`` (e.g. names another config already uses) get the flag ``--<prefix><field>``
    instead of ``--<field>``. The parsed value of field ``f`` is ``args.<dest_name(f, ...)>``.
    """
    hints = typing.get_type_hints(cls, include_extras=False)
    docs = field_docs(cls)
    skip, prefix_for = set(skip), set(prefix_for)
    added: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init or f.name.startswith("_"):
            continue
        name = prefix + f.name if f.name in prefix_for else f.name
        kwargs = _kwargs_for(f, hints.get(f.name, str), docs.get(f.name, ""))
        kwargs["dest"] = name
        parser.add_argument(flag_name(name), **kwargs)
        added[f.name] = flag_name(name)
    return added


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def given_values(args: argparse.Namespace, flags: dict[str, str] | typing.Iterable[str]) -> dict[str, Any]:
    """``{field: value}`` for the fields whose flag was given on the command line (value not None).

    ``flags`` is what :func:`add_dataclass_flags` returned (or plain field names).
    """
    mapping = flags if isinstance(flags, dict) else {n: flag_name(n) for n in flags}
    values = {f: getattr(args, _dest(flag), None) for f, flag in mapping.items()}
    return {f: v for f, v in values.items() if v is not None}


_LEADING_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)(.*)$", re.S)
_SNAKE_NAME = re.compile(r"(?<![\w\-./:'=])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w=(/])")
"""A snake_case word standing alone in a message (not in a path, a spec ``k=v`` or a call): a field's name."""


_FIELD_VALUE = re.compile(r"(?<![\w\-./:'=])([a-z][a-z0-9_]*)=(True|False|'[^']*'|\"[^\"]*\"|[\w.\-]+)")
"""``field=value`` in a message, as the API is called: the CLI user types the flag instead."""


def _typed(match: re.Match[str], mapping: dict[str, str]) -> str:
    """``adapt=False`` → ``--no-adapt``, ``inner_steps='fixed'`` → ``--inner-steps fixed`` (fields in ``mapping``)."""
    name, value = match.group(1), match.group(2)
    flag = mapping.get(name)
    if flag is None:
        return match.group(0)
    if value in ("True", "False"):  # a bool field's flag pair (add_dataclass_flags)
        return flag if value == "True" else "--no-" + flag[2:]
    return f"{flag} {value.strip(chr(39) + chr(34))}"


def flag_message(message: str, fields: dict[str, str] | typing.Iterable[str]) -> tuple[str | None, str]:
    """Rewrite ``"<field> must be ..."`` as ``"--<flag> must be ..."``; return ``(flag or None, text)``.

    The rest of the message speaks the user's language too: another field named in it (``needs pilot_tokens N
    ... or what_if``) becomes its flag (``needs --pilot-tokens N ... or --what-if``), and ``or None`` (a value no
    one can type) becomes "or leave the flag out"; a field set as the API sets it becomes the flag typed
    (``adapt=False or inner_steps='fixed'`` → ``--no-adapt or --inner-steps fixed``).
    ``fields`` maps field names to their flags (or lists field names whose flag is ``--<field>``).
    """
    mapping = fields if isinstance(fields, dict) else {n: flag_name(n) for n in fields}
    message = " ".join(str(message).split())
    flag = None
    m = _LEADING_NAME.match(message)
    if message.startswith("--"):
        flag = message.split()[0].rstrip(":,")
    elif m and m.group(1) in mapping:
        flag = mapping[m.group(1)]
        message = flag + m.group(2)
    message = _FIELD_VALUE.sub(lambda w: _typed(w, mapping), message)
    message = _SNAKE_NAME.sub(lambda w: mapping.get(w.group(0), w.group(0)), message)
    if flag is not None:
        message = re.sub(r" or None\b", " (or leave the flag out)", message)
    return flag, message


def build_config(
    cls: type, values: dict[str, Any], context: str = "", flags: dict[str, str] | None = None
) -> Any:
    """``cls(**values)``, turning its ``ValueError``/``TypeError`` into a :class:`FlagError` naming the flag.

    ``flags`` maps field names to flag spellings when they are not ``--<field>`` (see ``prefix_for``).
    """
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        mapping = {f.name: flag_name(f.name) for f in dataclasses.fields(cls)}
        mapping.update(flags or {})
        flag, text = flag_message(str(e), mapping)
        if flag is None:
            text = f"{context}{text}" if context else text
        raise FlagError(flag or "", text) from None
