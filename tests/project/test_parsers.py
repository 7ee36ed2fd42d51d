"""One module reads argparse's internals: a parser's actions, subcommands, groups and option strings are
read back through the helpers of dsgpt2/settings/options.py (and the hyphen spellings of
dsgpt2/settings/argtypes.py add to them there), so a change in argparse is met in one place."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

# The two modules allowed to read a parser's private attributes.
HELPERS = {ROOT / "dsgpt2" / "settings" / "options.py", ROOT / "dsgpt2" / "settings" / "argtypes.py"}
FOLDERS = ("dsgpt2", "docs", "tests", "bench")
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml"}
# argparse's private names: the module's classes (argparse._SubParsersAction) and a parser's attributes
# and methods (parser._actions, formatter._format_args).
INTERNALS = re.compile(
    r"_option_string_actions|\._actions\b|_SubParsersAction|_mutually_exclusive_groups|_ArgumentGroup"
    r"|argparse\._\w|\.(?:_action_groups|_group_actions|_get_formatter|_format_args|_expand_help)\b"
)


def _files() -> list[Path]:
    return sorted(
        path
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*")
        if path.suffix in SUFFIXES and path.is_file() and path != Path(__file__).resolve()
    )


def _readers(paths: list[Path]) -> dict[str, list[str]]:
    """``{path: [the internals it names]}`` for each of ``paths`` that names any."""
    found = {}
    for path in paths:
        names = INTERNALS.findall(path.read_text(encoding="utf-8", errors="replace"))
        if names:
            found[str(path.relative_to(ROOT))] = sorted(set(names))
    return found


def test_only_the_settings_helpers_read_argparse_internals() -> None:
    assert _readers([p for p in _files() if p not in HELPERS]) == {}


def test_the_check_finds_what_it_looks_for() -> None:
    """The pattern is not vacuous: the helpers themselves are found reading the internals."""
    found = _readers(sorted(HELPERS))
    assert set(found) == {"dsgpt2/settings/options.py", "dsgpt2/settings/argtypes.py"}
    assert {"_option_string_actions", "._actions"} <= set(found["dsgpt2/settings/argtypes.py"])
