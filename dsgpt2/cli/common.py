"""What the command modules share: the fields of the flags most commands have (``--config JSON``,
``-v``, ``--no_progress``), one-line usage errors, output checks."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.errors import DsGpt2Error
from dsgpt2.settings.options import MISSING, add_options, option

CONFIG_HELP = "connection config (MONGO_CONNECTION_STRING, MONGO_CONNECTION_DB, COLLECTIONS, ...)"


def config_option(help: str = CONFIG_HELP, required: bool = True) -> Any:
    """The ``--config JSON`` field of a settings dataclass: the connection config (an experiment file
    given as ``--config`` is read before parsing, :mod:`dsgpt2.settings.runfile`)."""
    return option(MISSING if required else None, help, metavar="JSON")


def verbose_option() -> Any:
    """The ``-v``/``--verbose`` field: debug logging (dsgpt2.cli.main sets it up)."""
    return option(False, "log debug details", short="-v")


def no_progress_option(help: str = "no progress bar") -> Any:
    """The ``--no_progress`` field: no progress bar or progress lines."""
    return option(False, help)


@dataclass(frozen=True)
class Flags:
    """A settings class's fields as flags of a command: all of them, or ``only`` these (in that order),
    in an argument ``group`` when it has a title, with this command's ``defaults`` and ``helps`` where
    it reads a field in its own sense (see :func:`dsgpt2.settings.options.add_options`)."""

    settings: type
    only: Sequence[str] | None = None
    group: str | None = None
    defaults: Mapping[str, Any] | None = None
    helps: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Command:
    """One ``dsgpt2`` command, declared once: the parser, the experiment file's tables, the reference
    pages and ``dsgpt2 --help`` are all made from the table of them (:data:`dsgpt2.cli.main.COMMANDS`).

    Attributes:
        name: the word typed after ``dsgpt2``.
        help: its line in ``dsgpt2 --help``.
        settings: its flags, in order: settings classes, :class:`Flags` for a part of one, or a function
            that makes a class when the parser is built (flags that a registry's entries add).
        handler: what runs it, given the parsed arguments; returns the exit code.
        description: its ``--help`` text (default: ``help``).
        epilog: examples under its ``--help`` (kept as written, line by line).
        steps: the commands under it (``vocab download``); it then runs none of its own.
        own_parser: a command whose arguments all go to a parser of its own (``train``, ``launch``):
            given them, it runs and returns the exit code.
        run_file: whether an experiment file may hold a table of its flags.
    """

    name: str
    help: str
    settings: tuple[type | Flags | Callable[[], type], ...] = ()
    handler: Callable[[argparse.Namespace], int] | None = None
    description: str | None = None
    epilog: str | None = None
    steps: tuple[Command, ...] = ()
    own_parser: Callable[[list[str]], int] | None = None
    run_file: bool = True

    def add_to(self, sub: Any) -> None:
        """This command's parser among the subparsers ``sub``."""
        extra: dict[str, Any] = {}
        if self.epilog:
            extra = {"epilog": self.epilog, "formatter_class": argparse.RawDescriptionHelpFormatter}
        p = sub.add_parser(self.name, help=self.help, add_help=self.own_parser is None,
                           description=self.description, **extra)  # fmt: skip
        if self.own_parser is not None:
            return
        for item in self.settings:
            if not isinstance(item, type | Flags):
                item = item()  # a class made when the parser is built (from a registry)
            f = item if isinstance(item, Flags) else Flags(item)
            target = p.add_argument_group(f.group) if f.group else p
            add_options(target, f.settings, only=f.only, defaults=f.defaults, helps=f.helps)
        if self.steps:
            steps = p.add_subparsers(dest=f"{self.name}_command", metavar="STEP", required=True)
            for step in self.steps:
                step.add_to(steps)
        else:
            p.set_defaults(func=self.handler)


def section_names(commands: Sequence[Command]) -> frozenset[str]:
    """Every name an experiment file's table may have: the commands and their steps."""
    return frozenset(n for c in commands if c.run_file for n in (c.name, *section_names(c.steps)))


def load_connection(path: Any) -> Any:
    """The connection config at ``path`` (the ``--config`` of a command)."""
    from dsgpt2.db.config import load_config

    return load_config(path)


def collection_names(given: Sequence[str] | None, config: Any, command: str) -> list[str]:
    """--collection (repeatable), else the config's COLLECTIONS; a bad name is a usage error."""
    from dsgpt2.db.config import collection_name_problem

    names = list(given or config.collections)
    for name in names:
        problem = collection_name_problem(name) or config.records_problem(name)
        if problem:
            raise usage(command, f"--collection {name!r} is not a collection name: {problem}")
    return names


def usage(command: str, message: str) -> DsGpt2Error:
    from dsgpt2.errors import usage_error

    return usage_error(command, message)


def check_writable(path: Path, flag: str, inputs: Mapping[str, Any] | None = None) -> None:
    """Fail before the work when its output cannot be written, its disk is full, or it is one of the
    command's ``inputs`` (by flag: a file, or a directory it would land in). Nothing is made there: the
    writer makes the file whole or not at all (:func:`dsgpt2.files.output_writer`)."""
    from dsgpt2.errors import ConfigError
    from dsgpt2.files import check_room, unwritable_dir

    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name such as {path / 'report.json'}")
    for name, given in (inputs or {}).items():
        where = None if given is None else Path(given)
        if where is None or not path.exists() or not where.exists():
            continue
        if os.path.samefile(path, where):
            raise ConfigError(f"{flag} {path} is the file given as {name}: writing it would replace that; "
                              "name another file")  # fmt: skip
        if where.is_dir() and path.resolve().is_relative_to(where.resolve()):
            raise ConfigError(f"{flag} {path} is a file of {name} {where}: writing it would replace that; "
                              "name a file elsewhere")  # fmt: skip
    problem = unwritable_dir(path.parent)
    if problem is not None:
        raise ConfigError(f"{flag} {path}: {problem}; name a file where one can be written")
    check_room(path, flag)
