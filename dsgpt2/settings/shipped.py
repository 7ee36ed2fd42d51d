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
    (``configs/recipes/demo.yaml``, where the working directory has no ``configs/`` at all) or by its
    name (``ds_config_cpu.json``), the shipped one, said in a warning: an install has no ``configs/`` of
    its own, and the README's commands name it. A ``configs/`` that lacks the file keeps the typo's error."""
    if path.is_absolute() or path.exists() or not path.parts:
        return path
    checkout = path.parts[0] == "configs" and len(path.parts) > 1
    if checkout and Path("configs").exists():
        return path
    name = Path(*path.parts[1:]) if checkout else path
    shipped = Path(str(resources.files("dsgpt2") / "configs" / name.as_posix()))
    if not shipped.is_file():
        return path
    log.warning("%s is not in %s: the copy shipped with dsgpt2 is read (%s)", path, Path.cwd(), shipped)
    return shipped


def shipped_path(value: str | Path | None) -> Path | None:
    """A path flag's value as :func:`shipped_if_absent` reads it (None stays None)."""
    return None if value is None else shipped_if_absent(Path(value))


def shipped_names() -> list[str]:
    return sorted(
        p.name for p in resources.files("dsgpt2").joinpath("configs").iterdir() if p.name.endswith(".json")
    )
