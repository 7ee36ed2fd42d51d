"""``dsgpt2 db serve``: the embedded database's server in the foreground, as a container runs mongod.

Elsewhere the first command that needs a ``local://DIR`` database starts its server in the background,
on loopback, with a password of its own. Here this process becomes the server (``exec``: signals reach
it, its output is the container's log), on the address and port given, with authentication on and,
besides the directory's own user, the user a deployment names (the compose stack's ``MONGO_USER``,
its password read from an environment variable, never from the command line). It does not stop when
idle. Commands of the same machine that name ``local://DIR`` find it as they find a background one.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import NoReturn

from dsgpt2.db import embedded, procfs
from dsgpt2.errors import ConfigError
from dsgpt2.files import atomic_write_text
from dsgpt2.listen import check_bind

WILDCARDS = ("0.0.0.0", "::", "")
# Read by the server's entry point (db/secantusd.py): the host it names as its address in ``hello``.
ADVERTISE = "DSGPT2_DB_ADVERTISE"


def serve(
    directory: Path,
    host: str,
    port: int,
    *,
    user: str | None = None,
    password: str | None = None,
    advertise: str | None = None,
) -> NoReturn:
    """Become the server of ``directory`` listening on ``host``:``port``; ``user`` (with ``password``) is
    made a root user of it, or given that password where it exists. ``advertise``: the host name that
    clients reach it by, which it names as its replica set's member (drivers connect to that name after
    their first reply); by default ``host``, or this machine's name where ``host`` is every interface.

    Raises:
        ConfigError: the directory cannot hold a database, a server already runs on it, or the server
            cannot be run.
    """
    where = f"{embedded.PREFIX}{directory}"
    if (user is None) != (password is None):
        raise ConfigError(f"{where}: a user needs a password and a password a user")
    embedded.check_directory(directory)
    check_bind(host, port)
    with embedded.locked(directory):
        state = embedded.running(directory)
        if state is not None:
            raise ConfigError(
                f"{where}: a server already runs on it (pid {state.pid}, port {state.port}); "
                f"stop it first: dsgpt2 db stop {where}"
            )
        command = embedded.server_command()
        embedded.provision(directory, command, {user: password} if user and password else None)
        # This process becomes the server: its pid is the server's, and loopback reaches any address.
        local = "127.0.0.1" if host in WILDCARDS or host.startswith("127.") else host
        serving = embedded.ServerState(
            os.getpid(), port, local, procfs.start_time(os.getpid()), os.path.realpath(directory)
        )
        atomic_write_text(directory / "server.json", serving.record())
    args = embedded.server_args(directory, command, host, port, auth=True)
    named = advertise or (socket.gethostname() if host in WILDCARDS else host)
    env = {**embedded.server_environment(), embedded.ENV_IDLE_STOP: "0", ADVERTISE: named}
    print(f"{where}: serving on {host}:{port} as {named}:{port} (pid {os.getpid()}); Ctrl-C or SIGTERM "
          "stops it", flush=True)  # fmt: skip
    sys.stderr.flush()
    try:
        os.execvpe(args[0], args, env)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot run {args[0]} ({exc.strerror}); {embedded.EXTRA}") from None
