"""``dsgpt2 db status|stop|compact|serve``: the embedded database server of a ``local://DIR`` database."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import Command, config_option, load_connection, usage, verbose_option
from dsgpt2.settings.options import PORT, Checked, from_namespace, option


@dataclass(frozen=True, kw_only=True)
class DbSettings(Checked):
    """``dsgpt2 db``: what to do, to which embedded database."""

    action: str = option(help="what to do", positional=True, choices=("status", "stop", "compact", "serve"))
    database: str | None = option(
        None, "the database (local://DIR or DIR); or give --config", positional=True, metavar="local://DIR"
    )
    config: str | None = config_option(
        "a connection config whose MONGO_CONNECTION_STRING is local://", required=False
    )
    json: bool = option(False, "print the status as JSON")
    host: str = option("127.0.0.1", "serve: the address to listen on (0.0.0.0: every interface)")
    port: int = option(27017, "serve: the port to listen on", check=PORT)
    advertise: str | None = option(
        None, "serve: the host name clients reach it by (default: --host, or this machine's name for 0.0.0.0)"
    )
    user: str | None = option(
        None, "serve: a user to create (or give the password), besides the database's own"
    )
    password_env: str = option(
        "MONGO_PASSWORD", "serve: the environment variable holding --user's password", metavar="VAR"
    )
    verbose: bool = verbose_option()


SERVE_ONLY = ("host", "port", "advertise", "user", "password_env")


def _directory(settings: DbSettings) -> Path:
    from dsgpt2.db import embedded, processes

    if settings.database and settings.config:
        raise usage("db", "give the database or --config, not both")
    if settings.config:
        config = load_connection(settings.config)
        if not config.is_local:
            raise usage(
                "db", f"{settings.config} names {config.display_uri}, not an embedded database (local://DIR)"
            )
        return embedded.local_dir(config.uri)
    if not settings.database:
        running = [f"{embedded.PREFIX}{d}" for d in processes.servers()]
        now = f"; running now: {', '.join(running)}" if running else "; none runs now"
        raise usage(
            "db", f"name the database: dsgpt2 db {settings.action} local://runs/db (or --config FILE){now}"
        )
    name = settings.database
    if "://" in name and not embedded.is_local(name):
        raise usage(
            "db", f"{name.split('://')[0]}:// is a server of its own; only local://DIR is managed here"
        )
    return embedded.local_dir(name if embedded.is_local(name) else embedded.PREFIX + name)


def cmd_db(args: argparse.Namespace) -> int:
    from dsgpt2.db import embedded, processes

    settings = from_namespace(DbSettings, args)
    fields = DbSettings.__dataclass_fields__
    given = [f"--{f}" for f in SERVE_ONLY if getattr(settings, f) != fields[f].default]
    if settings.action != "serve" and given:
        raise usage("db", f"{', '.join(given)}: only for dsgpt2 db serve")
    if settings.action == "status" and not (settings.database or settings.config):
        found = [_status(directory) for directory in processes.servers()]
        if settings.json:
            print(json.dumps(found))
        for info in [] if settings.json else found:
            print(_status_line(info))
        if not found and not settings.json:
            print("no embedded database server runs for this user; dsgpt2 db status local://DIR shows one")
        return 0
    directory = _directory(settings)
    where = f"{embedded.PREFIX}{directory}"
    if settings.action == "serve":  # a new directory becomes a database, as ingest makes one
        return _serve(directory, settings)
    if not (directory / embedded.MARKER).exists():
        raise usage("db", f"{where} is not a dsgpt2 database (no {embedded.MARKER} there)")
    if settings.action == "compact":
        print(_compact(directory))
        return 0
    if settings.action == "stop":
        if (state := embedded.running(directory)) is not None:
            for pid, command in processes.clients(state):
                print(f"warning: pid {pid} ({command}) is connected to {where}: its reads and writes wait "
                      "for the server, and its next retry starts it again", file=sys.stderr)  # fmt: skip
        stopped = embedded.stop(directory)
        if stopped is None:
            print(f"{where}: not running")
        else:
            print(f"{where}: stopped (pid {stopped.pid}); the next command that needs it starts it again")
        return 0
    info = _status(directory)
    print(json.dumps(info) if settings.json else _status_line(info))
    return 0


def _serve(directory: Path, settings: DbSettings) -> int:
    from dsgpt2.db.serving import serve

    if settings.port == 0:
        raise usage("db", "--port 0: a served database needs a fixed port, the one its clients name")
    password = None
    if settings.user is not None:
        # Taken out of the environment: the server this process becomes does not inherit it.
        password = os.environ.pop(settings.password_env, "")
        if not password:
            raise usage(
                "db",
                f"--user {settings.user} needs its password in ${settings.password_env} (--password_env)",
            )
    serve(
        directory,
        settings.host,
        settings.port,
        user=settings.user,
        password=password,
        advertise=settings.advertise,
    )


def _compact(directory: Path) -> str:
    """Compact the database on ``directory`` (its server started if none runs); a line of what it did."""
    from dsgpt2.db import embedded
    from dsgpt2.db.client import Connection, compact
    from dsgpt2.db.config import config_from_dict

    uri = f"{embedded.PREFIX}{directory}"
    # The server alone: the command names no corpus (a collection is required of a config, and unread).
    config = config_from_dict({"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "admin",
                               "COLLECTIONS": ["compact"]}, env={})  # fmt: skip
    before = embedded.disk_bytes(directory)
    compact(Connection(config, create=False))
    after = embedded.disk_bytes(directory)
    return (
        f"{uri}: {before / 1e6:,.1f} MB on disk before, {after / 1e6:,.1f} MB after "
        f"({max(0, before - after) / 1e6:,.1f} MB given back)"
    )


def _status(directory: Path) -> dict[str, Any]:
    from dsgpt2.db import embedded, processes

    state = embedded.running(directory)
    info: dict[str, Any] = {
        "database": f"{embedded.PREFIX}{directory}",
        "running": state is not None,
        "disk_bytes": embedded.disk_bytes(directory),
    }
    if state is not None:
        info |= {
            "pid": state.pid,
            "address": f"{state.host}:{state.port}",
            "rss_bytes": processes.rss_bytes(state.pid),
            "since": _since(directory),
        }
    else:
        info["stray_pids"] = embedded.strays(directory)
    return info


def _status_line(info: dict[str, Any]) -> str:
    disk = f"{info['disk_bytes'] / 1e6:.1f} MB on disk"
    if not info["running"]:
        if info.get("stray_pids"):
            pids = ", ".join(map(str, info["stray_pids"]))
            return (
                f"{info['database']}: not running ({disk}), but a server no server.json names (pid {pids}) "
                "holds its data; the next command that needs it stops that one first, as dsgpt2 db stop does"
            )
        return f"{info['database']}: not running ({disk}); the next command that needs it starts it"
    rss = f", {info['rss_bytes'] / 1e6:.0f} MB resident" if info["rss_bytes"] else ""
    up = f"pid {info['pid']}, {info['address']}, up {info['since']}{rss}, {disk}"
    return f"{info['database']}: running ({up})"


def _since(directory: Path) -> str:
    try:
        seconds = time.time() - (directory / "server.json").stat().st_mtime
    except OSError:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


DB = Command(
    "db",
    help="show, stop, compact or serve the embedded database server of a local:// database",
    description="The embedded database (MONGO_CONNECTION_STRING local://DIR) runs a server that the first "
    "command needing it starts and that later commands share. `status` shows it (with no database "
    "named: every one this user runs), `stop` ends it (the next command that needs it starts it "
    "again, on the same data), `compact` gives the space of rewritten documents back to the file system "
    "(curation passes rewrite every document they mark; WiredTiger reuses that space but keeps it; "
    "other commands may run meanwhile). `serve` runs the server in the foreground, as a container runs "
    "mongod: on --host and --port, authentication on, with --user (its password from $MONGO_PASSWORD) "
    "besides the database's own; it never stops when idle (docker/compose.embedded.yaml runs it as the "
    "compose stack's mongo service).",
    settings=(DbSettings,),
    handler=cmd_db,
)
