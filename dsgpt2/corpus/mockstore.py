"""The in-process ``mongomock://`` backend used by the tests and the demo.

This is a convenience for machines without a MongoDB server, not a storage
engine. ``mongomock://`` is an in-memory store shared by every client of the
process (a forked child gets a copy). ``mongomock://PATH`` also persists the
store in the file PATH, so that separate processes (the bash pipelines, a
killed and re-run ingest) see the same database: each client loads the latest
saved snapshot, and :func:`save` writes a whole new snapshot atomically at the
commit points of the toolkit (after each ingest batch, after a meta update).
One writing process at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import bson
import mongomock
from bson.raw_bson import RawBSONDocument
from mongomock import helpers as _mm_helpers
from mongomock.collection import Collection as _MockCollection
from mongomock.store import ServerStore

from dsgpt2.corpus.documents import utf8_encodable
from dsgpt2.files import atomic_writer

PREFIX = "mongomock://"

_MEMORY: dict[str, ServerStore] = {}
# path → (store, (mtime_ns, size) of the snapshot the store reflects)
_FILES: dict[str, tuple[ServerStore, tuple[int, int] | None]] = {}


def store_path(uri: str) -> str | None:
    """The snapshot file of a ``mongomock://`` URI, or None for the pure in-memory store."""
    rest = uri[len(PREFIX) :]
    return os.path.abspath(os.path.expanduser(rest)) if rest else None


FAULT_ENV = "DSGPT2_MOCKSTORE_FAULT"


def client_for(uri: str) -> mongomock.MongoClient:
    """A mongomock client on the store that ``uri`` names, loading its file if it changed."""
    _install_fast_unique_inserts()
    _install_fast_in()
    _install_pymongo_checks()
    _install_faults(os.environ.get(FAULT_ENV, ""))
    path = store_path(uri)
    if path is None:
        store = _MEMORY.setdefault("", ServerStore())
    else:
        store, seen = _FILES.get(path, (None, None))
        stamp = _stamp(path)
        if store is None or (stamp is not None and stamp != seen):
            store = _load(path)
            _FILES[path] = (store, stamp)
    return mongomock.MongoClient(_store=store)


def save(uri: str) -> None:
    """Write the store of a file-backed URI to its file (atomically); no-op in memory."""
    path = store_path(uri)
    if path is None or path not in _FILES:
        return
    store, _ = _FILES[path]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        _remove_stale_snapshots(path)
        with atomic_writer(path, "wb", prefix=_snapshot_prefix(path)) as f:
            for record in _dump(store):
                f.write(bson.encode(record))
    _FILES[path] = (store, _stamp(path))


def _snapshot_prefix(path: str) -> str:
    return f".{os.path.basename(path)}.snapshot-"


def _remove_stale_snapshots(path: str) -> None:
    """Under the lock, a temporary snapshot is one a writer was killed before renaming."""
    for stale in Path(path).parent.glob(_snapshot_prefix(path) + "*"):
        stale.unlink(missing_ok=True)


def reset(uri: str | None = None) -> None:
    """Forget in-process stores (all of them, or the one ``uri`` names); files stay."""
    if uri is None:
        _MEMORY.clear()
        _FILES.clear()
        return
    path = store_path(uri)
    if path is None:
        _MEMORY.pop("", None)
    else:
        _FILES.pop(path, None)


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_mtime_ns, st.st_size)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _dump(store: ServerStore) -> Iterable[dict[str, Any]]:
    client = mongomock.MongoClient(_store=store)
    for db_name in client.list_database_names():
        db = client[db_name]
        for name in db.list_collection_names():
            coll = db[name]
            indexes = [
                {
                    "name": n,
                    "key": [list(k) for k in info["key"]],
                    "unique": bool(info.get("unique")),
                    "sparse": bool(info.get("sparse")),
                }
                for n, info in coll.index_information().items()
                if n != "_id_"
            ]
            yield {"collection": [db_name, name], "indexes": indexes}
            for doc in coll.find({}):
                yield {"doc": doc}


def _load(path: str) -> ServerStore:
    store = ServerStore()
    client = mongomock.MongoClient(_store=store)
    if not os.path.exists(path):
        return store
    with _locked(path), open(path, "rb") as f:
        _remove_stale_snapshots(path)
        records = list(bson.decode_file_iter(f))
    pending: list[dict[str, Any]] = []
    target = None
    indexes: list[dict[str, Any]] = []

    def flush() -> None:
        if target is None:
            return
        if pending:
            target.insert_many(pending)
        else:
            target.database.create_collection(target.name)
        # Indexes after the documents: one uniqueness check instead of one per insert.
        for ix in indexes:
            options = {"sparse": True} if ix.get("sparse") else {}
            target.create_index(
                [tuple(k) for k in ix["key"]], name=ix["name"], unique=ix["unique"], **options
            )

    for record in records:
        if "collection" in record:
            flush()
            db_name, name = record["collection"]
            target, indexes, pending = client[db_name][name], record["indexes"], []
        else:
            pending.append(record["doc"])
    flush()
    return store


# mongomock checks a unique index by scanning the whole collection once per
# inserted document, which makes a bulk load quadratic (minutes for 10k
# documents). insert_many below checks the batch against the collection once,
# then inserts without the per-document scan; any doubt falls back to
# mongomock's own path so that errors keep mongomock's exact semantics.
_patch_lock = threading.Lock()
_unchecked = threading.local()


def _install_fast_in() -> None:
    """``{"idx": {"$in": [...]}}`` tested by set membership: mongomock tests each document against
    the whole list (a chunk's spread reading, 1,000 ids, took a second on 20,000 documents)."""
    from mongomock import filtering

    with _patch_lock:
        if getattr(filtering, "_dsgpt2_fast_in", False):
            return
        original = filtering._in_op
        # The list last asked and its set (one tuple, replaced whole: threads may query at once); a
        # query asks one list of every document it scans. Held, so no other list takes its id.
        last: list[tuple[Any, frozenset[int] | None]] = [(None, None)]

        def in_op(doc_val: Any, search_val: Any) -> bool:
            if type(doc_val) is int and isinstance(search_val, list):
                asked, ids = last[0]
                if asked is not search_val:
                    ids = frozenset(search_val) if all(type(x) is int for x in search_val) else None
                    last[0] = (search_val, ids)
                if ids is not None:
                    return doc_val in ids
            return original(doc_val, search_val)

        filtering._in_op = in_op
        filtering._filterer_inst._operator_map["$in"] = in_op
        filtering._filterer_inst._operator_map["$nin"] = lambda dv, sv: not in_op(dv, sv)
        filtering._dsgpt2_fast_in = True


def _install_fast_unique_inserts() -> None:
    with _patch_lock:
        if getattr(_MockCollection, "_dsgpt2_fast_unique", False):
            return
        original_ensure = _MockCollection._ensure_uniques
        original_insert_many = _MockCollection.insert_many

        def _ensure_uniques(self: _MockCollection, new_data: Any) -> None:
            if getattr(_unchecked, "store", None) is self._store:
                return
            original_ensure(self, new_data)

        def insert_many(self: _MockCollection, documents: Any, *args: Any, **kwargs: Any) -> Any:
            documents = list(documents) if isinstance(documents, Iterable) else documents
            if not documents or not _batch_is_unique(self, documents):
                return original_insert_many(self, documents, *args, **kwargs)
            _unchecked.store = self._store
            try:
                return original_insert_many(self, documents, *args, **kwargs)
            finally:
                _unchecked.store = None

        _MockCollection._ensure_uniques = _ensure_uniques
        _MockCollection.insert_many = insert_many
        _MockCollection._dsgpt2_fast_unique = True


def _batch_is_unique(coll: _MockCollection, documents: list[Any]) -> bool:
    """True when no unique index of ``coll`` is violated by ``documents``; False if unsure."""
    indexes = [ix for ix in coll._store.indexes.values() if ix.get("unique")]
    if any(ix.get("sparse") or ix.get("partialFilterExpression") for ix in indexes):
        return False
    try:
        for ix in indexes:
            fields = [k for k, _ in ix["key"]]
            seen = {_key(d, fields) for d in coll._store.documents}
            for d in documents:
                k = _key(d, fields)
                if k in seen:
                    return False
                seen.add(k)
    except TypeError:  # an unhashable key value (a dict or list): let mongomock decide
        return False
    return True


def _key(doc: Any, fields: list[str]) -> tuple[Any, ...]:
    out = []
    for name in fields:
        try:
            value = _mm_helpers.get_value_by_dot(doc, name)
        except KeyError:
            value = None
        # 7 and 7.0 collide in a set as they do in MongoDB; True and 1 must not.
        out.append((type(value) is bool, value))
    return tuple(out)


# Fault injection for tests that run whole processes (the trainer and its DataLoader
# workers): DSGPT2_MOCKSTORE_FAULT="after=N,count=K" makes find() raise AutoReconnect
# for calls N+1..N+K of each process (count=-1: from then on). Unset, nothing changes.
_fault_state = {"calls": 0, "after": 0, "count": 0}


def _install_faults(spec: str) -> None:
    if not spec or getattr(_MockCollection, "_dsgpt2_faults", False):
        return
    from pymongo.errors import AutoReconnect

    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    _fault_state.update(after=int(fields.get("after", 0)), count=int(fields.get("count", 1)))
    original_find = _MockCollection.find

    def find(self: _MockCollection, *args: Any, **kwargs: Any) -> Any:
        if self.name != "meta_info":
            _fault_state["calls"] += 1
            n, after, count = _fault_state["calls"], _fault_state["after"], _fault_state["count"]
            if n > after and (count < 0 or n <= after + count):
                raise AutoReconnect(f"injected fault on find #{n}")
        return original_find(self, *args, **kwargs)

    _MockCollection.find = find
    _MockCollection._dsgpt2_faults = True


# mongomock accepts what pymongo refuses before anything reaches a server (a numpy integer as
# a batch size or inside a filter) and cannot hand back raw BSON. The checks below make the
# in-process store refuse and answer as pymongo does, so that the default test suite runs the
# code path a real server takes.
_CHECKED_METHODS = (
    "find", "find_one", "count_documents", "insert_one", "insert_many", "update_one",
    "update_many", "replace_one", "delete_one", "delete_many", "create_index",
)  # fmt: skip


def _check_encodable(value: Any) -> None:
    """Raise :class:`bson.errors.InvalidDocument` where pymongo would not encode ``value``."""
    if isinstance(value, dict):
        # Lone surrogates pass: the tests store them to stand for invalid UTF-8 that a real
        # server holds (inserted raw); to_raw() hands them back as such.
        with contextlib.suppress(UnicodeEncodeError):
            bson.encode(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_encodable(item)


def _install_pymongo_checks() -> None:
    with _patch_lock:
        if getattr(_MockCollection, "_dsgpt2_checked", False):
            return
        from mongomock.collection import Cursor

        def checked(original: Any) -> Any:
            def method(self: _MockCollection, *args: Any, **kwargs: Any) -> Any:
                for value in (*args, *kwargs.values()):
                    _check_encodable(value)
                return original(self, *args, **kwargs)

            return method

        for name in _CHECKED_METHODS:
            setattr(_MockCollection, name, checked(getattr(_MockCollection, name)))

        original_batch_size = Cursor.batch_size

        def batch_size(self: Any, count: Any) -> Any:
            # pymongo's own check (cursor.batch_size): a numpy integer is not an int.
            if not isinstance(count, int):
                raise TypeError(f"batch_size must be an integer, not {type(count)}")
            if count < 0:
                raise ValueError("batch_size must be >= 0")
            return original_batch_size(self, count)

        original_with_options = _MockCollection.with_options

        def with_options(self: _MockCollection, codec_options: Any = None, **kwargs: Any) -> Any:
            if codec_options is not None and codec_options.document_class is RawBSONDocument:
                return _RawCollection(original_with_options(self, **kwargs))
            return original_with_options(self, codec_options, **kwargs)

        Cursor.batch_size = batch_size
        _MockCollection.with_options = with_options
        _MockCollection._dsgpt2_checked = True


class _RawCollection:
    """A collection whose finds yield :class:`RawBSONDocument`, as pymongo's raw codec does."""

    def __init__(self, coll: _MockCollection) -> None:
        self._coll = coll

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coll, name)

    def find(self, *args: Any, **kwargs: Any) -> _RawCursor:
        return _RawCursor(self._coll.find(*args, **kwargs))


class _RawCursor:
    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def batch_size(self, count: int) -> _RawCursor:
        self._cursor.batch_size(count)
        return self

    def __iter__(self) -> Iterator[RawBSONDocument]:
        return (to_raw(doc) for doc in self._cursor)


def to_raw(doc: dict[str, Any]) -> RawBSONDocument:
    """``doc`` as the raw BSON a server sends; a string with lone surrogates becomes the invalid
    UTF-8 bytes they stand for (surrogateescape), as a server holding such bytes would send."""
    try:
        return RawBSONDocument(bson.encode(doc))
    except UnicodeEncodeError:
        pass
    bad = {k: v for k, v in doc.items() if isinstance(v, str) and not utf8_encodable(v)}
    body = bson.encode({k: v for k, v in doc.items() if k not in bad})[4:-1]
    for key, text in bad.items():
        data = text.encode("utf-8", "surrogateescape")
        body += b"\x02" + key.encode() + b"\x00" + struct.pack("<i", len(data) + 1) + data + b"\x00"
    return RawBSONDocument(struct.pack("<i", len(body) + 5) + body + b"\x00")
