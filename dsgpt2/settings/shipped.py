"""The configs that ship inside the package (``dsgpt2/configs``; ``configs/`` in a checkout)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from dsgpt2.errors import ConfigError


def shipped_config(name: str) -> Path:
    """The path of the shipped config ``name`` (``ds_config_cpu.json``), wherever dsgpt2 is installed.

    Raises:
        ConfigError: no shipped config of that name.
    """
    path = Path(str(resources.files("dsgpt2") / "configs" / name))
    if not path.is_file():
        raise ConfigError(f"no shipped config {name!r}; the shipped ones are {', '.join(shipped_names())}")
    return path


def shipped_config_named(path: str | Path) -> Path:
    """The shipped config that ``path`` names as a checkout spells it (a recipe's
    ``configs/recipes/ds_muon.json``), wherever dsgpt2 is installed."""
    return shipped_config(Path(path).relative_to("configs").as_posix())


def shipped_names() -> list[str]:
    return sorted(
        p.name for p in resources.files("dsgpt2").joinpath("configs").iterdir() if p.name.endswith(".json")
    )
