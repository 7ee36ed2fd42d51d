"""Checks that a Markdown page's commands stay true (every `dsgpt2`/`ds_trainer.py` line parses, every
script exists and every variable set for a script is one its header documents) and that the paths it
names exist: the README's (tests/project/test_readme.py) and the docs pages' (tests/project/test_docs.py)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from conftest import ROOT

README = ROOT / "README.md"


def blocks(page: Path = README) -> list[str]:
    """The commands of a page's fenced bash blocks, continuations joined, comments dropped."""
    text = page.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [c for c in out if c and not c.startswith("#")]


def inline(page: Path = README) -> list[str]:
    """Commands quoted inline in a page's prose (`dsgpt2 ... --flag`, `VAR=... bash pipelines/...`)."""
    prose = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    found = re.findall(r"`((?:[A-Z_]+=\S* )*(?:dsgpt2 |bash pipelines/)[^`]*)`", prose.replace("\n", " "))
    return [c for c in found if "--" in c or "pipelines/" in c]


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """A command line as its leading ``VAR=value`` settings and its words (after the last pipe)."""
    words = shlex.split(command.split("| ")[-1])
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def subparser(words: list[str]) -> argparse.ArgumentParser:
    """The argparse parser of a dsgpt2 (sub)command, following subcommand names."""
    from dsgpt2.cli.main import build_parser
    from dsgpt2.settings.options import subcommands

    parser = build_parser()
    for word in words:
        subs = subcommands(parser)
        if word not in subs:
            break
        parser = subs[word]
    return parser


def is_train(words: list[str]) -> bool:
    """`dsgpt2 train ...`, `deepspeed ... --module dsgpt2 train ...` or `dsgpt2 launch ...` (the
    launcher's flags, then ds_trainer.py's or the module's)."""
    module = words[words.index("--module") + 1 :] if "--module" in words else []
    return words[:2] in (["dsgpt2", "train"], ["dsgpt2", "launch"]) or module[:2] == ["dsgpt2", "train"]


def dsgpt2_commands(page: Path = README) -> list[str]:
    """The `dsgpt2 ...` lines of a page's bash blocks, the trainer's aside."""
    return [c for c in blocks(page) if split(c)[1][:1] == ["dsgpt2"] and not is_train(split(c)[1])]


def trainer_commands(page: Path = README) -> list[str]:
    """`python ds_trainer.py`, `deepspeed ds_trainer.py`, `dsgpt2 train` and `dsgpt2 launch` lines."""
    return [c for c in blocks(page) if "ds_trainer.py" in split(c)[1][:6] or is_train(split(c)[1])]


def pipeline_commands(page: Path = README) -> list[str]:
    return [c for c in blocks(page) + inline(page) if "bash pipelines/" in c]


def named_paths(page: Path = README) -> set[str]:
    """The repository paths a page names in backticks (`configs/...`, `tests/...`, ...)."""
    text = page.read_text(encoding="utf-8")
    return set(re.findall(r"`((?:dsgpt2|configs|tests|pipelines)/[A-Za-z0-9_./-]+)`", text))


def check_dsgpt2_command(command: str) -> None:
    """The command parses with the real parser (an experiment file applied)."""
    from dsgpt2.cli.main import build_parser
    from dsgpt2.settings.runfile import parse_args

    words = split(command)[1][1:]
    try:
        parse_args(build_parser(), words)
    except SystemExit as exc:  # --help exits 0; anything else is a broken command
        assert exc.code == 0, words


def check_inline_options(command: str) -> None:
    """Every --flag of an inline `dsgpt2 ...` quote is a flag of that (sub)command."""
    from dsgpt2.settings.options import flag_strings

    words = split(command)[1][1:]
    accepted = flag_strings(subparser(words))
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in accepted, (flag, command)


def check_trainer_command(command: str, tmp_path: Path) -> None:
    """ds_trainer.py, dsgpt2 train and deepspeed --module dsgpt2 train lines parse, experiment files
    applied (a file the page asks the user to supply is written in the layout it names)."""
    from dsgpt2.cli.main import SECTIONS
    from dsgpt2.settings.runfile import parse_args
    from dsgpt2.train.config import TRAIN_ALIASES, trainer_parser

    words = split(command)[1]
    supplied = tmp_path / "hellaswag_val.jsonl"
    supplied.write_text(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}) + "\n")
    words = [str(supplied) if w == supplied.name else w for w in words]
    start = words.index("ds_trainer.py") + 1 if "ds_trainer.py" in words else words.index("train") + 1
    try:
        parse_args(
            trainer_parser(), words[start:], command=["train"], sections=SECTIONS, aliases=TRAIN_ALIASES
        )
    except SystemExit as exc:
        assert exc.code == 0, words


def documented(script: Path) -> set[str]:
    """The settings a pipeline script's header documents."""
    header = script.read_text(encoding="utf-8").split("set -euo pipefail")[0]
    return set(re.findall(r"^#\s+([A-Z_]+)\s", header, flags=re.M))


def check_pipeline_command(command: str) -> None:
    """The script exists and every variable set for it is one its header documents."""
    env, words = split(command)
    script = ROOT / words[words.index("bash") + 1]
    assert script.is_file(), script
    assert set(env) <= documented(script), (set(env) - documented(script), script.name)


def missing_paths(page: Path = README) -> list[str]:
    return sorted(p for p in named_paths(page) if not (ROOT / p).exists())
