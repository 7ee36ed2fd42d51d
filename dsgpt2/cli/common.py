"""What the command modules share: the fields of the flags most commands have (``--config JSON``,
``-v``, ``--no_progress``), one-line usage errors, output checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsgpt2.errors import DsGpt2Error
from dsgpt2.settings.options import MISSING, option

CONFIG_HELP = "connection config (MONGO_CONNECTION_STRING, MONGO_CONNECTION_DB, COLLECTIONS, ...)"


def config_option(help: str = CONFIG_HELP, required: bool = True) -> Any:
    """The ``--config JSON`` field of a settings dataclass: the connection config (an experiment file
    given as ``--config`` is read before parsing, :mod:`dsgpt2.settings.runfile`)."""
    return option(MISSING if required else None, help, metavar="JSON")


def verbose_option() -> Any:
    """The ``-v``/``--verbose`` field: debug logging (dsgpt2.cli.main sets it up)."""
    return option(False, "log debug details", short="-v")


def no_progress_option(help: str = "no progress bar") -> Any:
    """The ``--no_progress`` field: no progress bar or progress lines."""
    return option(False, help)


def by_command(*builders: Callable[[Any, str], None]) -> dict[str, Callable[[Any, str], None]]:
    """Each builder of a command's parser by the name of the command it builds: ``add_ingest`` builds
    ``ingest`` (the names are those of runfile.COMMAND_TREE, which the parser is built from)."""
    return {b.__name__.removeprefix("add_"): b for b in builders}


def load_connection(path: Any) -> Any:
    """The connection config at ``path`` (the ``--config`` of a command)."""
    from dsgpt2.db.config import load_config

    return load_config(path)


def usage(command: str, message: str) -> DsGpt2Error:
    from dsgpt2.errors import ConfigError

    return ConfigError(f"dsgpt2 {command}: {message} (see `dsgpt2 {command} --help`)")


def check_writable(path: Any, flag: str) -> None:
    """Fail before the work when its output cannot be written."""
    from dsgpt2.errors import ConfigError

    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a directory; give a file name such as {path / 'report.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there ({exc.strerror})") from None
