"""The embedded database of ``local://DIR``: a MongoDB-compatible server that dsgpt2 starts and shares.

``local://runs/db`` names a directory. The first process that needs it starts SecantusDB (MongoDB's
wire protocol over WiredTiger, ``pip install 'dsgpt2[local]'``) on it, listening on 127.0.0.1 only,
with a password of its own; later processes of the machine (other commands, launcher ranks,
DataLoader workers) find it through the files it leaves in the directory and share it. It keeps
running between commands; ``dsgpt2 db stop`` ends it, and the next command that needs it starts it
again on the same data (WiredTiger's journal keeps what was committed, a killed server included).

The server is a separate process spoken to over the wire protocol, as one runs mongod: its package
is never imported here. The directory holds::

    dsgpt2-db.json   what this directory is (written when it is made)
    data/            WiredTiger's files
    secret           the password of the server's one user (mode 0600)
    server.json      the running server: pid, its start time and port (gone, or naming a stopped pid,
                     when none runs: the next server takes that port again where it is free)
    server.lock      taken while a server is started or stopped
    server.log       the server's output
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dsgpt2.db import procfs
from dsgpt2.errors import ConfigError, MongoUnavailableError, first_line
from dsgpt2.files import atomic_write_text, parses_as_toml, read_regular
from dsgpt2.listen import port_free
from dsgpt2.settings.environment import env_seconds

log = logging.getLogger(__name__)

PREFIX = "local://"
EXTRA = "pip install 'dsgpt2[local]'"
# The server's executable, where it is not installed beside this Python (another environment).
ENV_EXECUTABLE = "DSGPT2_SECANTUSD"
EXECUTABLE = "secantusd-py"
USER = "dsgpt2"
MARKER = "dsgpt2-db.json"
ENGINE = "secantusdb"
MARKER_RECORD = {"engine": ENGINE, "format": 1}
START_TIMEOUT_S = 60.0
# A server with no client for this long stops itself (the next command starts it again): a database
# left behind does not hold its memory for ever. $DSGPT2_DB_IDLE_STOP sets it, in seconds; 0: never.
ENV_IDLE_STOP = "DSGPT2_DB_IDLE_STOP"
IDLE_STOP_S = 3600.0
STOP_TIMEOUT_S = 30.0
# Every commit reaches the disk before it is acknowledged (without it a killed server loses its last
# writes; batched inserts cost about the same either way). The entry point writes no oplog.
SERVER_FLAGS = ("--cache-size", "512M", "--sync-on-commit")
# Files that say a directory already belongs to a database engine.
_FOREIGN = {
    "mongod.lock": "a mongod data directory",
    "storage.bson": "a mongod data directory",
    "WiredTiger": "a WiredTiger database that is not a dsgpt2 one",
    "WiredTiger.wt": "a WiredTiger database that is not a dsgpt2 one",
}


def is_local(uri: str) -> bool:
    return uri.startswith(PREFIX)


def local_dir(uri: str) -> Path:
    """The directory of a ``local://DIR`` URI (relative to the working directory)."""
    rest = uri[len(PREFIX) :]
    if not rest:
        raise ConfigError(f"{PREFIX} needs a directory: write {PREFIX}runs/db (any path; created if absent)")
    return Path(os.path.abspath(os.path.expanduser(rest)))


@dataclass(frozen=True)
class ServerState:
    """A running server of a database directory."""

    pid: int
    port: int
    host: str = "127.0.0.1"
    # The process's start time (/proc's clock ticks since boot): a pid names the server only while it
    # names the process that started then. None where /proc does not tell, or in an older server.json.
    started: int | None = None
    # The data directory it serves (its real path): a server.json copied with the data to another
    # directory names that directory's server, not this one's. None in an older server.json.
    directory: str | None = None

    def record(self) -> str:
        """The server.json that names this server."""
        return json.dumps(asdict(self)) + "\n"


def uri_of(directory: Path, state: ServerState) -> str:
    """The connection string of a running server (it carries the password: never show it)."""
    password = urllib.parse.quote_plus(_secret(directory))
    # Direct: the server names itself by the address other hosts reach it by where `dsgpt2 db serve`
    # runs it (a compose service's name); this machine reaches it where server.json says.
    return f"mongodb://{USER}:{password}@{state.host}:{state.port}/?authSource=admin&directConnection=true"


def ensure(directory: Path, create: bool = True) -> str:
    """The connection string of the server on ``directory``, started if none is running; with
    ``create`` False (a command that only reads), only where a database already is.

    Raises:
        ConfigError: the directory cannot hold a database (not writable, another engine's files),
            holds none and ``create`` is False, or the server cannot be started (package missing,
            start-up failed).
    """
    if not create and not (directory / MARKER).exists():
        held = "does not exist" if not directory.exists() else "holds no dsgpt2 database"
        raise ConfigError(
            f"{PREFIX}{directory}: no database there (the directory {held}); check "
            "MONGO_CONNECTION_STRING (a relative local:// path starts at the working directory, "
            f"{os.getcwd()}), or make the database with dsgpt2 ingest"
        )
    check_directory(directory)
    state = running(directory)
    if state is not None:
        return uri_of(directory, state)
    with locked(directory):
        # Another process may have started it while this one waited (or be opening it: a served one).
        state = running(directory) or _opening(directory)
        if state is None:
            state = _start(directory)
    return uri_of(directory, state)


def _opening(directory: Path) -> ServerState | None:
    """The server of ``directory`` once it listens, where its process runs but does not listen yet
    (``dsgpt2 db serve`` released the lock and became the server, which is opening its data); None
    where no server process runs."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while working(directory) and time.monotonic() < deadline:
        if (state := running(directory)) is not None:
            return state
        time.sleep(0.1)
    return None


_ERRORS = [0]  # transient errors this process met on an embedded server (Connection._server_moved)


def count_error() -> None:
    _ERRORS[0] += 1


def errors_seen() -> int:
    return _ERRORS[0]


def revive(uri: str) -> ServerState | None:
    """After a transient error on ``uri``: when it names an embedded database whose server is gone
    (killed, out of memory), start it again on the same data and, if that port is free, the same port,
    so that the clients of the running command reconnect by themselves. Returns the server started,
    or None (not local://, still running, or no database there)."""
    if not is_local(uri):
        return None
    directory = local_dir(uri)
    if not (directory / MARKER).exists() or running(directory) is not None:
        return None
    with locked(directory):
        if (running(directory) or _opening(directory)) is not None:  # another process started it meanwhile
            return None
        state = _start(directory)
    log.warning("%s%s: its server had stopped; started it again (pid %d, port %d) on the same data",
                PREFIX, directory, state.pid, state.port)  # fmt: skip
    return state


def running(directory: Path) -> ServerState | None:
    """The server running on ``directory``, or None (no server file, a dead pid, nothing listening)."""
    state = _read_state(directory)
    if state is None or not is_server(state.pid, directory, state.started):
        return None
    try:
        with socket.create_connection((state.host, state.port), timeout=2):
            return state
    except OSError:
        return None


def working(directory: Path) -> bool:
    """Whether the server of ``directory`` runs and is not stopped (SIGSTOP): it may be too busy to
    answer at once (one process serves every connection), but it is at work."""
    state = _read_state(directory)
    if state is None or not is_server(state.pid, directory, state.started):
        return False
    stat = procfs.stat(state.pid)
    return stat is not None and stat[0] not in "TtZX"


def stop(directory: Path, timeout_s: float = STOP_TIMEOUT_S) -> ServerState | None:
    """Stop the server of ``directory`` (SIGTERM, then SIGKILL after ``timeout_s``); the one stopped,
    or None when none was running. A stale server file is removed."""
    if not (directory / MARKER).exists():
        return None
    with locked(directory):
        state = _read_state(directory)
        if state is None or not is_server(state.pid, directory, state.started):
            if state is None:  # unreadable: no port to keep
                with contextlib.suppress(FileNotFoundError):
                    (directory / "server.json").unlink()
            stray = strays(directory)
            for pid in stray:
                procfs.terminate(pid, timeout_s)
            return ServerState(pid=stray[0], port=0) if stray else None
        procfs.terminate(state.pid, timeout_s)
        # server.json is kept, naming the stopped pid: the next server takes its port again where it is
        # free, so that the clients of this one (a training's loader workers) find it where they retry.
        return state


def disk_bytes(directory: Path) -> int:
    """Bytes the database's files take on disk."""
    total = 0
    for path in (directory / "data").rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_blocks * 512
    return total


def executable() -> list[str]:
    """How to run the server: $DSGPT2_SECANTUSD, the script beside this Python, or on the PATH.

    Raises:
        ConfigError: SecantusDB is not installed.
    """
    named = os.environ.get(ENV_EXECUTABLE, "").strip()
    if named:
        if not (shutil.which(named) or os.access(named, os.X_OK)):
            raise ConfigError(f"{ENV_EXECUTABLE}={named!r} is not an executable; unset it or fix the path")
        return [named]
    beside = Path(sys.executable).parent / EXECUTABLE
    if beside.exists():
        return [str(beside)]
    found = shutil.which(EXECUTABLE)
    if found:
        return [found]
    raise ConfigError(
        f"{PREFIX} needs the embedded database server, which is not installed here: {EXTRA} "
        f"(or name a MongoDB server with mongodb://)"
    )


# ``secantusd.py`` beside this module, run by the server's own Python without importing dsgpt2 there.
SHIM = Path(__file__).with_name("secantusd.py")
_RUN_SHIM = "import runpy, sys; sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')"


def server_command() -> list[str]:
    """The command that runs the server: the shim (``secantusd.py``) under the Python of SecantusDB's
    script, or the executable itself where it is not a Python script."""
    found = executable()
    try:
        with open(found[0], "rb") as f:
            first = f.readline(256)
    except OSError:
        return found
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if not words or not os.path.basename(words[-1]).startswith("python"):
        return found
    return [*words, "-c", _RUN_SHIM, str(SHIM)]


def check_directory(directory: Path) -> None:
    where = f"{PREFIX}{directory}"
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{where} is a file, not a directory; name a directory for the database")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot create the database directory ({exc.strerror})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{where} is not writable by this user; name a directory you can write to")
    marker = directory / MARKER
    if marker.exists():
        try:
            engine = json.loads(read_regular(marker)).get("engine")  # a named pipe: not waited on
        except (OSError, ValueError, AttributeError):
            raise ConfigError(
                f"{where}: {MARKER} is damaged (not the JSON {PREFIX} writes); if the directory holds its "
                f"database, write the file back as {json.dumps(MARKER_RECORD)}"
            ) from None
        if engine != ENGINE:
            raise ConfigError(
                f"{where}: {MARKER} names the engine {engine!r}, not {ENGINE}: the directory holds another "
                "engine's database; name a new or empty directory"
            )
        return
    # What processes starting at the same moment write first: the lock, and the marker being written.
    entries = sorted(
        p.name
        for p in directory.iterdir()
        if p.name != "server.lock" and not p.name.startswith(f".{MARKER}.")
    )
    for name, what in _FOREIGN.items():
        if name in entries:
            raise ConfigError(
                f"{where} holds {what} ({name}); {PREFIX} makes its own: name a new or empty directory"
            )
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(
            f"{where} holds files that are not a dsgpt2 database ({shown}); name a new or empty directory"
        )
    with locked(directory):
        if not marker.exists():
            atomic_write_text(marker, json.dumps(MARKER_RECORD) + "\n")


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold the directory's start/stop lock (released by the kernel if this process dies)."""
    with open(directory / "server.lock", "a+") as f:
        deadline = time.monotonic() + START_TIMEOUT_S * 2
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MongoUnavailableError(
                        f"{PREFIX}{directory}: another process has been starting or stopping its server "
                        f"for {START_TIMEOUT_S * 2:.0f} s; see {directory / 'server.log'}"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_state(directory: Path) -> ServerState | None:
    try:
        data = json.loads(read_regular(directory / "server.json"))  # a named pipe: not waited on
        started, served = data.get("started"), data.get("directory")
        if served is not None and os.path.realpath(served) != os.path.realpath(directory):
            return None  # copied here with the data: the server of the directory it came from
        return ServerState(
            pid=int(data["pid"]), port=int(data["port"]), host=str(data.get("host", "127.0.0.1")),
            started=None if started is None else int(started), directory=served,
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: no server it names
        return None


def is_server(pid: int, directory: Path, started: int | None = None) -> bool:
    """Whether ``pid`` is alive and, where /proc tells, the server of this directory (not a reused pid):
    the process that started at ``started`` where that is known, else one whose command line names the
    directory's data. The start time holds across the exec of `dsgpt2 db serve` into the server, while
    the command line names the data only after it (and is empty for a moment during it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = procfs.stat(pid)
    if stat is None:  # no /proc here
        return True
    if stat[0] in "ZX":
        return False
    if started is not None:
        return int(stat[19]) == started
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return str(directory / "data").encode() in cmdline


def served_data(words: list[bytes]) -> Path | None:
    """The data directory that a command line (its words) serves where it is this toolkit's server (its
    executable or the shim, with --storage-path); None for any other."""
    ours = any(os.path.basename(w) in (EXECUTABLE.encode(), SHIM.name.encode()) for w in words)
    if not ours or b"--storage-path" not in words[:-1]:
        return None
    return Path(os.fsdecode(words[words.index(b"--storage-path") + 1]))


def strays(directory: Path) -> list[int]:
    """This user's servers on ``directory``'s data that its server.json does not name: left by a command
    stopped while it made the database (its first server, without a login, on a port nothing records)
    or by a server.json damaged. No client finds them, and they hold the data's files."""
    named = _read_state(directory)
    data = os.path.realpath(directory / "data")
    return [
        pid
        for pid, words in procfs.own_processes()
        if (served := served_data(words)) is not None
        and os.path.realpath(served) == data
        and (named is None or pid != named.pid)
    ]


def _secret(directory: Path) -> str:
    try:  # a folder or a named pipe there is said to be one, not read (nor waited on)
        return read_regular(directory / "secret").decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:  # stopped, a server without it makes a new password
        why = "is missing" if isinstance(exc, FileNotFoundError) else f"cannot be read ({first_line(exc)})"
        raise MongoUnavailableError(
            f"{PREFIX}{directory}: its password file {why}; stop the server (dsgpt2 db stop), "
            f"{'' if why == 'is missing' else 'move it away, '}and run the command again"
        ) from None


def _start(directory: Path) -> ServerState:
    """Start a server on ``directory`` (the lock held); its user is made on the first start."""
    command = server_command()
    _check_metadata(directory)
    for pid in strays(directory):
        why = "a command stopped while it made the database, or server.json damaged"
        log.warning("%s%s: a server (pid %d) that no server.json names held its data (%s): stopped",
                    PREFIX, directory, pid, why)  # fmt: skip
        procfs.terminate(pid, STOP_TIMEOUT_S)
    previous = _read_state(directory)
    if not (directory / "secret").exists():
        provision(directory, command)
    # The port of the last server if it is free, so that clients of a restarted server find it again.
    port = previous.port if previous is not None and port_free(previous.port) else 0
    state = _launch(directory, command, port, auth=True)
    state = replace(state, started=procfs.start_time(state.pid), directory=os.path.realpath(directory))
    atomic_write_text(directory / "server.json", state.record())
    return state


# The engine's own files, without which it takes the data's tables for strays: it sets them aside and
# begins an empty database over them.
ENGINE_FILES = ("WiredTiger", "WiredTiger.turtle", "WiredTiger.wt")


def _check_metadata(directory: Path) -> None:
    """A database's data, where it holds tables, has the engine's own files.

    Raises:
        ConfigError: one is missing.
    """
    data = directory / "data"
    missing = [name for name in ENGINE_FILES if not (data / name).exists()]
    if missing and any(data.glob("*.wt")):
        raise ConfigError(
            f"{PREFIX}{directory}: its data holds tables but not {', '.join(missing)} (the engine's own "
            "record of them): started so, the engine would set them aside and begin an empty database; "
            f"put the file back in {data} (from a backup, or the copy the database came from)"
        )


def provision(directory: Path, command: list[str], users: dict[str, str] | None = None) -> None:
    """A server without auth, on loopback, long enough to create (or update) its users: the directory's
    own, with a new password kept in ``secret``, where it has none yet; and ``users`` (name: password),
    the directory's own among them if named (its ``secret`` then holds that password)."""
    import pymongo

    own = {} if (directory / "secret").exists() else {USER: secrets.token_urlsafe(24)}
    wanted = {**own, **(users or {})}
    if not wanted:
        return
    state = _launch(directory, command, 0, auth=False)
    try:
        client = pymongo.MongoClient(
            host=state.host, port=state.port, serverSelectionTimeoutMS=int(START_TIMEOUT_S * 1000)
        )
        try:
            known = {u["user"] for u in client.admin.command("usersInfo")["users"]}
            for name, password in wanted.items():
                if name not in known:
                    client.admin.command(
                        "createUser", name, pwd=password, roles=[{"role": "root", "db": "admin"}]
                    )
                else:
                    client.admin.command("updateUser", name, pwd=password)
        finally:
            client.close()
    finally:
        procfs.terminate(state.pid, STOP_TIMEOUT_S)
    if USER not in wanted:
        return
    path = directory / "secret"
    fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(wanted[USER] + "\n")
    os.replace(path.with_suffix(".tmp"), path)


def server_args(directory: Path, command: list[str], host: str, port: int, auth: bool) -> list[str]:
    """The server's command line on ``directory`` (its data and an empty config file of its own)."""
    (directory / "data").mkdir(exist_ok=True)
    config = directory / "secantusd.toml"
    if config.exists() and not parses_as_toml(config):
        log.warning("%s is damaged: written again (dsgpt2 gives the server its settings as flags)", config)
        config.unlink()
    if not config.exists():  # named so that no secantusd.toml of the working directory or home applies
        atomic_write_text(config, "# dsgpt2 passes its settings as flags\n")
    return [
        *command, "--config", str(config), "--host", host, "--port", str(port),
        "--storage-path", str(directory / "data"), *SERVER_FLAGS, *(["--auth"] if auth else []),
    ]  # fmt: skip


def _launch(directory: Path, command: list[str], port: int, auth: bool) -> ServerState:
    """Run the server detached (it outlives this process) and wait until it listens."""
    log_path = directory / "server.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    args = server_args(directory, command, "127.0.0.1", port, auth)
    pid = _spawn_detached(args, log_path, directory)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        listening = _listening_port(log_path, start)
        if listening is not None:
            return ServerState(pid=pid, port=listening)
        if not procfs.alive(pid):
            if port != 0 and "in use" in _log_tail(log_path, start):
                return _launch(directory, command, 0, auth)  # the old port was taken meanwhile
            raise ConfigError(
                f"{PREFIX}{directory}: the database server did not start: {_log_tail(log_path, start)}"
            )
        time.sleep(0.05)
    procfs.terminate(pid, 5)
    raise ConfigError(
        f"{PREFIX}{directory}: the database server did not listen within {START_TIMEOUT_S:.0f} s; "
        f"see {log_path}"
    )


# The server outlives this process on purpose, so it is no child of it: a shell starts it in a session
# of its own and exits, leaving no child to reap and no Popen to report as a leak.
_DETACH = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'


def _spawn_detached(args: list[str], log_path: Path, directory: Path) -> int:
    """Start ``args`` as a daemon (its output appended to ``log_path``); its pid."""
    try:
        if shutil.which(args[0]) is None:
            raise FileNotFoundError(2, os.strerror(2))
        out = subprocess.run(
            ["/bin/sh", "-c", _DETACH, "sh", str(log_path), *args], stdin=subprocess.DEVNULL,
            capture_output=True, start_new_session=True, close_fds=True, cwd=directory,
            env=server_environment(), check=True, timeout=30,
        )  # fmt: skip
    except OSError as exc:
        raise ConfigError(f"{PREFIX}{directory}: cannot run {args[0]} ({exc.strerror}); {EXTRA}") from None
    except subprocess.SubprocessError as exc:
        raise ConfigError(f"{PREFIX}{directory}: cannot start the database server ({exc})") from None
    return int(out.stdout.split()[-1])


def idle_stop_s() -> float:
    """Seconds without a client after which a server started now stops itself ($DSGPT2_DB_IDLE_STOP;
    0: never).

    Raises:
        ConfigError: the variable is not a number of seconds.
    """
    return env_seconds(ENV_IDLE_STOP, IDLE_STOP_S, "never stop")


def server_environment() -> dict[str, str]:
    """The server's environment: when it stops itself, and glibc's malloc with two arenas, not one per
    thread. Each connection is a thread of the server, and memory freed in a thread's arena stays with
    the process: after every pass of the scale benchmark at 2,000 documents, 172 MB resident, not 250."""
    return {
        **os.environ,
        "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
        ENV_IDLE_STOP: f"{idle_stop_s():g}",
    }


def _listening_port(log_path: Path, start: int) -> int | None:
    with open(log_path, "rb") as f:
        f.seek(start)
        for line in f.read().decode("utf-8", "replace").splitlines():
            if "listening on " in line:
                return int(line.rsplit(":", 1)[1].strip())
    return None


def _log_tail(log_path: Path, start: int) -> str:
    """The last line of the server's output that says what went wrong."""
    with open(log_path, "rb") as f:
        f.seek(start)
        lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "no output"
