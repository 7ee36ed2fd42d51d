"""What the command modules share: the connection-config flag, one-line usage errors, output checks."""

from __future__ import annotations

import argparse
from typing import Any

from dsgpt2.errors import DsGpt2Error


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        required=True,
        metavar="JSON",
        help="connection config (MONGO_CONNECTION_STRING, MONGO_CONNECTION_DB, COLLECTIONS, ...)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")


def load_config_arg(args: argparse.Namespace) -> Any:
    from dsgpt2.db.config import load_config

    return load_config(args.config)


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
