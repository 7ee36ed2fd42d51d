"""ARCHITECTURE.md stays a true map of the package."""

from __future__ import annotations

import re

from conftest import ROOT

ARCHITECTURE = ROOT / "ARCHITECTURE.md"
PACKAGE = ROOT / "dsgpt2"


def _modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}


def _named() -> set[str]:
    """The module paths ARCHITECTURE.md's layout table names (first column, in backticks)."""
    rows = [line for line in ARCHITECTURE.read_text().splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row.split("|")[1])}


def test_architecture_names_every_module() -> None:
    missing = sorted(_modules() - _named())
    assert missing == [], f"ARCHITECTURE.md's layout table does not name {missing}"


def test_architecture_names_no_module_that_is_gone() -> None:
    gone = sorted(_named() - _modules())
    assert gone == [], f"ARCHITECTURE.md names {gone}, which are not in dsgpt2/"


def test_every_room_is_a_row_and_in_the_import_order() -> None:
    """Each folder of the package has a heading row, and the import order the layout test holds is the
    one the text states."""
    from test_layout import ORDER

    text = ARCHITECTURE.read_text()
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(ORDER) == rooms
    for room in rooms:
        assert f"| **`{room}/`** |" in text, room
    assert " ← ".join(f"`{r}`" for r in ORDER) in text.replace("\n", " ")


def test_architecture_names_every_section_of_the_run_config() -> None:
    import dataclasses

    from dsgpt2.train.config import TrainConfig

    text = ARCHITECTURE.read_text()
    sections = [
        f.type if isinstance(f.type, str) else f.type.__name__ for f in dataclasses.fields(TrainConfig)
    ]
    assert len(sections) == 8 and [s for s in sections if f"`{s}`" not in text] == []
