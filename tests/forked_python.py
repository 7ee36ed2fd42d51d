"""``python [-u] SCRIPT ARGS`` / ``python [-u] -m MODULE ARGS`` run as a fork of tests/zygote.py's fork
server, for the processes the `deepspeed` launcher starts (its node launcher and every rank).

The fork server writes this file, behind a ``#!PYTHON -S`` line and its two constants, as ``python`` in a
directory that mirrors the environment's ``bin``; the forks it makes see that file as ``sys.executable``, so
the launcher's own ``sys.executable -u -m deepspeed.launcher.launch`` and each rank's ``sys.executable -u
SCRIPT`` come back here. This process stays the one its parent started: it passes its stdin, stdout and
stderr, environment, working directory and arguments to the server, passes on every signal a launcher or
scheduler sends (SIGINT, SIGTERM, ...) to the fork, and ends as the fork ended (its exit code, or killed by
the same signal). Killed itself (SIGKILL), the fork dies with it: its end of the connection raises
SIGIO there. Any other form of command line (``-c``, ``-X``, multiprocessing's spawn) runs the real
interpreter in place.

Standard library only, imported without site: this start costs a few milliseconds, not torch's seconds.
"""

import json
import os
import signal
import socket
import sys

SOCKET = globals().get("SOCKET", "")
PYTHON = globals().get("PYTHON", sys.executable)
PASSED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forkable(argv: list[str]) -> bool:
    """``[-u] SCRIPT ...`` or ``[-u] -m MODULE ...``: what a fork runs as ``python`` would."""
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if rest[:1] == ["-m"]:
        return len(rest) > 1
    return bool(rest) and not rest[0].startswith("-") and "--multiprocessing-fork" not in rest


def main() -> None:
    argv = sys.argv[1:]
    if not SOCKET or not forkable(argv):
        os.execv(PYTHON, [PYTHON, *argv])
    # A signal before the fork's pid is known is passed on once it is.
    fork: list[int] = []
    pending: list[int] = []

    def pass_on(signum: int, _frame: object) -> None:
        if fork:
            os.kill(fork[0], signum)
        else:
            pending.append(signum)

    for sig in PASSED:
        signal.signal(sig, pass_on)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError:  # the server is gone (its test worker ended): a real interpreter does the same
        os.execv(PYTHON, [PYTHON, *argv])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [0, 1, 2])
    replies = conn.makefile("r")
    fork.append(json.loads(replies.readline())["pid"])
    while pending:
        os.kill(fork[0], pending.pop(0))
    line = replies.readline()
    status = json.loads(line)["status"] if line else -signal.SIGKILL
    code = os.waitstatus_to_exitcode(status) if line else status
    if code < 0:  # killed by a signal: the same end here
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
