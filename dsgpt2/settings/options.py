"""Command-line options derived from dataclasses: one home for every default, help text and check.

A settings dataclass declares each option once with :func:`option`; :func:`add_options` turns its
fields into ``--name`` flags (underscore spelling, the original toolkit's), positional arguments,
short aliases and mutually exclusive groups, and :func:`from_namespace` builds the object back from
parsed arguments. A field's range (a :class:`Range`) is written once: the flag refuses a value
outside it as it is parsed, and the dataclass's ``__post_init__`` checks it (:func:`check_fields`)
naming the flag, so a setting made in code (the demo, the tests) is checked like one from the command
line. The argparse type converters of :mod:`dsgpt2.settings.argtypes` are built from the same ranges.

This module is also the one place that reads a parser back (its flags, its subcommands): argparse
keeps those in attributes of its own.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from dsgpt2.errors import ConfigError

MISSING = dataclasses.MISSING


# ---------------------------------------------------------------- value checks
# One family for every setting, from a flag or a request body: ``name`` is the setting as the user
# wrote it (``--train_iters`` for a flag, ``temperature`` in a request), the message its range.
# ``optional``: None means "not given" and passes.


@dataclasses.dataclass(frozen=True)
class Range:
    """A range of numbers, written once: it checks values (:meth:`check`) and reads a flag's text
    (:meth:`parse`; :meth:`convert` also refuses a number outside it, as argparse parses it).

    Attributes:
        kind: ``int`` (not a bool) or ``float`` (an int too; finite).
        low, high: the bounds (``high`` None: none above).
        low_open: ``(low, high]`` instead of ``[low, high]``.
        high_open: ``[low, high)`` (with ``low_open``: ``(low, high)``).
        or_zero: 0 is accepted too.
        name: the range in words where it has a name (``"a positive integer"``); else from the bounds.
        short: how a number of the right kind outside the range is told (``"in (0, 1]"``).
    """

    kind: type
    low: float
    high: float | None = None
    low_open: bool = False
    or_zero: bool = False
    name: str | None = None
    short: str | None = None
    high_open: bool = False

    @property
    def words(self) -> str:
        """The range in words: ``an integer at least 0``, ``a number in (0, 1]``."""
        if self.name:
            return self.name
        noun = "an integer" if self.kind is int else "a number"
        if self.high is None:
            bound = f"above {self.low}" if self.low_open else f"at least {self.low}"
        elif self.kind is int:
            bound = f"between {self.low} and {self.high}"
        else:
            bound = (
                f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
            )
        return f"{'0 or ' if self.or_zero else ''}{noun} {bound}"

    def _of_kind(self, value: Any) -> bool:
        if isinstance(value, bool):
            return False
        if self.kind is int:
            return isinstance(value, int)
        return isinstance(value, int | float) and math.isfinite(value)

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is a number of this kind inside the range."""
        if not self._of_kind(value):
            return False
        if self.or_zero and value == 0:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def check(self, name: str, value: Any, optional: bool = False) -> None:
        """Raise :class:`ConfigError` naming ``name`` unless ``value`` is in the range."""
        if (optional and value is None) or self.holds(value):
            return
        told = self.short if self.short and self._of_kind(value) else self.words
        raise ConfigError(f"{name} must be {told}, got {value!r}")

    def parse(self, text: str) -> Any:
        """The number ``text`` spells, of this range's kind (not checked against the range)."""
        try:
            return self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.words}, got {text!r}") from None

    def convert(self, text: str) -> Any:
        """argparse type: the number ``text`` spells, refused unless it is in the range."""
        value = self.parse(text)
        if not self.holds(value):
            raise argparse.ArgumentTypeError(f"must be {self.short or self.words}, got {text!r}")
        return value


@dataclasses.dataclass(frozen=True)
class StepsOrShare(Range):
    """A length in steps, or a share of the run: 0, a whole number (steps), or a number in (0, 1) (that
    share of ``--train_iters``). A flag's text parses as an integer where it spells one."""

    def holds(self, value: Any) -> bool:
        if not self._of_kind(value):
            return False
        return value == 0 or 0 < value < 1 or (value >= 1 and float(value).is_integer())

    def parse(self, text: str) -> Any:
        try:
            return int(text)
        except ValueError:
            return super().parse(text)


POSITIVE_INT = Range(int, 1, name="a positive integer")
NON_NEGATIVE_INT = Range(int, 0)
POSITIVE_NUMBER = Range(float, 0, low_open=True, name="a positive number")
ABOVE_ZERO = Range(float, 0, low_open=True)  # a float that must be positive (a rate)
RATIO = Range(float, 0, 1, low_open=True, short="in (0, 1]")  # a share
STEPS_OR_SHARE = StepsOrShare(float, 0, name="0, a whole number of steps or a share in (0, 1)")
SEED = Range(int, 0, 2**63 - 1)  # a seed every generator takes, and a record in the database (int64) holds
LEARNING_RATE = Range(float, 0, 1e3, low_open=True)  # above it, the updates overflow the weights
PORT = Range(int, 0, 65535)  # a TCP port; 0: any free one


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    or_zero: bool = False,
    optional: bool = False,
) -> None:
    """``value`` is a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``; no upper
    bound with ``high`` None); ``or_zero``: 0 is accepted too."""
    Range(float, low, high, low_open, or_zero).check(name, value, optional)


def check_ratio(name: str, value: float | None) -> None:
    """A share in (0, 1]."""
    RATIO.check(name, value, optional=True)


def check_choice(name: str, value: str | None, choices: Iterable[str]) -> None:
    choices = list(choices)
    if value is not None and value not in choices:
        raise ConfigError(f"{name} {value!r} is not one of {', '.join(choices)}")


def as_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


def a_path(text: str) -> Path:
    """A path flag's value: an empty one (a script's unset ``$DIR``) is refused, not taken for the working
    directory, where a run would write over files of the user's."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a file or directory ('.' for this one)")
    return Path(text)


# ---------------------------------------------------------------- fields


@dataclasses.dataclass(frozen=True, eq=False)
class OneOf:
    """Options that exclude one another (``--input DIR`` or ``--from_mongo``): the fields given the
    same ``OneOf`` form one group; ``required``: one of them must be given."""

    required: bool = False


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    type: Callable[[str], Any] | None = None,
    check: Range | None = None,
    choices: Iterable[str] | None = None,
    metavar: str | None = None,
    hidden: bool = False,
    flag: str | None = None,
    repeat: bool = False,
    positional: bool = False,
    short: str | None = None,
    one_of: OneOf | None = None,
    serves: tuple[str, str] | None = None,
) -> Any:
    """A dataclass field that is also a command-line option.

    Args:
        default: the default value (the one place it is written); MISSING for a required option.
        help: one line for ``--help``; the default is appended.
        type: argparse type converter (default: ``check``'s, else from the annotation; a plain
            ``int`` or ``float`` leaves the range to the check on construction).
        check: the field's range: refused as the flag is parsed, and checked by :func:`check_fields`
            naming the flag.
        choices: the allowed values (checked by argparse and by :func:`check_fields`).
        metavar: the value's name in ``--help``.
        hidden: not shown in ``--help`` (test hooks).
        flag: the option's name where it differs from the field's (``--flag``, parsed into ``flag``).
        repeat: a tuple field given once per value (``--collection a --collection b``).
        positional: an argument without a flag (``FILE...``: a tuple field takes any number; a field
            with a default may be left out).
        short: a one-letter alias (``-v``).
        one_of: the group of options this one excludes the others of.
        serves: ``(option, value)``: this option only matters when that other option has that value
            (``("optimizer", "muon")``); an experiment file's key for it is dropped, with one line, where
            the other option typed on the command line chooses otherwise.

    A ``bool`` field is a switch (``--name``); a ``bool | None`` field a pair, ``--name`` and
    ``--no_name``, left None when neither is given (the caller's default applies).
    """
    meta = {
        "help": help,
        "type": type,
        "check": check,
        # A registry's choices stay live: entries registered later are accepted too.
        "choices": None if choices is None else choices if isinstance(choices, Collection) else list(choices),
        "metavar": metavar,
        "hidden": hidden,
        "flag": flag,
        "repeat": repeat,
        "positional": positional,
        "short": short,
        "one_of": one_of,
        "serves": serves,
    }
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=default.copy, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def option_as(owner: type, name: str) -> Any:
    """The option ``name`` of the settings class ``owner`` declared again, as a field of a class of
    resolved values named otherwise: the same default, check and flag (declared once, in ``owner``)."""
    declared = owner.__dataclass_fields__[name]  # type: ignore[attr-defined]
    meta = {**declared.metadata, "flag": declared.metadata.get("flag") or name}
    return dataclasses.field(default=declared.default, metadata=meta)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation such as ``int | None``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _is_sequence(kind: Any) -> bool:
    return typing.get_origin(kind) in (list, tuple)


def add_options(
    parser: Any,
    cls: type,
    only: Iterable[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """Add an option per field of the dataclass ``cls`` to ``parser`` (a parser or an argument group;
    ``only``: a subset, in that order).

    ``defaults`` overrides a field's default for this parser (MISSING: required here); ``helps`` its
    help line, where this command reads the same flag in another sense (``dsgpt2 evaluate
    --hellaswag`` scores it instead of the validation split).
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    groups: dict[OneOf, Any] = {}
    for name in only or fields:
        f = fields[name]
        one_of = f.metadata.get("one_of")
        target = parser
        if one_of is not None:
            if one_of not in groups:
                groups[one_of] = parser.add_mutually_exclusive_group(required=one_of.required)
            target = groups[one_of]
        default = (defaults or {}).get(name, _default(f))
        _add_field(target, f, _hints(cls)[name], default, (helps or {}).get(name))


def _add_field(
    parser: Any, f: dataclasses.Field[Any], annotation: Any, default: Any, help: str | None
) -> None:
    meta = f.metadata
    dest = meta.get("flag") or f.name
    kind, optional = _base_type(annotation)
    help_text = meta.get("help", "") if help is None else help
    if meta.get("hidden"):
        help_text = argparse.SUPPRESS
    elif _shown(default) and "default" not in help_text:
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = f"{help_text} (default: {shown})"
    if kind is bool and optional:
        pair = parser.add_mutually_exclusive_group()
        on = pair.add_argument(
            f"--{dest}", dest=dest, action="store_const", const=True, default=default, help=help_text
        )
        no = argparse.SUPPRESS if meta.get("hidden") else f"the opposite of --{dest}"
        off = pair.add_argument(f"--no_{dest}", dest=dest, action="store_const", const=False, help=no)
        if meta.get("serves"):
            on.serves = off.serves = meta["serves"]  # type: ignore[attr-defined]
        return
    kwargs: dict[str, Any] = {"help": help_text}
    if kind is bool:
        kwargs["action"] = "store_true"
    else:
        if _is_sequence(kind) and not meta.get("type"):
            if meta.get("repeat"):
                kwargs["action"] = "append"
            else:
                kwargs["nargs"] = "*"
            kind = typing.get_args(kind)[0]
        check = meta.get("check")
        kwargs["type"] = meta.get("type") or (check.convert if check is not None else kind)
        if kwargs["type"] is Path:
            kwargs["type"] = a_path
        if meta.get("choices"):
            kwargs["choices"] = list(meta["choices"])
        if meta.get("metavar"):
            kwargs["metavar"] = meta["metavar"]
    if meta.get("positional"):
        if default is not MISSING:
            kwargs.setdefault("nargs", "?")
            kwargs["default"] = default
        parser.add_argument(dest, **kwargs)
        return
    if default is MISSING:
        kwargs["required"] = True
    else:
        # An appended option adds to its default: a list of its own, not the field's tuple.
        appended = kwargs.get("action") == "append" and default is not None
        kwargs["default"] = list(default) if appended else default
    names = [meta["short"]] if meta.get("short") else []
    action = parser.add_argument(*names, f"--{dest}", dest=dest, **kwargs)
    if meta.get("serves"):
        action.serves = meta["serves"]  # type: ignore[attr-defined]  # read by the experiment file's reader


def _shown(default: Any) -> bool:
    """Whether ``--help`` states the default: not for "not given" (None, off, empty)."""
    if default is MISSING or default is None or default is False:
        return False
    return not (isinstance(default, list | tuple) and not default)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def from_namespace(cls: type, args: argparse.Namespace, **override: Any) -> Any:
    """An instance of ``cls`` from the parsed ``args`` (fields it has), validated on construction.

    A list parsed for a tuple field (``--collection`` given twice) becomes a tuple; ``override``
    replaces what was parsed.
    """
    values = {}
    for f in dataclasses.fields(cls):
        dest = f.metadata.get("flag") or f.name
        if hasattr(args, dest):
            value = getattr(args, dest)
            if isinstance(value, list) and typing.get_origin(_base_type(_hints(cls)[f.name])[0]) is tuple:
                value = tuple(value)
            values[f.name] = value
    values.update(override)
    return cls(**values)


def check_fields(settings: Any, prefix: str = "--") -> None:
    """Check every field of the dataclass ``settings`` against its ``check`` range and its ``choices``,
    naming it as its flag (``prefix`` and the flag's name; ``prefix=""`` for request settings); None
    passes where the field may be None.

    Raises:
        ConfigError: the first value out of its range, or not one of its choices.
    """
    hints = _hints(type(settings))
    for f in dataclasses.fields(settings):
        meta, value = f.metadata, getattr(settings, f.name)
        name = prefix + (meta.get("flag") or f.name)
        optional = _base_type(hints[f.name])[1]
        if meta.get("check") is not None:
            meta["check"].check(name, value, optional)
        if meta.get("choices") is not None:
            check_choice(name, value, meta["choices"])


class Freezable:
    """Settings that a run resolves once (paths fetched, defaults settled), then freezes: assigning a
    field afterwards raises, so that what the run records is what it uses."""

    def freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        return bool(getattr(self, "_frozen", False))

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"{type(self).__name__}.{name}: the run's configuration is resolved and frozen; build a new "
                "one (parse, or the options' constructors) rather than assign into it"
            )
        super().__setattr__(name, value)


class Checked(Freezable):
    """The base of a settings dataclass: on construction its fields are converted to their types
    (:meth:`convert`: a path given as a string), each checked against its ``check`` range and its
    ``choices`` (:func:`check_fields`, naming the flag), then by the class's own :meth:`check` where its
    fields must agree with one another."""

    # How a message names a field: ``--`` and its flag (a config file's settings: its key as written).
    flag_prefix: ClassVar[str] = "--"

    def __post_init__(self) -> None:
        self.convert()
        check_fields(self, self.flag_prefix)
        self.check()

    def convert(self) -> None:
        """Turn the fields given in another type into their own (none here)."""

    def check(self) -> None:
        """Checks across fields, after each field's own (none here).

        Raises:
            ConfigError: naming the flags and the fix.
        """


# ---------------------------------------------------------------- reading a parser back


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name (none: an empty dict)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_names(parser: argparse.ArgumentParser) -> set[str]:
    """Every subcommand name below ``parser``, nested ones included."""
    names: set[str] = set()
    for name, sub in subcommands(parser).items():
        names |= {name} | command_names(sub)
    return names


def settable_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions of ``parser`` that take a setting: not ``--help``, ``--version`` or subcommands."""
    return [
        a
        for a in parser._actions
        if a.dest not in (argparse.SUPPRESS, "help", "version")
        and not isinstance(a, argparse._SubParsersAction)
    ]


def flag_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string ``parser`` accepts, the unlisted spellings included."""
    return set(parser._option_string_actions)


def action_of(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    """The action that ``flag`` (any spelling ``parser`` accepts) sets; None for no flag of it."""
    return parser._option_string_actions.get(flag)


def make_optional(parser: argparse.ArgumentParser) -> None:
    """Nothing required of ``parser`` any more: no flag, no group of exclusive flags (a test's parser
    that should report only the mistake it is given)."""
    for action in parser._actions:
        action.required = False
    for group in parser._mutually_exclusive_groups:
        group.required = False


def is_switch(action: argparse.Action) -> bool:
    """An option that takes no value (``--json``, ``--no_doc_mask``): it sets its constant."""
    return isinstance(action, argparse._StoreConstAction)


def takes_many(action: argparse.Action) -> bool:
    """An option or argument that takes a list (``nargs`` * or +, or repeated)."""
    return action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction)


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags and positional arguments of ``parser`` in the order added, ``--help`` and hidden ones
    included; not its subcommands (:func:`subcommands` reads those)."""
    return [a for a in parser._actions if not isinstance(a, argparse._SubParsersAction)]


def action_groups(parser: argparse.ArgumentParser) -> list[tuple[str | None, list[argparse.Action]]]:
    """``(title, actions)`` of each argument group of ``parser``, as ``--help`` lists them (a mutually
    exclusive group's options in the group that holds it; not the subcommands)."""
    return [
        (group.title, [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)])
        for group in parser._action_groups
    ]


def listed_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``parser`` as ``--help`` lists them, in order: not the hyphenated spellings
    that are accepted unlisted (:func:`flag_strings` has every one)."""
    return [flag for action in actions(parser) for flag in action.option_strings]


@dataclasses.dataclass(frozen=True)
class ActionHelp:
    """What ``--help`` tells of one flag or positional argument, for a reference table.

    Attributes:
        flags: the option strings as listed (``-v``, ``--verbose``); empty for a positional argument.
        value: the value as a usage line spells it (``FORMAT``, ``[FILE ...]``): the metavar, else the
            destination in capitals, choices left to ``choices``; empty for a switch.
        help: the help text with ``%(default)s`` and the like filled in; empty where there is none.
        hidden: not shown by ``--help``.
        default: the default; None where there is none.
        choices: the values allowed; None: any.
        required: must be given.
    """

    flags: tuple[str, ...]
    value: str
    help: str
    hidden: bool
    default: Any
    choices: tuple[Any, ...] | None
    required: bool


def describe(parser: argparse.ArgumentParser, action: argparse.Action) -> ActionHelp:
    """What ``parser``'s ``--help`` tells of ``action`` (one of :func:`actions`)."""
    hidden = action.help is argparse.SUPPRESS
    # The value without its choices: they are told apart, not as ``{a,b}``.
    plain = copy.copy(action)
    plain.choices = None
    value = argparse.HelpFormatter(parser.prog)._format_args(plain, action.dest.upper())
    return ActionHelp(
        flags=tuple(action.option_strings),
        value=value,
        help=parser._get_formatter()._expand_help(action) if action.help and not hidden else "",
        hidden=hidden,
        default=None if action.default is argparse.SUPPRESS else action.default,
        choices=None if action.choices is None else tuple(action.choices),
        required=bool(action.required),
    )
