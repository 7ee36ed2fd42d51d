"""Argument parsing shared by the ``dsgpt2`` command and ``ds_trainer.py``: the parser, the hyphenated
spellings, and the argparse type converters (the numeric ones built from the ranges of
:mod:`dsgpt2.settings.options`, so that a range is written once)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any

from dsgpt2.settings.options import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    RATIO,
    flag_strings,
    subcommands,
)

UNRECOGNIZED = "unrecognized arguments: "


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look) and exit code 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # No silent abbreviations: `--vocab` must not quietly mean `--vocab_dir`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        # Kept for error(): a flag the command does not have is looked up among the flags of the
        # subcommand these arguments reach.
        self._argv = list(sys.argv[1:] if args is None else args)
        if self._intermixed() and not getattr(self, "_intermixing", False):
            # `db status --json local://DIR`: positionals after an option are still the command's
            # (argparse otherwise takes a command's positionals only in one run). Before 3.13 the
            # intermixed parse calls back here: the flag keeps that call plain.
            self._intermixing = True
            try:
                return super().parse_known_intermixed_args(args, namespace)
            finally:
                self._intermixing = False
        return super().parse_known_args(args, namespace)

    def _intermixed(self) -> bool:
        """More than one positional and none that takes the rest (a subcommand, a remainder)."""
        positionals = [a for a in self._actions if not a.option_strings]
        whole = (argparse.PARSER, argparse.REMAINDER)
        return len(positionals) > 1 and not any(a.nargs in whole for a in positionals)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint, help_of = self._did_you_mean(message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see `{help_of.prog} --help`)\n")

    def _did_you_mean(self, message: str) -> tuple[str, argparse.ArgumentParser]:
        """``; did you mean --train_iters?`` for a misspelt flag or command (else ``""``), and the
        (sub)command whose help lists the right ones."""
        target: argparse.ArgumentParser = self
        for token in getattr(self, "_argv", []):  # the (sub)command the arguments reach
            subs = subcommands(target)
            if not token.startswith("-") and token in subs:
                target = subs[token]
        if message.startswith(UNRECOGNIZED):
            flags = [f for f in flag_strings(target) if f.startswith("--")]
            for token in message[len(UNRECOGNIZED) :].split():
                name = token.split("=", 1)[0]
                if name.startswith("--") and name not in flags:
                    close = difflib.get_close_matches(name, [f for f in flags if "-" not in f[2:]], n=1)
                    if close:
                        return f"; did you mean {close[0]}?", target
            return "", target
        choice = re.match(r"argument \S+: invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            close = difflib.get_close_matches(choice[1], re.findall(r"'([^']*)'", choice[2]), n=1)
            if close:
                return f"; did you mean {close[0]!r}?", self
        return "", self


def accept_hyphen_spellings(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Accept ``--vocab-size`` for ``--vocab_size`` (and so on) in ``parser`` and its subcommands, and
    ``--no-doc_mask`` for ``--no_doc_mask``.

    Options are spelled with underscores, the original toolkit's way; the hyphenated spellings that
    earlier versions used keep working, unlisted in ``--help``.
    """
    for action in parser._actions:
        for flag in list(action.option_strings):
            if flag.startswith("--") and "_" in flag:
                parser._option_string_actions.setdefault(flag.replace("_", "-"), action)
            if flag.startswith("--no_"):
                parser._option_string_actions.setdefault("--no-" + flag[len("--no_") :], action)
    for sub in set(subcommands(parser).values()):
        accept_hyphen_spellings(sub)
    return parser


def positive_int(text: str) -> int:
    """An integer of at least 1, refused as it is parsed."""
    return POSITIVE_INT.convert(text)


def non_negative_int(text: str) -> int:
    """An integer of at least 0, refused as it is parsed."""
    return NON_NEGATIVE_INT.convert(text)


def positive_float(text: str) -> float:
    """A finite number above zero, refused as it is parsed."""
    return POSITIVE_NUMBER.convert(text)


def ratio(text: str) -> float:
    """A share in (0, 1], refused as it is parsed."""
    return RATIO.convert(text)


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


def comma_list(text: str) -> tuple[str, ...]:
    """``"user,bot"`` → ``("user", "bot")``; blanks dropped."""
    return tuple(s.strip() for s in text.split(",") if s.strip())
