"""The `deepspeed` launcher's processes as forks of one pre-imported interpreter, many at once.

A two-rank launch starts four Python processes (the launcher, its node launcher, two ranks), each
importing torch and DeepSpeed, and the ranks transformers too: ~20 of the ~28 CPU seconds a short
launch costs. ``python_that_forks()`` names a ``python`` (tests/forked_python.py) that has a fork of this
server run each of them as that interpreter would: its own arguments, environment, working directory,
stdin/stdout/stderr, signals and exit. Given as the launcher's interpreter
(``[python_that_forks(), deepspeed_script, ...]``), every process of the launch is a fork. The model
commands of ``zygote.run_python`` and the ``dsgpt2 serve`` servers of tests/serving.py are forks of the
same server: one interpreter holding torch per test worker.

Launches that kill process groups (a node lost, ``--kill_group_after``) or look processes up by
parent keep real ones: a fork belongs to this server's group, not the launch's.

    python tests/zygote.py forks DIR   # the server: DIR/bin/python, DIR/forks.sock
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _mirror_bin(directory: Path, sock: Path) -> Path:
    """``directory/bin``: the environment's bin with tests/forked_python.py as its Pythons; the code that
    looks beside ``sys.executable`` (ninja, the embedded database server) finds its files. Its console
    scripts (``dsgpt2``, ``deepspeed``, ...) start with this ``python``: on ``PATH`` (a pipeline's
    commands), they are forks too. Everything else is a link."""
    own = Path(sys.executable).parent
    bin_dir = directory / "bin"
    bin_dir.mkdir(parents=True)
    client = f"#!{sys.executable} -S\nSOCKET = {str(sock)!r}\nPYTHON = {sys.executable!r}\n"
    client += (HERE / "forked_python.py").read_text()
    pythons = {"python", "python3", f"python3.{sys.version_info.minor}"}
    shebangs = {f"#!{own / name}\n".encode() for name in pythons}
    for entry in own.iterdir():
        if entry.name in pythons:
            continue
        first = b""
        if entry.is_file():
            with open(entry, "rb") as f:
                first = f.readline(200)
        if first in shebangs:
            script = entry.read_bytes().split(b"\n", 1)[1]
            (bin_dir / entry.name).write_bytes(f"#!{bin_dir / 'python'}\n".encode() + script)
            (bin_dir / entry.name).chmod(0o755)
        else:
            (bin_dir / entry.name).symlink_to(entry)
    for name in pythons:
        (bin_dir / name).write_text(client)
        (bin_dir / name).chmod(0o755)
    return bin_dir / "python"


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the caller left mid-request")
        data += more
    return json.loads(data[8:]), fds


def _stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on fds 0-2 as a new interpreter makes them (``-u``: unbuffered)."""
    import io

    def writer(fd: int, errors: str, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        buffered = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=sys.stdout.encoding, errors=errors,  # type: ignore[arg-type]
                                write_through=unbuffered, line_buffering=line and not unbuffered)  # fmt: skip

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = writer(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = writer(2, "backslashreplace", True)


def _forked(conn: socket.socket, request: dict[str, Any], fds: list[int], python: Path) -> None:
    """In the fork: become ``python ARGV``, then end as that interpreter would (zygote.run_main)."""
    import fcntl
    import select

    from zygote import run_main

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    # The caller killed: its end closes, which raises SIGIO here, whose default ends this process.
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, fcntl.fcntl(conn.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0]:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGIO,
                signal.SIGCHLD):  # fmt: skip
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.executable = str(python)
    argv = request["argv"]
    unbuffered = argv[0] == "-u"
    argv = argv[1:] if unbuffered else argv
    _stdio(unbuffered)
    run_main(argv)


def serve_forks(directory: Path, reply: Any) -> None:
    """Accept callers on ``directory/forks.sock`` and fork one process each, any number at once; reply
    each its fork's pid, then its wait status. Ends (its forks killed) when stdin closes."""
    import multiprocessing.spawn  # noqa: F401 - its interpreter stays the real one (before sys.executable moves)

    sock_path = directory / "forks.sock"
    python = _mirror_bin(directory, sock_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(0, selectors.EVENT_READ, "stdin")
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, caller)
    reply.write("ready\n")
    reply.flush()
    while True:
        for key, _ in selector.select():
            if key.data == "stdin":
                if not os.read(0, 4096):
                    for pid, _ in running.values():
                        os.kill(pid, signal.SIGKILL)
                    return
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    for pidfd, (_, other) in running.items():
                        os.close(pidfd)
                        other.close()
                    _forked(conn, request, fds, python)
                for fd in fds:
                    os.close(fd)
                # The caller gone, its fork has its SIGIO.
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (pid, conn)
                selector.register(pidfd, selectors.EVENT_READ, "exit")
            else:
                pid, conn = running.pop(key.fd)
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"status": status}) + "\n").encode())
                conn.close()


_server: list[Any] = []  # the server (tests/zygote.py Zygote), its python


def python_that_forks() -> str:
    """The ``python`` whose commands are forks of this test process's fork server (started on first
    use, once per test process, ended at its exit)."""
    if not _server:
        import atexit
        import tempfile

        from zygote import Zygote

        # A UNIX socket's path holds at most 107 bytes: a long TMPDIR is passed over for /tmp.
        where = None if len(tempfile.gettempdir()) < 64 else "/tmp"
        directory = Path(tempfile.mkdtemp(prefix="dsgpt2-forks-", dir=where))
        _server.extend((Zygote("forks", str(directory)), directory / "bin" / "python"))

        def close() -> None:
            _server[0].close()
            shutil.rmtree(directory, ignore_errors=True)

        atexit.register(close)
    return str(_server[1])
