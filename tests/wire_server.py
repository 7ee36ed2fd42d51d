"""MongoDB wire-protocol servers for the tests and benchmarks: SecantusDB (WiredTiger) processes.

SecantusDB (``pip install 'dsgpt2[local]'``, the engine of ``local://``) speaks MongoDB's wire protocol
over WiredTiger: real pymongo, real sockets, real cursors, SCRAM authentication and mongod's own fault
injection (``configureFailPoint``/``failCommand``, enabled here). It is not a MongoDB deployment: none of
its timings are MongoDB's.

:class:`WireServer` runs one on a data directory with a password user: start, SIGKILL, SIGSTOP/SIGCONT,
restart on the same port and data. :func:`shared_server` is the one in-memory server each test process
uses for what needs a database and no faults of its own (``conftest.make_config``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dsgpt2.collective import free_port
from dsgpt2.db import embedded
from pace import deadline

ROOT = Path(__file__).resolve().parents[1]
USER = "trainer"
PASSWORD = "wire-s3cret-pw"
# After a "not primary" error pymongo waits for the next heartbeat before it selects the server again
# (10 s by default); a loopback server can be asked every half second.
CLIENT_OPTIONS = "heartbeatFrequencyMS=500"


def unavailable_reason() -> str | None:
    """Why no wire server can run here, or None when one can."""
    try:
        embedded.executable()
    except Exception as exc:
        return f"no wire-protocol test server: {exc}"
    return None


def _wait_listening(proc: subprocess.Popen[Any], log_path: Path, start: int, base_s: float = 60.0) -> int:
    end = time.monotonic() + deadline(base_s)
    while time.monotonic() < end:
        with open(log_path, "rb") as f:
            f.seek(start)
            for line in f.read().decode("utf-8", "replace").splitlines():
                if "listening on " in line:
                    return int(line.rsplit(":", 1)[1])
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the wire server did not start: {log_path.read_text()[-2000:]}")


# Run before the server's own command (in the process that becomes the server): the kernel ends it when
# the test process that started it ends, however that ends (SIGTERM, SIGKILL, a crash: no atexit runs
# then). Linux only; elsewhere the atexit stop alone.
_TIED = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform == 'linux':\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        sys.exit(0)  # the parent ended before the line above\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def tied(command: list[str]) -> list[str]:
    """``command``, run so that it ends when this process does (a server a test starts)."""
    if threading.current_thread() is not threading.main_thread():
        # The death signal follows the thread that started the process: only the main thread lives as
        # long as the test process.
        return command
    return [sys.executable, "-c", _TIED, str(os.getpid()), *command]


def _spawn(args: list[str], log_path: Path) -> tuple[subprocess.Popen[Any], int]:
    start = log_path.stat().st_size if log_path.exists() else 0
    command = tied([*embedded.server_command(), *args])
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of the test run is not the server's
        )
    return proc, _wait_listening(proc, log_path, start)


class WireServer:
    """One server process on 127.0.0.1 with a password user; its data survives restarts."""

    def __init__(self, db_path: Path, port: int | None = None) -> None:
        self.db_path = db_path  # the WiredTiger directory
        self.port = port or free_port()
        self.proc: subprocess.Popen[Any] | None = None
        self.log_path = db_path.with_suffix(".log")
        self.provisioned = False

    def uri(self, user: str = USER, password: str = PASSWORD) -> str:
        return (
            f"mongodb://{user}:{password}@127.0.0.1:{self.port}/?authSource=admin"
            f"&authMechanism=SCRAM-SHA-256&{CLIENT_OPTIONS}"
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _args(self, port: int, auth: bool) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(port), "--storage-path", str(self.db_path),
                "--enable-test-commands", "--cache-size", "256M", "--sync-on-commit",
                *(["--auth"] if auth else [])]  # fmt: skip

    def start(self) -> WireServer:
        # The user, made once on a server without auth. A server that does not stop on SIGTERM (its
        # shutdown wedged on a loaded machine) is killed, and the user looked for again on a new one.
        for _ in range(3):
            if self.provisioned:
                break
            import pymongo

            proc, port = _spawn(self._args(0, auth=False), self.log_path)
            try:
                with pymongo.MongoClient(port=port, serverSelectionTimeoutMS=30000) as client:
                    if not client.admin.command("usersInfo", USER)["users"]:  # kept data: made before
                        client.admin.command(
                            "createUser", USER, pwd=PASSWORD, roles=[{"role": "root", "db": "admin"}]
                        )
            finally:
                proc.terminate()
                try:
                    proc.wait(deadline(30))
                    self.provisioned = True
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(deadline(10))
        if not self.provisioned:
            said = self.log_path.read_text()[-2000:]
            raise RuntimeError(f"the wire server never stopped on SIGTERM: {said}")
        self.proc, _ = _spawn(self._args(self.port, auth=True), self.log_path)
        return self

    def kill(self) -> None:
        """SIGKILL: a crash, as a server lost to the network looks to a client."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(deadline(10))
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        os.kill(self.pid, signal.SIGSTOP)

    def wait_stopped(self, timeout: float = 5.0) -> bool:
        """Whether the server's process is stopped (a SIGSTOP reaches it asynchronously), waiting up to
        ``timeout`` seconds for it."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            try:
                state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                return True  # no /proc here: trust the signal
            if state in ("T", "t"):
                return True
            time.sleep(0.01)
        return False

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def restart(self) -> WireServer:
        self.kill()
        return self.start()

    def fail(self, mode: Any, **data: Any) -> None:
        """Arm (or with ``mode="off"`` disarm) the ``failCommand`` fail point for dsgpt2's clients."""
        fail_point(self.uri(), mode, **data)


def fail_point(uri: str, mode: Any, **data: Any) -> None:
    """``configureFailPoint failCommand`` on the server of ``uri``, for the clients named dsgpt2 only
    (the test's own client is not failed)."""
    import pymongo

    with pymongo.MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
        client.admin.command(
            "configureFailPoint", "failCommand", mode=mode, data={"appName": "dsgpt2", **data}
        )


_SHARED: dict[str, Any] = {}


def shared_started() -> bool:
    return "uri" in _SHARED


def shared_server() -> str:
    """The connection string of this process's in-memory test server (started on first use, without
    auth, stopped when the process ends)."""
    if "uri" not in _SHARED:
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dsgpt2-test-server-{os.getpid()}.log"
        proc, port = _spawn(
            ["--host", "127.0.0.1", "--port", "0", "--storage-path", ":memory:", "--enable-test-commands",
             "--cache-size", "256M"],
            log_path,
        )  # fmt: skip
        _SHARED.update(proc=proc, uri=f"mongodb://127.0.0.1:{port}/?{CLIENT_OPTIONS}")

        owner = os.getpid()

        def stop() -> None:
            if os.getpid() != owner:  # a forked child (a command run from the zygote) leaves it alone
                return
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            with contextlib.suppress(OSError):
                log_path.unlink()

        atexit.register(stop)
    return str(_SHARED["uri"])


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
