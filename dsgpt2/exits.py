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
    except KeyboardInterrupt:
        # Before training started (or a second Ctrl-C): nothing to save yet, or asked not to.
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
