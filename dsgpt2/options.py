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
) -> Any:
    """A dataclass field that is also a command-line option.

    Args:
        default: the default value (the one place it is written); MISSING for a required option.
        help: one line for ``--help``; the default is appended.
        type: argparse type converter (default: from the annotation).
        choices: the allowed values.
        hidden: not shown in ``--help`` (test hooks).
    """
    meta = {
        "help": help,
        "type": type,
        "choices": list(choices) if choices is not None else None,
        "metavar": metavar,
        "hidden": hidden,
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
        kind, _ = _base_type(hints[name])
        default = (defaults or {}).get(name, _default(f))
        help_text = meta.get("help", "")
        if meta.get("hidden"):
            help_text = argparse.SUPPRESS
        elif _shown(default) and "default" not in help_text:
            shown = ",".join(default) if isinstance(default, tuple) else default
            help_text = f"{help_text} (default: {shown})"
        kwargs: dict[str, Any] = {"dest": name, "help": help_text}
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            if typing.get_origin(kind) is list:
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
        flag = "--" + name
        parser.add_argument(flag, **kwargs)


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
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(override)
    return cls(**values)


# ---------------------------------------------------------------- checks (the message names the flag)


def check_positive(flag: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ConfigError(f"--{flag} must be a positive integer, got {value}")


def check_non_negative(flag: str, value: int | None) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"--{flag} must be 0 or more, got {value}")


def check_ratio(flag: str, value: float | None) -> None:
    if value is not None and not 0 < value <= 1:
        raise ConfigError(f"--{flag} must be a share in (0, 1], got {value}")


def check_choice(flag: str, value: str | None, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value is not None and value not in choices:
        raise ConfigError(f"--{flag} {value!r} is not one of {', '.join(choices)}")


def as_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
