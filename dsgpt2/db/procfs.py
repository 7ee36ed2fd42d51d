"""Processes as Linux's /proc tells them (nothing elsewhere): a process's state and start time, whether
it is alive, this user's processes and their command lines; and stopping one, SIGTERM then SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first, start time at [19])."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 19 else None


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in /proc's clock ticks since boot, None where /proc does not tell."""
    fields = stat(pid)
    return None if fields is None else int(fields[19])


def alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child: reap it
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    fields = stat(pid)  # a zombie has let go of everything
    return fields is None or fields[0] != "Z"


def terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM (a server closes its files cleanly), SIGKILL if it is still there after ``timeout_s``."""
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.05)


def own_processes() -> Iterator[tuple[int, list[bytes]]]:
    """This user's processes as ``(pid, command line words)``, but this one (none where there is no /proc)."""
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        yield int(entry.name), words
