"""Command-line options derived from dataclasses: one home for every default, help text and check.

A config dataclass declares each option once with :func:`option`; :func:`add_options` turns its
fields into ``--name`` flags (underscore spelling, the original toolkit's) and
:func:`from_namespace` builds the validated object back from parsed arguments. The dataclass's
``__post_init__`` checks values and names the flag in its message, so a config made in code (the
demo, the tests) is checked exactly like one from the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError

MISSING = dataclasses.MISSING


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    type: Callable[[str], Any] | None = None,
    choices: Iterable[str] | None = None,
    metavar: str | None = None,
    hidden: bool = False,
    flag: str | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option.

    Args:
        default: the default value (the one place it is written); MISSING for a required option.
        help: one line for ``--help``; the default is appended.
        type: argparse type converter (default: from the annotation).
        choices: the allowed values.
        hidden: not shown in ``--help`` (test hooks).
        flag: the option's name where it differs from the field's (``--flag``, parsed into ``flag``).
        repeat: a tuple field given once per value (``--collection a --collection b``).

    A ``bool | None`` field becomes a pair, ``--name`` and ``--no_name``, left None when neither is
    given (the caller's default applies).
    """
    meta = {
        "help": help,
        "type": type,
        "choices": list(choices) if choices is not None else None,
        "metavar": metavar,
        "hidden": hidden,
        "flag": flag,
        "repeat": repeat,
    }
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=default.copy, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation such as ``int | None``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    only: Iterable[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add a ``--field`` option per field of the dataclass ``cls`` (``only``: a subset, in order).

    ``defaults`` overrides a field's default for this parser (``dsgpt2 plan`` needs no corpus).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in only or fields:
        f = fields[name]
        meta = f.metadata
        dest = meta.get("flag") or name
        kind, optional = _base_type(hints[name])
        default = (defaults or {}).get(name, _default(f))
        help_text = meta.get("help", "")
        if meta.get("hidden"):
            help_text = argparse.SUPPRESS
        elif _shown(default) and "default" not in help_text:
            shown = ",".join(default) if isinstance(default, tuple) else default
            help_text = f"{help_text} (default: {shown})"
        kwargs: dict[str, Any] = {"dest": dest, "help": help_text}
        if kind is bool and optional:
            pair = parser.add_mutually_exclusive_group()
            pair.add_argument(f"--{dest}", action="store_const", const=True, default=default, **kwargs)
            no = argparse.SUPPRESS if meta.get("hidden") else f"the opposite of --{dest}"
            pair.add_argument(f"--no_{dest}", dest=dest, action="store_const", const=False, help=no)
            continue
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            if typing.get_origin(kind) in (list, tuple) and not meta.get("type"):
                if meta.get("repeat"):
                    kwargs["action"] = "append"
                else:
                    kwargs["nargs"] = "*"
                kind = typing.get_args(kind)[0]
            kwargs["type"] = meta.get("type") or kind
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        if default is MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        parser.add_argument(f"--{dest}", **kwargs)


def _shown(default: Any) -> bool:
    """Whether ``--help`` states the default: not for "not given" (None, off, empty)."""
    return default is not MISSING and default is not None and default is not False and default != []


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def from_namespace(cls: type, args: argparse.Namespace, **override: Any) -> Any:
    """An instance of ``cls`` from the parsed ``args`` (fields it has), validated on construction."""
    values = {}
    for f in dataclasses.fields(cls):
        dest = f.metadata.get("flag") or f.name
        if hasattr(args, dest):
            values[f.name] = getattr(args, dest)
    values.update(override)
    return cls(**values)


# ---------------------------------------------------------------- checks
# One family for every setting, from a flag or a request body: ``name`` is the setting as the user
# wrote it (``--train_iters`` for a flag, ``temperature`` in a request), the message its range.
# ``optional``: None means "not given" and passes.


def check_int(name: str, value: Any, low: int, high: int | None = None, optional: bool = False) -> None:
    """``value`` is an integer (not a bool) in ``[low, high]``."""
    if optional and value is None:
        return
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"{name} must be an integer {bound}, got {value!r}")


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    or_zero: bool = False,
    optional: bool = False,
) -> None:
    """``value`` is a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``; no upper
    bound with ``high`` None); ``or_zero``: 0 is accepted too."""
    if optional and value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and not (or_zero and value == 0):
        ok = (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        also = "0 or " if or_zero else ""
        if high is None:
            bound = f"above {low}" if low_open else f"at least {low}"
        else:
            bound = f"in {'(' if low_open else '['}{low}, {high}]"
        raise ConfigError(f"{name} must be {also}a number {bound}, got {value!r}")


def check_positive(name: str, value: int | None) -> None:
    check_int(name, value, 1, optional=True)


def check_non_negative(name: str, value: int | None) -> None:
    check_int(name, value, 0, optional=True)


def check_ratio(name: str, value: float | None) -> None:
    """A share in (0, 1]."""
    if value is not None and not (
        isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1
    ):
        raise ConfigError(f"{name} must be in (0, 1], got {value!r}")


def check_choice(name: str, value: str | None, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value is not None and value not in choices:
        raise ConfigError(f"{name} {value!r} is not one of {', '.join(choices)}")


def as_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
