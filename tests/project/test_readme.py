"""The README's commands stay true: every `dsgpt2`/`ds_trainer.py` line parses, every script exists and
every variable set for a script is one its header documents (the checks are in tests/doc_checks.py, which
tests/project/test_docs.py runs on the pages of docs/ too)."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_checks import (
    README,
    blocks,
    check_dsgpt2_command,
    check_inline_options,
    check_pipeline_command,
    check_trainer_command,
    dsgpt2_commands,
    inline,
    missing_paths,
    named_paths,
    pipeline_commands,
    split,
    trainer_commands,
)


def test_readme_has_the_tour_and_the_two_commands() -> None:
    """The front door: `make demo`, `make test` (CI runs it as the README says) and a tour through every
    stage, each a command that parses (below)."""
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    stages = [split(c)[1][1] for c in blocks() if split(c)[1][:1] == ["dsgpt2"]]
    for stage in ("ingest", "vocab", "train", "evaluate", "export", "generate"):
        assert stage in stages, stage


@pytest.mark.parametrize("command", dsgpt2_commands())
def test_dsgpt2_commands_parse(command: str) -> None:
    check_dsgpt2_command(command)


@pytest.mark.parametrize("command", [c for c in inline() if c.startswith("dsgpt2 ")])
def test_inline_dsgpt2_commands_name_real_options(command: str) -> None:
    check_inline_options(command)


@pytest.mark.parametrize("command", trainer_commands())
def test_trainer_commands_parse(command: str, tmp_path: Path) -> None:
    check_trainer_command(command, tmp_path)


@pytest.mark.parametrize("command", pipeline_commands())
def test_pipeline_commands_use_documented_settings(command: str) -> None:
    check_pipeline_command(command)


def test_files_the_readme_names_in_the_repository_exist() -> None:
    assert named_paths() and missing_paths() == []
