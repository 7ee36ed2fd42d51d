# SPDX-License-Identifier: GPL-2.0-only
# This file alone is under the GPL-2.0 (SecantusDB's licence): it extends SecantusDB's server, and is a
# program of its own that dsgpt2 runs in the server's process and never imports.
"""The embedded server's entry point: SecantusDB's own ``secantusd-py``, less two held read snapshots.

Run as a script by the Python that has SecantusDB installed (``embedded.server_command``), in the
server's process; it imports nothing of dsgpt2, so it also runs in an environment of its own.

WiredTiger keeps every older version of a record that some open read snapshot may still see, in its
history store (``WiredTigerHS.wt``), and never gives that file's space back. Two threads of the stock
server hold a snapshot while they wait:

- the thread that builds the server: the store's constructor reads its metadata and leaves that
  read's cursor positioned, then the thread only waits for a signal. Every version written for the
  server's whole life was kept: 20 curation passes over 9,199 documents left a 483 MB history file
  beside a 29 MB collection, and the server's memory grew with it;
- the TTL sweeper, between its sweeps (a minute). dsgpt2 makes no TTL index, so it does not run.

With ``DSGPT2_DB_IDLE_STOP`` seconds in its environment (``embedded`` passes it on), the server stops
itself, as ``dsgpt2 db stop`` would, once no client has been connected for that long: every process
of the machine that uses the database holds a connection while it runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

from secantus import cli
from secantus.server import SecantusDBServer


class Server(SecantusDBServer):
    """SecantusDB's server whose building thread keeps no read snapshot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["ttl_sweep_seconds"] = 0
        super().__init__(*args, **kwargs)

    def start(self) -> None:
        super().start()
        self.storage.release_thread_snapshot()
        idle_s = float(os.environ.get("DSGPT2_DB_IDLE_STOP") or 0)
        if idle_s > 0:
            watch = threading.Thread(target=self._stop_when_idle, args=(idle_s,), daemon=True)
            watch.start()

    def _stop_when_idle(self, idle_s: float) -> None:
        quiet_since = time.monotonic()
        while True:
            time.sleep(min(idle_s / 4, 5.0))
            if len(self.connections):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= idle_s:
                print(f"dsgpt2: no client for {idle_s:.0f} s: the server stops", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # the server's own handler: a clean stop
                return


def main(argv: list[str] | None = None) -> int:
    """Run the server with ``secantusd-py``'s flags."""
    cli.SecantusDBServer = Server
    return int(cli.main(argv))


if __name__ == "__main__":
    sys.exit(main())
