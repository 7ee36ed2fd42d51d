"""How a command ends: a user error is one line and its exit code, Ctrl-C is 130, a bug a traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from dsgpt2.db.config import ENV_URI, scrub
from dsgpt2.errors import DsGpt2Error
from dsgpt2.settings.runfile import name_file_values


def run_command(prog: str, command: Callable[[], int]) -> int:
    """``command()``'s exit code; a :class:`DsGpt2Error` prints ``prog: error: MESSAGE`` (the password
    scrubbed) and returns its code, an interrupt prints one line and returns 130."""
    try:
        return command()
    except DsGpt2Error as exc:
        # Messages are scrubbed where they are made; this is the last line of defence.
        message = name_file_values(str(exc))
        print(f"{prog}: error: {scrub(message, os.environ.get(ENV_URI, ''))}", file=sys.stderr)
        return exc.exit_code
    except PermissionError as exc:
        # The machine's, not the command's: a file or directory this user may not read or write.
        where = f" {exc.filename}" if exc.filename else ""
        print(f"{prog}: error: cannot use{where}: {exc.strerror}; check its owner and mode", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if not out_of_memory(exc):
            raise
        # The machine's limit, not a bug: what was asked, and the knobs that ask less.
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"{prog}: error: out of memory ({said[:300]}); ask for less: a shorter --context_length, a "
            "smaller micro-batch or model, fewer sequences at once",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:
        if not server_internal_error(exc):
            raise
        # The server's own failure, not the command's: on the embedded server, its files damaged.
        print(
            f"{prog}: error: the database server failed a command with an internal error "
            f"({(getattr(exc, 'details', None) or {}).get('errmsg', 'InternalError')}); "
            "its data may be damaged: a local:// database's server.log (in its directory) names what it "
            "could not read; restore that directory from a copy, or ingest again into a new one",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        # Before training started (or a second Ctrl-C): nothing to save yet, or asked not to.
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def ignore_late_interrupts() -> None:
    """The command has ended, its line said: a Ctrl-C while the interpreter closes down (pymongo's
    threads joined at exit) would print a traceback under a finished command, and change nothing."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed (host or device), as torch and Python say it."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def server_internal_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's InternalError (code 1): what the embedded server answers a read of
    a table file it cannot use (truncated, a byte changed)."""
    return type(exc).__name__ == "OperationFailure" and getattr(exc, "code", None) == 1
