"""The configs that ship inside the package (``dsgpt2/configs``; ``configs/`` in a checkout)."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

from dsgpt2.errors import ConfigError

log = logging.getLogger(__name__)


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


def shipped_if_absent(path: Path) -> Path:
    """``path``; where no file is there and it names a shipped config as a checkout spells it
    (``configs/recipes/demo.yaml``) or by its name (``ds_config_cpu.json``), the shipped one, said in a
    line: an install has no ``configs/`` of its own, and the README's commands name it."""
    if path.is_absolute() or path.exists() or not path.parts:
        return path
    name = Path(*path.parts[1:]) if path.parts[0] == "configs" and len(path.parts) > 1 else path
    shipped = Path(str(resources.files("dsgpt2") / "configs" / name.as_posix()))
    if not shipped.is_file():
        return path
    log.info("%s is not here: the shipped %s is read (%s)", path, name.as_posix(), shipped)
    return shipped


def shipped_path(value: str | Path | None) -> Path | None:
    """A path flag's value as :func:`shipped_if_absent` reads it (None stays None)."""
    return None if value is None else shipped_if_absent(Path(value))


def shipped_names() -> list[str]:
    return sorted(
        p.name for p in resources.files("dsgpt2").joinpath("configs").iterdir() if p.name.endswith(".json")
    )
