# SPDX-License-Identifier: GPL-2.0-only
# This file alone is under the GPL-2.0 (SecantusDB's licence): it extends SecantusDB's server, and is a
# program of its own that dsgpt2 runs in the server's process and never imports.
"""The embedded server's entry point: SecantusDB's own ``secantusd-py``, less two held read snapshots and
the oplog.

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

An update rewrites only the index entries that change (:func:`keep_unchanged_index_entries`).

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
from secantus import storage as engine
from secantus.query import matches
from secantus.server import SecantusDBServer

_delete_entries = engine.Storage._delete_index_entries
_write_entries = engine.Storage._write_index_entries
_delete_row = engine.Storage._delete_doc_row
# The entries the first half of a statement (an update's or a delete's) left to remove, by thread:
# (storage, db, collection, record id, document, indexes, partial filters).
_held = threading.local()


def _take(storage: Any, db: str, coll: str, recordid: int) -> tuple[Any, ...] | None:
    """What :data:`_held` holds for this record, now taken. Anything else there was left by a statement
    that failed between its halves, whose transaction was rolled back: dropped, never applied."""
    held, _held.entry = getattr(_held, "entry", None), None
    if held is not None and held[0] is storage and held[1:4] == (db, coll, recordid):
        return held
    return None


def _identical(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (``1``, ``1.0`` and ``True`` are equal in Python, and
    not as BSON index keys)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_identical, a, b))
    return bool(a == b)


_ABSENT = object()


def _same_entries(index: tuple[Any, ...], old: Any, new: Any, partials: dict[str, Any]) -> bool:
    """Whether ``old`` and ``new`` (one record before and after an update) have the same entries in
    ``index``: an ascending/descending index whose fields' top-level values are identical in both, in or
    out of its partial filter alike. Other kinds (geo, wildcard) count as changed."""
    name, key_spec = index[0], index[1]
    for field, kind in key_spec.items():
        if not isinstance(kind, (int, float)) or field.startswith("$"):
            return False
        top = field.split(".", 1)[0]
        if not _identical(old.get(top, _ABSENT), new.get(top, _ABSENT)):
            return False
    partial = partials.get(name)
    return partial is None or matches(old, partial) == matches(new, partial)


def _hold_entries(self: Any, db: str, coll: str, doc: Any, indexes: Any, partials: Any = None, *,
                  recordid: int) -> None:  # fmt: skip
    _held.entry = (self, db, coll, recordid, doc, indexes, partials)


def _write_changed_entries(self: Any, db: str, coll: str, doc: Any, indexes: Any, partials: Any = None, *,
                           recordid: int) -> None:  # fmt: skip
    held = _take(self, db, coll, recordid)
    if held is None:  # an insert
        _write_entries(self, db, coll, doc, indexes, partials, recordid=recordid)
        return
    old, old_indexes, old_partials = held[4:7]
    partials = self._partial_filters(db, coll) if partials is None else partials
    if [i[0] for i in old_indexes] != [i[0] for i in indexes]:  # not one statement's: every entry
        _delete_entries(self, db, coll, old, old_indexes, old_partials, recordid=recordid)
        _write_entries(self, db, coll, doc, indexes, partials, recordid=recordid)
        return
    changed = [i for i in indexes if not _same_entries(i, old, doc, partials)]
    _delete_entries(self, db, coll, old, changed, partials, recordid=recordid)
    _write_entries(self, db, coll, doc, changed, partials, recordid=recordid)


def _delete_row_and_entries(self: Any, db: str, coll: str, recordid: int) -> None:
    held = _take(self, db, coll, recordid)
    if held is not None:
        _delete_entries(self, db, coll, held[4], held[5], held[6], recordid=recordid)
    _delete_row(self, db, coll, recordid)


def keep_unchanged_index_entries() -> None:
    """Make an update rewrite only the index entries that change, as mongod does.

    The stock engine removes every index entry of a record it updates, then writes all of them again:
    a pass that sets one field of each document rewrote the ``lsh`` index's 18 entries and the text
    hash's of each, keys spread over the whole index (measured at 20,000 documents: 2.0 ms an updated
    document against 0.6 with the idx index alone), and more as the indexes outgrow the cache. Both
    halves of each statement run in its one transaction, the removal first: it is held until the
    record is written again (an update: only the indexes whose entries differ are removed and written)
    or its row is removed (a delete: every entry, as before).
    """
    engine.Storage._delete_index_entries = _hold_entries
    engine.Storage._write_index_entries = _write_changed_entries
    engine.Storage._delete_doc_row = _delete_row_and_entries


class Server(SecantusDBServer):
    """SecantusDB's server whose building thread keeps no read snapshot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["ttl_sweep_seconds"] = 0
        super().__init__(*args, **kwargs)
        # The oplog serves change streams, which dsgpt2 does not open. The server still says it is a
        # replica set's primary (drivers run transactions only on one), and writes no oplog: each commit
        # of the stock server also pruned its oldest entries, a walk over the deleted ones that WiredTiger
        # had not yet cleared, which grew with the writes since its last checkpoint.
        self.storage.enable_oplog = False

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
    keep_unchanged_index_entries()
    return int(cli.main(argv))


if __name__ == "__main__":
    sys.exit(main())
