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
"""

from __future__ import annotations

import sys
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


def main(argv: list[str] | None = None) -> int:
    """Run the server with ``secantusd-py``'s flags."""
    cli.SecantusDBServer = Server
    return int(cli.main(argv))


if __name__ == "__main__":
    sys.exit(main())
