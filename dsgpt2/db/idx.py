"""The ``idx`` field of a collection: its unique index, its edges read in bounded windows, the numbered
documents read a window of idx values at a time, and batched inserts that keep it contiguous beside
other writers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pymongo
from pymongo.errors import OperationFailure, PyMongoError

from dsgpt2.db.client import (
    MAX_BACKOFF_S,
    TRANSIENT_ERRORS,
    Connection,
    DatabaseError,
    first_line,
    patiently,
    revive,
    with_retries,
)
from dsgpt2.db.filters import conjoin
from dsgpt2.errors import CorpusError, MongoUnavailableError, ServerLostError

log = logging.getLogger(__name__)


def ensure_index(conn: Connection, name: str, field: str, what: str) -> None:
    """An ascending index on ``field`` of ``name`` (named ``field_1``), built however long it takes
    (:func:`patiently`); a refusal is a CorpusError."""
    try:
        index = [(field, pymongo.ASCENDING)]
        patiently(conn, lambda db: db[name].create_index(index, name=f"{field}_1"), what)
    except DatabaseError as exc:  # OperationFailure among them
        raise CorpusError(
            f"cannot create the {field} index on {name!r}: {conn.config.scrub(str(exc))}"
        ) from None


def drop_index(conn: Connection, name: str, index: str, what: str) -> None:
    """Drop the index named ``index`` of ``name`` where there is one, however long it takes."""

    def drop(db: Any) -> None:
        if any(i["name"] == index for i in db[name].list_indexes()):
            db[name].drop_index(index)

    patiently(conn, drop, what)


def idx_index_name(coll: Any) -> str | None:
    """The name of the unique ascending index on ``idx`` alone, or None."""
    for name, info in coll.index_information().items():
        if [tuple(k) for k in info["key"]] == [("idx", 1)] and info.get("unique"):
            return name
    return None


def ensure_idx_index(conn: Connection, name: str, what: str) -> None:
    """Create the unique index on ``idx`` of ``name`` unless it exists, however long it takes
    (:func:`patiently`).

    Raises:
        CorpusError: the collection holds duplicate idx values, so no unique index can exist.
    """

    def ensure(db: Any) -> None:
        coll = db[name]
        if idx_index_name(coll) is not None:
            return
        try:
            coll.create_index([("idx", pymongo.ASCENDING)], unique=True, name="idx_unique")
        except OperationFailure as exc:
            raise CorpusError(
                f"cannot create the unique idx index on {name!r}: {first_line(exc)}; "
                f"run `dsgpt2 validate` to find the duplicate idx values"
            ) from None

    patiently(conn, ensure, what)


# Reads of "the largest idx" or "the next documents after idx k" ask bounded idx windows, never an
# open range with a sort and a limit: the embedded server reads every document of a range before it
# applies the limit, so an open range costs the whole collection there (2 s for one edge at 50,000
# documents, where a window of 1,024 costs 30 ms). On mongod the windows cost what the open read did.
EDGE_WINDOW = 1024


def _first_idx(coll: Any, query: dict[str, Any], bounds: dict[str, Any], direction: int) -> Any:
    doc = coll.find_one({**query, "idx": bounds}, {"_id": 0, "idx": 1}, sort=[("idx", direction)])
    return None if doc is None else doc["idx"]


def idx_edge(coll: Any, direction: int, query: dict[str, Any] | None = None, guess: int | None = None) -> Any:
    """The lowest (``direction`` 1) or highest (-1) numeric idx of the documents of ``coll`` that match
    ``query`` (its own idx condition, if any, is replaced), or None when none does.

    Looked for from ``guess`` (default: 0 for the lowest, the collection's count - 1 for the highest)
    outwards in idx windows that double: the documents read are those between the guess and the edge,
    a few when the guess is close, never more than the range holds.
    """
    query = {k: v for k, v in (query or {}).items() if k != "idx"}
    if direction < 0:
        start = guess if guess is not None else coll.estimated_document_count() - 1
        found = _first_idx(coll, query, {"$gte": start}, -1)
        hi, width = start, EDGE_WINDOW
        while found is None:
            if hi <= 0:  # below 0 only negative idx values remain, few if any: one open read
                return _first_idx(coll, query, {"$lt": hi}, -1)
            found = _first_idx(coll, query, {"$gte": hi - width, "$lt": hi}, -1)
            hi, width = hi - width, width * 2
        return found
    start = guess if guess is not None else 0
    found = _first_idx(coll, query, {"$lte": start}, 1)
    lo, width, top = start, EDGE_WINDOW, None
    while found is None:
        if lo > start:  # an empty window: the walk ends at the highest
            top = idx_edge(coll, -1, query) if top is None else top
            if top is None or lo >= top:
                return None
        found = _first_idx(coll, query, {"$gt": lo, "$lte": lo + width}, 1)
        lo, width = lo + width, width * 2
    return found


def max_idx(coll: Any, guess: int | None = None) -> int | None:
    """The largest numeric idx in ``coll``, or None when there is none (:func:`idx_edge`)."""
    top = idx_edge(coll, -1, guess=guess)
    return None if top is None else int(top)


def largest_idx(conn: Connection, name: str, what: str, guess: int | None = None) -> int | None:
    """The largest numeric idx of ``name``, or None when there is none (:func:`max_idx`, retried)."""
    return with_retries(lambda: max_idx(conn.db[name], guess=guess), conn.config, what)


def idx_bounds(conn: Connection, name: str) -> tuple[int, int] | None:
    """The smallest and largest idx of ``name`` (a few reads on the idx index); None when it has none."""
    coll = conn.db[name]
    lo = with_retries(lambda: idx_edge(coll, 1), conn.config, f"reading the idx range of {name}")
    hi = with_retries(lambda: idx_edge(coll, -1), conn.config, f"reading the idx range of {name}")
    return None if lo is None or hi is None else (int(lo), int(hi))


def numbered_batches(
    conn: Connection,
    name: str,
    query: dict[str, Any],
    fields: dict[str, int],
    batch_size: int,
    *,
    what: str,
    span: tuple[int, int] | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """The numbered documents of ``name`` matching ``query``, in idx order, with ``_id``, ``idx`` and
    ``fields``: each batch one window of ``batch_size`` idx values on the idx index (fewer documents
    when ``query`` leaves some out; windows with none are not yielded); only those of idx in
    ``[start, stop)`` when ``span`` is given, otherwise to the largest idx, including documents added
    while the batches are read. A window, not a query on ``query`` alone: that may have no index to
    ride, and the embedded engine would hold every document it selects in its memory."""
    coll = conn.db[name]
    wanted = {"_id": 1, "idx": 1, **fields}

    def edge(guess: int | None) -> int:
        top = with_retries(lambda: idx_edge(coll, -1, guess=guess), conn.config, f"{what}: reading {name}")
        return -1 if top is None else int(top)

    lo, stop = (0, edge(None) + 1) if span is None else span
    while lo < stop:
        end = min(lo + batch_size, stop)
        q = conjoin({"idx": {"$gte": lo, "$lt": end}}, query)
        batch = with_retries(lambda q=q: list(coll.find(q, wanted).sort("idx", 1)),
                             conn.config, f"{what}: reading {name}")  # fmt: skip
        lo = end
        if span is None and lo >= stop:
            stop = edge(stop - 1) + 1
        if batch:
            yield batch


def insert_batch(
    conn: Connection, name: str, docs: list[dict[str, Any]], sleep: Callable[[float], None] = time.sleep
) -> int:
    """Insert ``docs`` (numbered from ``docs[0]["idx"]`` on) in order; returns the idx after the last.

    Another writer of the same collection (a second ingest) may take an idx first: the unique index
    refuses ours, and the rest of the batch is numbered again after the largest idx there is. Inserts
    are ordered and each one lands at most one past the largest idx, so idx stays contiguous. A transient
    error (a failover, a dropped connection) is retried with backoff, up to ``RETRIES`` times: the
    documents that landed before it (found by their ``_id``, which the driver gave each one) are not
    sent again.

    Raises:
        CorpusError: a write refused for another reason.
        ServerLostError: the server failed mid-batch, past the retries (exit 3; re-run to resume).
        MongoUnavailableError: the server refused the batch.
    """
    attempt = 0
    unsure = False  # after a transient error: which of ``docs`` landed is not known yet
    while True:
        coll = conn.db[name]  # made again after a server move (revive)
        try:
            if unsure:
                end = int(docs[-1]["idx"]) + 1
                docs = docs[_landed(coll, docs) :]
                unsure = False
                if not docs:
                    return end
            coll.insert_many(docs, ordered=True)
            return int(docs[-1]["idx"]) + 1
        except pymongo.errors.BulkWriteError as exc:
            first = (exc.details.get("writeErrors") or [{}])[0]
            at = int(first.get("index", 0))
            if first.get("code") == 11000 and "idx" in (first.get("keyPattern") or {"idx": 1}):
                top = max_idx(coll, guess=int(docs[at]["idx"]))
                docs = [{**d, "idx": (-1 if top is None else top) + 1 + i} for i, d in enumerate(docs[at:])]
                log.debug("%s: idx taken by another writer; the batch goes on from idx %d", coll.name, top)
                continue
            raise CorpusError(
                f"insert into {coll.name!r} failed at idx {docs[at].get('idx')}: "
                f"{conn.config.scrub(str(first.get('errmsg', exc)))}"
            ) from None
        except TRANSIENT_ERRORS as exc:
            if attempt >= conn.config.retries:
                raise ServerLostError(
                    f"insert into {coll.name!r} failed {attempt + 1} times on MongoDB at "
                    f"{conn.config.hosts}: {conn.config.scrub(first_line(exc))}; "
                    "re-run the same command to resume"
                ) from None
            delay = min(MAX_BACKOFF_S, conn.config.retry_backoff_s * 2**attempt)
            log.warning("insert into %s: transient MongoDB error (%s); retry %d/%d in %.1fs",
                        coll.name, conn.config.scrub(first_line(exc)), attempt + 1, conn.config.retries,
                        delay)  # fmt: skip
            revive(conn.config)
            sleep(delay)
            attempt += 1
            unsure = True
        except PyMongoError as exc:
            raise MongoUnavailableError(
                f"insert into {coll.name!r} on {conn.config.hosts} failed: "
                f"{conn.config.scrub(first_line(exc))}; re-run the same command to resume"
            ) from None


def _landed(coll: Any, docs: list[dict[str, Any]]) -> int:
    """How many of ``docs``, from the first, are stored (an ordered insert stores a prefix)."""
    ids = [d["_id"] for d in docs if "_id" in d]
    stored = {d["_id"] for d in coll.find({"_id": {"$in": ids}}, {"_id": 1})} if ids else set()
    landed = 0
    for d in docs:
        if d.get("_id") not in stored:
            break
        landed += 1
    return landed
