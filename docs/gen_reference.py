"""The reference pages, written from the parsers and the key table themselves, so they cannot drift.

The pages are stored beside the other docs (``docs/reference/``), so that their links work where the docs
are read in the repository too; ``make reference`` (``python docs/gen_reference.py docs``) writes them
afresh, and a test fails where a stored page differs from what the code makes now. MkDocs also runs this
file as a hook (``hooks:`` in mkdocs.yml): ``on_files`` builds the site from pages made at build time.

- ``reference/commands.md``: every ``dsgpt2`` command, nested ones included (``vocab train``,
  ``db status``), from :func:`dsgpt2.cli.main.build_parser`;
- ``reference/trainer.md``: ``ds_trainer.py`` / ``dsgpt2 train``, from
  :func:`dsgpt2.train.config.trainer_parser`;
- ``reference/connection-config.md``: the connection config's keys, from the key table of
  :mod:`dsgpt2.db.config` and the defaults of :class:`~dsgpt2.db.config.MongoConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dsgpt2.settings import options
from dsgpt2.settings.options import ActionHelp

GENERATED = (
    "This page is generated from the code by `docs/gen_reference.py` (`make reference`); a test checks "
    "that it matches the code, so it always matches the version beside it."
)
# argparse wraps usage lines to the terminal's width: the pages are written at one width, wherever made.
WIDTH = "100"


def command_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``("dsgpt2 vocab train", parser)`` for the root command and every subcommand, depth first, in the
    order ``dsgpt2 --help`` lists them."""
    from dsgpt2.cli.main import build_parser

    yield from _walk("dsgpt2", build_parser())


def _walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    seen: set[int] = set()
    for sub_name, sub in options.subcommands(parser).items():
        if id(sub) not in seen:  # an alias names a parser already listed
            seen.add(id(sub))
            yield from _walk(f"{name} {sub_name}", sub)


def trainer_parser() -> argparse.ArgumentParser:
    """``ds_trainer.py``'s parser (it adds DeepSpeed's own flags, so DeepSpeed is imported)."""
    from dsgpt2.train import config

    return config.trainer_parser()


def flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` as its actions spell them (the hyphenated spellings that
    :func:`~dsgpt2.settings.argtypes.accept_hyphen_spellings` also accepts are not listed)."""
    return options.listed_flags(parser)


def _escape(text: str) -> str:
    """Help text as Markdown inside a table cell: code spans kept (their backticks balanced), the rest
    escaped so that argparse's prose cannot turn into emphasis, links, HTML or cell borders."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unbalanced backtick: no code spans at all
        parts = [text.replace("`", "'")]
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"`{part}`" if part.strip() else "` `")
        else:
            part = html.escape(part, quote=False)
            out.append(re.sub(r"([\\*_\[\]|])", r"\\\1", part))
    return " ".join("".join(out).split())


def _code(value: object) -> str:
    """A value as inline code (backticks doubled where the value holds one)."""
    text = " ".join(str(value).split())
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _default(shown: ActionHelp) -> str:
    value = shown.default
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value) if value else "(none)"
    return _code(value)


def _help(shown: ActionHelp) -> str:
    text = "(not listed by `--help`)" if shown.hidden else _escape(shown.help)
    if shown.choices is not None:
        text += f"{' ' if text else ''}Choices: {', '.join(_code(c) for c in shown.choices)}."
    if shown.required and shown.flags:
        text += f"{' ' if text else ''}Required."
    return text


def _name(shown: ActionHelp) -> str:
    """The flag as typed (``--format FORMAT``, ``-v, --verbose``) or a positional's name (``FILE ...``);
    choices are listed beside the help, not here."""
    if not shown.flags:
        return _code(shown.value)
    value = f" {shown.value}" if shown.value else ""
    return ", ".join(_code(flag + value) for flag in shown.flags)


def _table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    """A flag table of ``actions`` (of :func:`dsgpt2.settings.options.actions`), as ``parser``'s
    ``--help`` tells them."""
    rows = []
    for action in actions:
        shown = options.describe(parser, action)
        rows.append(f"| {_name(shown)} | {_default(shown)} | {_help(shown)} |")
    return ["| flag | default | what it does |", "|---|---|---|", *rows, ""] if rows else []


def _text_block(text: str) -> list[str]:
    return ["```text", *text.rstrip().splitlines(), "```", ""]


def _description(parser: argparse.ArgumentParser) -> list[str]:
    """The parser's description: prose as paragraphs; where the parser keeps its layout (examples, a
    JSON sample), the indented paragraphs as text blocks."""
    if not parser.description:
        return []
    if not issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return [_escape(parser.description), ""]
    out: list[str] = []
    for paragraph in re.split(r"\n\s*\n", parser.description.strip("\n")):
        if any(line[:1].isspace() for line in paragraph.splitlines()):
            out += _text_block(paragraph)
        else:
            out += [_escape(paragraph), ""]
    return out


def commands_page() -> str:
    """Every ``dsgpt2`` command: usage, description, each flag with its default, choices and help."""
    from dsgpt2.train.launch import USAGE

    lines = [
        "# dsgpt2 commands",
        "",
        GENERATED,
        "",
        "Each command's flags as `dsgpt2 COMMAND --help` prints them, with their defaults and choices. "
        "Flags are spelled with underscores (`--vocab_size`); the hyphenated spelling (`--vocab-size`) "
        "is accepted too. A `.yaml` or `.toml` file given as `--config` is an experiment file whose "
        "keys are these flags without their dashes "
        "([Experiment files](../training/index.md#experiment-files)).",
        "",
    ]
    for name, parser in command_parsers():
        lines += [f"## {name}", ""]
        if name == "dsgpt2 train":
            lines += [
                "The trainer, the same as `ds_trainer.py`: its flags are on "
                "[the trainer's page](trainer.md).",
                "",
            ]
            continue
        if name == "dsgpt2 launch":
            lines += ["The `deepspeed` launcher's flags, then the script's:", "", *_text_block(USAGE)]
            continue
        lines += _text_block(parser.format_usage())
        lines += _description(parser)
        lines += _table(parser, options.actions(parser))
        if parser.epilog:
            lines += _text_block(parser.epilog)
    return "\n".join(lines)


def trainer_page() -> str:
    """``ds_trainer.py``'s flags by group, as ``ds_trainer.py --help`` prints them."""
    parser = trainer_parser()
    lines = [
        "# Trainer flags: ds_trainer.py and dsgpt2 train",
        "",
        GENERATED,
        "",
        "`python ds_trainer.py`, `deepspeed ds_trainer.py`, `dsgpt2 train` and "
        "`deepspeed --module dsgpt2 train` take these flags. Every one of them is a field of a dataclass "
        "in `dsgpt2/train/config.py`; in an experiment file (`--config run.yaml`) each is a key spelled "
        "without its dashes, and `config` names the connection config (`--config_train`).",
        "",
        *_description(parser),
    ]
    for title, group in options.action_groups(parser):
        actions = [a for a in group if a.option_strings or a.help is not argparse.SUPPRESS]
        if actions:
            title = title or "options"
            lines += [f"## {title[:1].upper()}{title[1:]}", "", *_table(parser, actions)]
    return "\n".join(lines)


def config_keys() -> list[tuple[str, str, str, str]]:
    """``(key, JSON type, default, description)`` for every key the connection config takes."""
    from dsgpt2.db import config as db_config

    defaults = {f.name: f.default for f in dataclasses.fields(db_config.MongoConfig)}
    out = []
    for key, (name, types, description) in db_config._KEYS.items():
        json_type = " or ".join(_JSON_TYPES.get(t, t.__name__) for t in types)
        default = defaults.get(name, dataclasses.MISSING)
        if key in db_config._REQUIRED:
            shown = "required"
        elif key == db_config.ENV_URI:
            shown = f"required, in the file or the environment variable `{db_config.ENV_URI}`"
        elif default is dataclasses.MISSING or default in ("", ()):
            shown = "(none)"
        else:
            shown = _code(_json(default))
        out.append((key, json_type, shown, description))
    return out


_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean",
                                list: "array", dict: "object"}  # fmt: skip


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def config_page() -> str:
    """The connection config's keys from the key table, with types, defaults and descriptions."""
    from dsgpt2.db.config import READ_PREFERENCES, SCHEMES

    lines = [
        "# Connection config keys",
        "",
        GENERATED,
        "",
        "A connection config is a JSON object (`--config c.json`, `--config_train c.json`, or the `config` "
        "key of an experiment file). An unknown key or a value of the wrong type ends the command with "
        "one line that lists the valid keys. The guide to these keys is "
        "[Storage and connection](../corpus/index.md).",
        "",
        "| key | type | default | what it is |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| `{key}` | {kind} | {default} | {_escape(text)} |" for key, kind, default, text in config_keys()
    ]
    lines += [
        "",
        f"`MONGO_CONNECTION_STRING` starts with one of {', '.join(_code(s) for s in SCHEMES)}. "
        f"`READ_PREFERENCE` is one of {', '.join(_code(p) for p in READ_PREFERENCES)}.",
        "",
    ]
    return "\n".join(lines)


PAGES: dict[str, Callable[[], str]] = {
    "reference/commands.md": commands_page,
    "reference/trainer.md": trainer_page,
    "reference/connection-config.md": config_page,
}


def page(path: str) -> str:
    """The text of the reference page ``path`` (a key of :data:`PAGES`), as stored."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return PAGES[path]() + "\n"
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def on_files(files: Any, config: Any) -> Any:
    """MkDocs hook: the reference pages made now in place of the stored ones."""
    from mkdocs.structure.files import File

    for path in PAGES:
        stored = files.get_file_from_path(path)
        if stored is not None:
            files.remove(stored)
        files.append(File.generated(config, path, content=page(path)))
    return files


def main(argv: list[str]) -> int:
    """``python docs/gen_reference.py DIR``: write the pages into DIR."""
    if len(argv) != 1:
        sys.stderr.write("usage: python docs/gen_reference.py DIR\n")
        return 2
    for path in PAGES:
        target = Path(argv[0]) / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(page(path), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
