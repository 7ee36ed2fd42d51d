"""Argument parsing shared by the ``dsgpt2`` command and ``ds_trainer.py``: the parser, the hyphenated
spellings, and the argparse type converters (the numeric ones built from the ranges of
:mod:`dsgpt2.settings.options`, so that a range is written once)."""

from __future__ import annotations

import argparse

from dsgpt2.settings.options import NON_NEGATIVE_INT, POSITIVE_INT, POSITIVE_NUMBER, RATIO, subcommands


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (what is wrong, where to look) and exit code 2."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        # No silent abbreviations: `--vocab` must not quietly mean `--vocab_dir`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


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
