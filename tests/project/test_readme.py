"""The README's commands stay true: every `dsgpt2`/`ds_trainer.py` line parses, every script exists and
every variable set for a script is one its header documents."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"


def _blocks() -> list[str]:
    """The commands of the README's fenced bash blocks, continuations joined, comments dropped."""
    text = README.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [line.split(" #")[0].strip() for line in joined.splitlines()]
    return [c for c in out if c and not c.startswith("#")]


def _inline() -> list[str]:
    """Commands quoted inline in the prose (`dsgpt2 ... --flag`, `VAR=... bash pipelines/...`)."""
    prose = re.sub(r"```.*?```", "", README.read_text(encoding="utf-8"), flags=re.S)
    found = re.findall(r"`((?:[A-Z_]+=\S* )*(?:dsgpt2 |bash pipelines/)[^`]*)`", prose.replace("\n", " "))
    return [c for c in found if "--" in c or "pipelines/" in c]


def _split(command: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command.split("| ")[-1])
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _parse(parser: object, words: list[str]) -> None:
    try:
        parser.parse_args(words)  # type: ignore[attr-defined]
    except SystemExit as exc:  # --help exits 0; anything else is a broken command
        assert exc.code == 0, words


def _subparser(words: list[str]) -> object:
    """The argparse parser of a dsgpt2 (sub)command, following subcommand names."""
    import argparse

    from dsgpt2.cli.main import build_parser

    parser = build_parser()
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


def test_readme_has_commands() -> None:
    assert sum(c.startswith("dsgpt2 ") for c in _blocks()) >= 15
    assert any("pipelines/all.sh" in c for c in _blocks())


def _is_train(words: list[str]) -> bool:
    """`dsgpt2 train ...`, `deepspeed ... --module dsgpt2 train ...` or `dsgpt2 launch ...` (the
    launcher's flags, then ds_trainer.py's or the module's)."""
    module = words[words.index("--module") + 1 :] if "--module" in words else []
    return words[:2] in (["dsgpt2", "train"], ["dsgpt2", "launch"]) or module[:2] == ["dsgpt2", "train"]


@pytest.mark.parametrize(
    "command", [c for c in _blocks() if _split(c)[1][:1] == ["dsgpt2"] and not _is_train(_split(c)[1])]
)
def test_dsgpt2_commands_parse(command: str) -> None:
    from dsgpt2.cli.main import build_parser
    from dsgpt2.settings.runfile import parse_args

    words = _split(command)[1][1:]
    try:
        parse_args(build_parser(), words)
    except SystemExit as exc:
        assert exc.code == 0, words


@pytest.mark.parametrize("command", [c for c in _inline() if c.startswith("dsgpt2 ")])
def test_inline_dsgpt2_commands_name_real_options(command: str) -> None:
    words = _split(command)[1][1:]
    parser = _subparser(words)
    for flag in (w.split("=")[0] for w in words if w.startswith("--")):
        assert flag in parser._option_string_actions, (flag, command)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "command", [c for c in _blocks() if "ds_trainer.py" in _split(c)[1][:6] or _is_train(_split(c)[1])]
)
def test_trainer_commands_parse(command: str, tmp_path: Path) -> None:
    """ds_trainer.py, dsgpt2 train and deepspeed --module dsgpt2 train lines, experiment files applied
    (a file the README asks the user to supply is written in the layout it names)."""
    from dsgpt2.settings.runfile import COMMANDS, parse_args
    from dsgpt2.train.config import TRAIN_ALIASES, build_parser

    words = _split(command)[1]
    supplied = tmp_path / "hellaswag_val.jsonl"
    supplied.write_text(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}) + "\n")
    words = [str(supplied) if w == supplied.name else w for w in words]
    start = words.index("ds_trainer.py") + 1 if "ds_trainer.py" in words else words.index("train") + 1
    try:
        parse_args(build_parser(), words[start:], command=["train"], sections=COMMANDS, aliases=TRAIN_ALIASES)
    except SystemExit as exc:
        assert exc.code == 0, words


def _documented(script: Path) -> set[str]:
    header = script.read_text(encoding="utf-8").split("set -euo pipefail")[0]
    return set(re.findall(r"^#\s+([A-Z_]+)\s", header, flags=re.M))


@pytest.mark.parametrize("command", [c for c in _blocks() + _inline() if "bash pipelines/" in c])
def test_pipeline_commands_use_documented_settings(command: str) -> None:
    env, words = _split(command)
    script = ROOT / words[words.index("bash") + 1]
    assert script.is_file(), script
    assert set(env) <= _documented(script), (set(env) - _documented(script), script.name)


def test_files_the_readme_names_in_the_repository_exist() -> None:
    named = set(re.findall(r"`((?:dsgpt2|configs|tests|pipelines)/[A-Za-z0-9_./-]+)`", README.read_text()))
    assert named and not [p for p in named if not (ROOT / p).exists()]
