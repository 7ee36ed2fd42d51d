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

Besides: an update rewrites only the index entries that change (:func:`keep_unchanged_index_entries`); an
index built over existing documents is written in key order (:func:`build_indexes_in_key_order`); an
``$in`` of ints, strings or ObjectIds is matched by set lookups (:func:`match_in_lists_by_set`); a
transaction idle for :data:`TRANSACTION_IDLE_S` is aborted; ``compact`` gives the space of rewritten
records back to the file system (:func:`serve_compact`).

With ``DSGPT2_DB_ADVERTISE`` in its environment, the server names that host as its address in its
``hello`` replies (it listens on every interface; other hosts reach it by that name).

With ``DSGPT2_DB_IDLE_STOP`` seconds in its environment (``embedded`` passes it on), the server stops
itself, as ``dsgpt2 db stop`` would, once no client has been connected for that long: every process
of the machine that uses the database holds a connection while it runs.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import signal
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import bson
import wiredtiger
from secantus import cli, commands, query
from secantus import storage as engine
from secantus.query import matches
from secantus.server import SecantusDBServer

_delete_entries = engine.Storage._delete_index_entries
_write_entries = engine.Storage._write_index_entries
_delete_row = engine.Storage._delete_doc_row
_create_index = engine.Storage.create_index
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


# An index build sorts this many entries in memory at a time (about 60 MB of short keys); a longer build
# spills each sorted run to a file beside the database and merges them.
_RUN = 1 << 20
_TXN = 10_000  # entries a transaction: one durable commit each, never one a key


def _plain(key_spec: Any, options: dict[str, Any]) -> bool:
    """An ascending/descending index that no unique claim, collation, geo or wildcard key complicates."""
    return (
        not options.get("unique")
        and options.get("collation") is None
        and bool(key_spec)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in key_spec.values())
        and not any(f.startswith("$") or "$**" in f for f in key_spec)
    )


def _spill(run: list[bytes], f: IO[bytes]) -> IO[bytes]:
    run.sort()
    for entry in run:
        f.write(struct.pack(">I", len(entry)))
        f.write(entry)
    f.seek(0)
    run.clear()
    return f


def _read_run(f: IO[bytes]) -> Iterator[bytes]:
    while head := f.read(4):
        yield f.read(struct.unpack(">I", head)[0])


def _write_in_key_order(self: Any, db: str, coll: str, name: str, entries: Iterator[bytes]) -> None:
    """Every entry of ``name`` that a killed build left is removed, then ``entries`` written, ``_TXN`` a
    transaction."""
    while True:
        with self._batch_transaction():
            c = self._cursor(engine._IDX_ENTRIES_TABLE)
            c.set_key(db, coll, name, b"")
            end, removed = engine.wt.WT_NOTFOUND, 0
            found = c.search_near()
            if found < 0:
                found = c.next()
            while found != end and removed < _TXN and tuple(c.get_key()[:3]) == (db, coll, name):
                c.remove()
                removed += 1
                found = c.next()
        if removed < _TXN:
            break
    done = False
    while not done:
        with self._batch_transaction():
            c = self._cursor(engine._IDX_ENTRIES_TABLE)
            for _ in range(_TXN):
                entry = next(entries, None)
                if entry is None:
                    done = True
                    break
                c[db, coll, name, entry] = b""


def _create_index_in_key_order(self: Any, db: str, coll: str, name: str, key_spec: Any,
                               options: Any = None) -> bool:  # fmt: skip
    options = dict(options or {})
    if name == engine._ID_INDEX_NAME or not _plain(key_spec, options):
        return bool(_create_index(self, db, coll, name, key_spec, options))
    with self._coll_lock(db, coll), self._lock:
        self._refresh_read_snapshot()
        catalog = self._cursor(engine._IDX_TABLE)
        catalog.set_key(db, coll, name)
        if catalog.search() == 0:  # it exists: the stock checks of a second request
            return bool(_create_index(self, db, coll, name, key_spec, options))
        self._ensure_collection(db, coll)
        key_spec = dict(key_spec)
        sparse = bool(options.get("sparse"))
        partial = options.get("partialFilterExpression")
        partial = partial if isinstance(partial, dict) and partial else None
        multikey, run, spilled = False, [], []
        with contextlib.ExitStack() as files:
            for recordid, _id_key, blob in self._scan_docs(db, coll):
                engine._deadline.check()  # a createIndexes' maxTimeMS
                doc = bson.decode(blob)
                if partial is not None and not matches(doc, partial):
                    continue
                multikey = multikey or engine._doc_makes_multikey(doc, key_spec)
                for kb in engine._index_key_variants(doc, key_spec, sparse=sparse):
                    run.append(engine._pack_entry(kb, recordid))
                if len(run) >= _RUN:
                    f = files.enter_context(tempfile.TemporaryFile(dir=self.home_path, prefix="index-build-"))
                    spilled.append(_spill(run, f))
            run.sort()
            entries = heapq.merge(run, *map(_read_run, spilled)) if spilled else iter(run)
            # The entries first, the catalog row last: a build killed half-way leaves no index that
            # answers for part of the documents, and the next build removes what it wrote.
            _write_in_key_order(self, db, coll, name, entries)
        if multikey:
            options["multikey"] = True
        options["entryFormat"] = engine._ENTRY_FORMAT
        catalog.reset()
        catalog[db, coll, name] = bson.encode({"key": key_spec, "options": options})
        ui = self._collection_uuid(db, coll)
        self._emit_oplog([{
            "op": "c", "ns": f"{db}.$cmd", "ui": bson.Binary(ui.bytes, subtype=4),
            "o": {"createIndexes": coll, "indexes": [{"v": 2, "key": key_spec, "name": name, **options}]},
        }])  # fmt: skip
        return True


def build_indexes_in_key_order() -> None:
    """Make an index built over existing documents write its entries sorted, as mongod's builds do.

    The stock build collects every entry in memory and writes them in the documents' order, each its own
    durable commit: the ``lsh`` index of 200,000 documents is 3.6 M keys spread over the whole index,
    so every write lands on a page of its own once the index outgrows the cache. Here the entries are
    sorted (runs beyond ``_RUN`` spilled to files and merged), written ``_TXN`` a transaction, and the
    index enters the catalog only once they all are. Unique, collated, geo and wildcard indexes keep
    the stock build.
    """
    engine.Storage.create_index = _create_index_in_key_order


_op_matches = query._op_matches
IN_LISTS_BY_SET = "dsgpt2InListsBySet"  # in buildInfo: an $in costs a set lookup a value here
# The last `$in` list of one type matched, by thread: (list, its type, its values as a set). The list is
# held, so no other list can take its identity while it is cached.
_in_sets = threading.local()
_NO_SET = (None, None, None)


def _value_set(values: list[Any]) -> tuple[Any, type | None, frozenset[Any] | None]:
    """``values``' type and set, where they are all ints (a bool is not), all strings or all ObjectIds;
    else Nones."""
    cached = getattr(_in_sets, "last", _NO_SET)
    if cached[0] is values:
        return cached
    kind = type(values[0]) if values else None
    if kind not in (int, str, bson.ObjectId) or not all(type(v) is kind for v in values):
        return _NO_SET
    _in_sets.last = (values, kind, frozenset(values))
    return _in_sets.last


def _in_by_set(values: list[Any], kind: type, wanted: frozenset[Any], descend: bool) -> bool | None:
    """Whether one of the field's ``values`` (or an element of an array among them) is in ``wanted``;
    None where one is of another type than ``kind``, which the stock operator then compares."""
    for v in values:
        if type(v) is kind:
            if v in wanted:
                return True
        elif type(v) is list and descend:
            for e in v:
                if type(e) is not kind:
                    return None
                if e in wanted:
                    return True
        elif v is not query.MISSING:
            return None
    return False


def _op_matches_in_by_set(values: list[Any], op: str, arg: Any, collation: Any = None, **kwargs: Any) -> bool:
    """``_op_matches`` with an ``$in`` of ints, strings or ObjectIds answered by set lookups where the field's
    values are of the list's type: the stock operator compares each value with every value of the list
    in turn, so a query of k values costs k^2 comparisons."""
    if op == "$in" and type(arg) is list:
        _, kind, wanted = _value_set(arg)
        if wanted is not None and (kind is not str or collation is None):
            found = _in_by_set(values, kind, wanted, kwargs.get("descend", True))
            if found is not None:
                return found
    return bool(_op_matches(values, op, arg, collation, **kwargs))


def match_in_lists_by_set() -> None:
    """Make an ``$in`` of ints, strings or ObjectIds cost a set lookup a value, as on mongod (which looks each
    value up in a set built once), instead of a comparison with each value of the list: the training
    feed reads a spread chunk by its ``idx`` values, the passes look up hashes and bands by theirs. A
    list of other or mixed types, a value of another type (a float, a document), a collated string
    keep the stock operator. The server's buildInfo says so (:data:`IN_LISTS_BY_SET`), and dsgpt2 then
    sends a chunk's list whole, as to mongod."""
    query._op_matches = _op_matches_in_by_set
    build_info = commands._HANDLERS["buildInfo"]

    def build_info_by_set(doc: Any, ctx: Any) -> dict[str, Any]:
        return {**build_info(doc, ctx), IN_LISTS_BY_SET: True}

    for name in ("buildInfo", "buildinfo"):
        commands._HANDLERS[name] = build_info_by_set


COMPACT_TRIES = 30  # WiredTiger refuses a compact while a checkpoint runs: tried again a second later


def _data_bytes(home: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(home) if entry.name.endswith(".wt"))


def _compact(doc: Any, ctx: Any) -> dict[str, Any]:
    """mongod's ``compact``, for the whole store: the collections share their tables here. WiredTiger
    reuses the space of rewritten records but never gives it back to the file system by itself; a
    compaction moves the blocks at the end of each file into that space and cuts the files short.
    Readers and writers go on meanwhile."""
    storage = ctx.storage
    before = _data_bytes(storage.home_path)
    storage.checkpoint()  # what was rewritten since the last one becomes space a compaction can fill
    session = storage._conn.open_session()
    try:
        cursor = session.open_cursor("metadata:", None, None)
        tables = [key for key, _ in cursor if key.startswith("table:")]
        cursor.close()
        for uri in tables:
            for attempt in range(COMPACT_TRIES):
                try:
                    session.compact(uri, "timeout=0")
                    break
                except wiredtiger.WiredTigerError as exc:
                    if "busy" not in str(exc).lower() or attempt == COMPACT_TRIES - 1:
                        raise
                    time.sleep(1.0)
    finally:
        session.close()
    storage.checkpoint()
    return {"bytesFreed": max(0, before - _data_bytes(storage.home_path)), "ok": 1.0}


def serve_compact() -> None:
    """Answer mongod's ``compact`` command (any collection name: the store is compacted whole), which
    ``dsgpt2 db compact`` sends; with authentication on it takes ``fsync``'s cluster-wide privilege."""
    commands._HANDLERS["compact"] = _compact
    commands._COMMAND_ACTIONS["compact"] = commands._COMMAND_ACTIONS["fsync"]


TRANSACTION_IDLE_S = 10.0


class Server(SecantusDBServer):
    """SecantusDB's server whose building thread keeps no read snapshot."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["ttl_sweep_seconds"] = 0
        # A transaction idle this long is aborted. Its client is gone: dsgpt2 sends a batch's statements
        # and its commit back to back, and a transaction aborted under a slow one is retried whole by
        # the driver. A pass killed mid-batch leaves its transaction open (a session outlives its
        # connections), and the re-run's writes to the same documents wait until it is aborted: a
        # minute with mongod's 60 s.
        kwargs["transaction_lifetime_seconds"] = TRANSACTION_IDLE_S
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

    @property
    def address(self) -> tuple[str, int]:
        """The address the server names as its replica set's one member (``hello``'s ``hosts``, ``me``
        and ``primary``), where drivers connect after their first reply: ``DSGPT2_DB_ADVERTISE`` where
        set (the name other hosts reach a server listening on every interface by), else the bound one."""
        host, port = super().address
        return os.environ.get("DSGPT2_DB_ADVERTISE") or host, port

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
    build_indexes_in_key_order()
    match_in_lists_by_set()
    serve_compact()
    return int(cli.main(argv))


if __name__ == "__main__":
    sys.exit(main())
