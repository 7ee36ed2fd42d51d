"""The embedded database servers this user runs, read from /proc (none elsewhere): which databases,
the processes connected to one, its memory. ``dsgpt2 db status`` and ``dsgpt2 db stop`` report them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from dsgpt2.db import embedded, procfs


def servers() -> list[Path]:
    """The database directories whose servers this user runs now, read from /proc (none elsewhere)."""
    found: set[Path] = set()
    for pid, words in procfs.own_processes():
        data = embedded.served_data(words)
        if data is None:
            continue
        database = data.parent
        ours = data.name == "data" and (database / embedded.MARKER).exists()
        if ours and embedded.is_server(pid, database):
            found.add(database)
    return sorted(found)


def clients(state: embedded.ServerState) -> list[tuple[int, str]]:
    """The processes of this user connected to the server of ``state`` now, as ``(pid, command line)``,
    read from /proc (none elsewhere)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                # A client's end: established (01), its remote port the server's.
                if (
                    len(fields) > 9
                    and fields[3] == "01"
                    and int(fields[2].rsplit(":", 1)[1], 16) == state.port
                ):
                    sockets.add(f"socket:[{fields[9]}]")
    found = []
    for entry in Path("/proc").iterdir() if sockets else []:
        if not entry.name.isdigit() or int(entry.name) in (state.pid, os.getpid()):
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            if any(os.readlink(fd) in sockets for fd in (entry / "fd").iterdir()):
                words = (entry / "cmdline").read_bytes().split(b"\0")
                found.append((int(entry.name), " ".join(os.fsdecode(w) for w in words if w)[:80]))
        except OSError:
            continue
    return sorted(found)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None
