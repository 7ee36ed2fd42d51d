"""``dsgpt2 index``: number a collection that already lives in MongoDB, in place.

A collection written by another application (``{"_id", "title", "body", ...}``) becomes a training
collection without a copy: every document without an ``idx`` gets the next number, in ``_id`` order,
the unique idx index is built, and meta_info records the count and the text field. Training then
reads the documents' own field (``TEXT_FIELD`` in the connection config).

Exactly once, even when killed: a document is numbered by a conditional update (``idx`` still
absent), batch by batch in ``_id`` order with ordered bulk writes, so the numbered documents always
hold 0..k-1 and a re-run continues at k. Documents added later (without ``idx``) get the next
numbers from the next run; the unique index is sparse (it holds the documents that have an ``idx``),
so the application can go on inserting documents without one.

Two passes never run at once: a lease in meta_info (:mod:`dsgpt2.db.leases`) refuses a second
``index`` of the same collection, and an unfinished ``ingest`` into it is refused too.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from dsgpt2.db.client import (
    ASCENDING,
    Connection,
    DatabaseError,
    UpdateOne,
    count_in,
    patiently,
    require_collections,
    with_retries,
)
from dsgpt2.db.idx import ensure_index, idx_index_name, max_idx
from dsgpt2.db.leases import LEASE_SECONDS, Lease
from dsgpt2.db.meta import read_meta
from dsgpt2.db.summaries import count_numbered
from dsgpt2.documents import HASH
from dsgpt2.errors import CorpusError, LeaseHeld
from dsgpt2.progress import progress as progress_display

log = logging.getLogger(__name__)

UNNUMBERED = {"idx": {"$exists": False}}
NUMBERED = {"idx": {"$exists": True}}


@dataclass
class IndexReport:
    """What one ``dsgpt2 index`` run did."""

    collection: str
    field: str
    numbered: int  # documents numbered by this run
    count: int  # documents numbered in all (idx 0..count-1)
    without_text: int  # numbered documents whose field is absent or not a string (skipped by training)
    seconds: float

    def lines(self) -> list[str]:
        also = (
            f"; {self.without_text} of them have no text in {self.field!r} (training skips and counts them)"
        )
        return [
            f"{self.collection}: {self.numbered} document(s) numbered by this run, idx 0..{self.count - 1} "
            f"in all ({self.seconds:.1f}s){also if self.without_text else ''}",
            f"train on it with TEXT_FIELD {self.field!r} in the connection config; documents added "
            "later get the next numbers from the same command",
        ]


def index_collection(
    conn: Connection, name: str, field: str, batch_size: int = 1000, progress: bool = False
) -> IndexReport:
    """Number the documents of ``name`` that have no ``idx`` (see module doc).

    Raises:
        CorpusError: the collection is missing or empty, its idx values are not 0..k-1 integers, or
            another process is indexing or ingesting it.
    """
    started = time.monotonic()
    coll = conn.db[name]
    cfg = conn.config

    def run(what: str, fn: Any) -> Any:
        return with_retries(fn, cfg, f"indexing {name}: {what}")

    run("collections", lambda: require_collections(conn, [name]))
    meta = run("meta", lambda: read_meta(conn, [name])).get(name) or {}
    sources = meta.get("sources") or {}
    if any(isinstance(v, dict) and not v.get("complete") for v in sources.values()):
        raise CorpusError(
            f"an ingest into {name!r} is unfinished or running; let it finish (or re-run it) before "
            "`dsgpt2 index`"
        )
    lease = _take_lease(conn, name)
    try:
        _check_numbers(conn, name)
        # Before the numbering: its checks and the next run's start read idx ranges through it.
        _ensure_sparse_index(conn, name)
        top = run("largest idx", lambda: max_idx(coll))
        next_idx = 0 if top is None else top + 1
        numbered = 0
        # Documents are taken in _id order from one cursor, its batches as long as ours: one sorted
        # read for the whole run (a query per batch would read the collection from the start each
        # time on the embedded engine, whose _id ranges and sorts scan). A transient error ends the
        # cursor; the retry opens one after the last _id this run numbered.
        last_id: Any = None
        cursor: Any = None

        def next_ids() -> list[Any]:
            nonlocal cursor
            if cursor is None:
                query = dict(UNNUMBERED) if last_id is None else {**UNNUMBERED, "_id": {"$gt": last_id}}
                cursor = coll.find(query, {"_id": 1}).sort("_id", 1).batch_size(batch_size)
            try:
                return [d["_id"] for d in itertools.islice(cursor, batch_size)]
            except BaseException:
                cursor.close()
                cursor = None
                raise

        bar = progress_display(f"index {name}", "doc", enabled=progress)
        try:
            while True:
                ids = run("next batch", next_ids)
                if not ids:
                    break
                # A retried batch gives each document the same number (its place in the batch), and
                # the documents it already numbered keep theirs.
                run("numbering", lambda i=ids, n=next_idx: _number(conn, coll, i, n))
                # The batch's numbers must be on its documents: the range read by idx, compared here
                # (an $in of the batch's _ids costs the square of its length on stock SecantusDB).
                window = {"idx": {"$gte": next_idx, "$lt": next_idx + len(ids)}}
                held = run("check", lambda q=window: [d["_id"] for d in coll.find(q, {"_id": 1})])
                if sorted(map(str, held)) != sorted(map(str, ids)):
                    raise CorpusError(
                        f"another process numbered documents of {name!r} during this run; run "
                        "`dsgpt2 validate` and then `dsgpt2 index` again"
                    )
                next_idx += len(ids)
                numbered += len(ids)
                last_id = ids[-1]
                bar.update(len(ids))
                _record(lease, field, next_idx)
        finally:
            bar.close()
            if cursor is not None:
                cursor.close()
        # As ingest builds it: `ingest --dedup` and `dedup --exact` ask text_hash of every batch (the
        # documents without a hash cost an index entry each, until `dedup --exact` gives them one).
        ensure_index(conn, name, HASH, f"indexing {name}: text_hash index")
        _record(lease, field, next_idx)
        no_text = {"idx": {"$gte": next_idx - numbered}, field: {"$not": {"$type": "string"}}}  # or none
        without = count_numbered(conn, name, no_text, f"indexing {name}: texts") if numbered else 0
    finally:
        lease.release()
    log.info("%s: %d numbered, %d in all", name, numbered, next_idx)
    return IndexReport(name, field, numbered, next_idx, without, time.monotonic() - started)


def _number(conn: Connection, coll: Any, ids: list[Any], first: int) -> int:
    """Give ``ids`` (in order) the numbers ``first``, ``first + 1``, ... where they have none yet; an
    ordered bulk write, so a failure leaves a prefix numbered. Returns how many were numbered."""
    updates = [UpdateOne({"_id": i, **UNNUMBERED}, {"$set": {"idx": first + k}}) for k, i in enumerate(ids)]
    return coll.bulk_write(updates, ordered=True).modified_count


def _check_numbers(conn: Connection, name: str) -> None:
    """The numbered documents must hold 0..k-1 as integers: the next numbers follow them."""
    coll = conn.db[name]
    not_numbers = {"idx": {"$exists": True, "$not": {"$type": "number"}}}
    bad = patiently(conn, lambda db: count_in(db[name], not_numbers), f"indexing {name}: idx types")
    if bad:
        raise CorpusError(
            f"{bad} document(s) of {name!r} have an idx that is not an integer; run `dsgpt2 validate "
            f"--collection {name}` and fix them before numbering"
        )
    numbered = count_numbered(conn, name, NUMBERED, f"indexing {name}: count")
    top = max_idx(coll, guess=numbered - 1)
    if numbered and (top != numbered - 1 or coll.find_one({"idx": {"$lt": 0}}) is not None):
        raise CorpusError(
            f"the {numbered} numbered document(s) of {name!r} do not hold idx 0..{numbered - 1} (the "
            f"largest is {top}); run `dsgpt2 validate --collection {name}` and fix them first"
        )


def _ensure_sparse_index(conn: Connection, name: str) -> None:
    coll = conn.db[name]
    if idx_index_name(coll) is not None:
        return
    try:
        build = {"keys": [("idx", ASCENDING)], "unique": True, "sparse": True, "name": "idx_unique"}
        patiently(conn, lambda db: db[name].create_index(**build), f"indexing {name}")
    except DatabaseError as exc:  # OperationFailure among them
        raise CorpusError(f"cannot create the unique idx index on {name!r}: {exc}") from None


def _record(lease: Lease, field: str, count: int) -> None:
    """Record the count while this pass holds the lease (a sign of life too).

    Raises:
        CorpusError: another pass took the lease over.
    """
    now = time.time()
    lease.update({"$set": {"count": count, "numbered_in_place": {"field": field, "updated_at": now},
                           f"{lease.path}.heartbeat": now}})  # fmt: skip


def _take_lease(conn: Connection, name: str) -> Lease:
    try:
        return Lease.take(conn, name, "indexing")
    except LeaseHeld as held:
        raise CorpusError(
            f"another process ({held.holder}) is numbering {name!r} (its last sign of life "
            f"{held.age:.0f}s ago); wait for it, or re-run after {LEASE_SECONDS:.0f}s without one"
        ) from None
