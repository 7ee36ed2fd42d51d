"""Argument parsing shared by the ``dsgpt2`` command and ``ds_trainer.py``."""

from __future__ import annotations

import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look) and exit code 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # No silent abbreviations: `--vocab` must not quietly mean `--vocab_dir`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def accept_hyphen_spellings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept ``--vocab-size`` for ``--vocab_size`` (and so on) in ``parser`` and its subcommands.

    Options are spelled with underscores, the original toolkit's way; the hyphenated spellings that
    earlier versions used keep working, unlisted in ``--help``.
    """
    for action in parser._actions:
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag:
                parser._option_string_actions.setdefault(flag.replace("_", "-"), action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                accept_hyphen_spellings(sub)
    return parser


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def part_of(text: str) -> tuple[int, int]:
    """``R/M``: the R-th (from 1) of M parts."""
    r, sep, m = text.partition("/")
    try:
        part, parts = int(r), int(m)
    except ValueError:
        sep = ""
    if not sep or not 1 <= part <= parts:
        raise argparse.ArgumentTypeError(f"expected R/M with 1 <= R <= M (e.g. 2/4), got {text!r}")
    return part, parts


def unit_fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {value}")
    return value


def ratio(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1], got {value}")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """``"user,bot"`` → ``("user", "bot")``; blanks dropped."""
    return tuple(s.strip() for s in text.split(",") if s.strip())
