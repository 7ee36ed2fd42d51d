"""A MongoDB wire-protocol server for the tests and benchmarks: mongoeco over TCP with SCRAM auth.

mongoeco (``pip install "mongoeco[wire]"``, Python 3.13+) speaks MongoDB's wire protocol on top of
SQLite. It is a test server, not MongoDB: real pymongo, real sockets, real cursors and real
authentication, but none of MongoDB's storage engine, query planner or timings. ``make test`` builds
its environment in ``.venv-wire`` when a Python 3.13+ exists.

Run as a script (under that environment) it serves until killed::

    .venv-wire/bin/python tests/wire_server.py --db /tmp/x.sqlite --port 27018 --user u --password p

and prints ``READY <port>`` once it accepts connections. :class:`WireServer` runs it from the test
process (any Python): start, SIGKILL, SIGSTOP/SIGCONT, restart on the same port and data file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_ENV = "DSGPT2_WIRE_PYTHON"
USER = "trainer"
PASSWORD = "wire-s3cret-pw"


def wire_python() -> str | None:
    """The interpreter that has mongoeco: $DSGPT2_WIRE_PYTHON, else ``.venv-wire/bin/python``."""
    explicit = os.environ.get(PYTHON_ENV)
    if explicit:
        return explicit
    default = ROOT / ".venv-wire" / "bin" / "python"
    return str(default) if default.exists() else None


def unavailable_reason() -> str | None:
    """Why no wire server can run here, or None when one can."""
    if wire_python() is None:
        return (
            "no wire-protocol test server: needs Python >= 3.13 with mongoeco[wire] "
            f"(`make test` builds .venv-wire when a python3.13 exists, or set {PYTHON_ENV})"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WireServer:
    """One server process on 127.0.0.1 with a password user; its data survives restarts."""

    def __init__(self, db_path: Path, port: int | None = None) -> None:
        self.db_path = db_path
        self.port = port or free_port()
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = db_path.with_suffix(".log")

    def uri(self, user: str = USER, password: str = PASSWORD) -> str:
        return (
            f"mongodb://{user}:{password}@127.0.0.1:{self.port}/?authSource=admin&authMechanism=SCRAM-SHA-256"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> WireServer:
        python = wire_python()
        if python is None:
            raise RuntimeError(unavailable_reason())
        log = open(self.log_path, "a")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(
            [python, __file__, "--db", str(self.db_path), "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # a Ctrl-C of the test run is not the server's
        )
        log.close()
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # EOF if it dies first
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"the wire server did not start: {self.log_path.read_text()[-2000:]}")
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, as a server lost to the network looks to a client."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def restart(self) -> WireServer:
        self.kill()
        return self.start()


def _serve(db: str, port: int, user: str, password: str) -> None:
    import asyncio

    from mongoeco.engines.sqlite import SQLiteEngine
    from mongoeco.wire import AsyncMongoEcoProxyServer
    from mongoeco.wire.auth import WireAuthUser

    # mongoeco checks the password but not the roles.
    auth = (WireAuthUser(user, password, roles=({"role": "root", "db": "admin"},)),)

    async def main() -> None:
        server = AsyncMongoEcoProxyServer(engine=SQLiteEngine(db), port=port, auth_users=auth)
        address = await server.start()
        print(f"READY {address.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.close()

    asyncio.run(main())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="SQLite file (created if absent)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--user", default=USER)
    parser.add_argument("--password", default=PASSWORD)
    args = parser.parse_args()
    _serve(args.db, args.port, args.user, args.password)
    sys.exit(0)


class Proxy:
    """A TCP forwarder to 127.0.0.1:``target`` that can delay the server's answers.

    ``delay`` seconds are waited before each piece of an answer is passed on: a slow network or
    a loaded server, as a client sees it.
    """

    def __init__(self, target: int, delay: float = 0.0) -> None:
        import threading

        self.target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._conns: list[socket.socket] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delay: float | None) -> None:
        import time

        try:
            while data := src.recv(65536):
                time.sleep(self.delay if delay is None else delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._conns:
            s.close()
