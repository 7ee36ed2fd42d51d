"""Whole-collection counts (the passes' summaries, ``curate report``) in bounded server memory.

A summary is one aggregation: a ``$match``, stages that work document by document (``$project``,
``$unwind``) and a last ``$group`` of sums or ``$facet`` of counts, sums and first examples. mongod
streams it. The embedded engine builds each stage's whole input in its memory: the documents the
``$match`` selects, texts and all (at 20,000 documents of 1.7 KB, 250 MB of server memory held after
one summary). There it is asked per window of ``WINDOW`` idx values and the windows' rows are merged,
which gives the same rows: sums add up, and the first examples in idx order are the first windows'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from dsgpt2.db.client import Connection, count_in, patiently, with_retries
from dsgpt2.db.filters import conjoin
from dsgpt2.db.idx import largest_idx
from dsgpt2.db.meta import read_meta

WINDOW = 10_000


def aggregate_summary(
    conn: Connection, name: str, pipeline: Sequence[dict[str, Any]], what: str
) -> list[Any]:
    """The rows of ``pipeline`` on collection ``name`` (see the module's doc for its shape), asked
    patiently: in one aggregation on mongod, per idx window on the embedded engine."""
    first, *rest = pipeline
    if not conn.counts_walk:
        return patiently(conn, lambda db: list(db[name].aggregate(list(pipeline), allowDiskUse=True)), what)
    rows: list[Any] = []
    for lo, hi in windows(conn, name):
        part = [{"$match": conjoin({"idx": {"$gte": lo, "$lt": hi}}, first["$match"])}, *rest]
        got = patiently(conn, lambda db, p=part: list(db[name].aggregate(p, allowDiskUse=True)), what)
        rows = _merge(rest[-1], rows, got) if rows else got
    if not rows and "$facet" in rest[-1]:
        return [{k: [] for k in rest[-1]["$facet"]}]
    return rows


def _merge(last: dict[str, Any], a: list[Any], b: list[Any]) -> list[Any]:
    """Two windows' rows of a pipeline ending in ``last``, as one window holding both would give."""
    if "$facet" in last:
        ((row_a,), (row_b,)) = a, b
        return [{k: _merge_stages(sub, row_a[k], row_b[k]) for k, sub in last["$facet"].items()}]
    return _merge_stages([last], a, b)


def _merge_stages(stages: Sequence[dict[str, Any]], a: list[Any], b: list[Any]) -> list[Any]:
    last = stages[-1]
    if "$count" in last:
        field = last["$count"]
        n = sum(int(r[field]) for r in (*a, *b))
        return [{field: n}] if n else []
    limits = [s["$limit"] for s in stages if "$limit" in s]
    if limits:  # first examples in idx order: the earlier window's come first
        return [*a, *b][: limits[-1]]
    if "$group" in last:
        accumulators = {k: v for k, v in last["$group"].items() if k != "_id"}
        if not all(isinstance(v, dict) and "$sum" in v for v in accumulators.values()):
            raise ValueError(f"a windowed summary merges only sums: {last}")
        merged: dict[Any, dict[str, Any]] = {}
        for row in (*a, *b):
            key = repr(row["_id"])
            if key not in merged:
                merged[key] = dict(row)
            else:
                for k in accumulators:
                    merged[key][k] += row[k]
        return list(merged.values())
    raise ValueError(f"a windowed summary cannot merge a pipeline ending in {last}")


def windows(conn: Connection, name: str) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` idx windows of ``WINDOW`` values from 0 to the largest idx of ``name`` (found from
    meta_info's count, in a few bounded reads)."""
    count = read_meta(conn, [name]).get(name, {}).get("count")
    guess = count - 1 if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None
    top = largest_idx(conn, name, f"reading {name}: last idx", guess=guess)
    for lo in range(0, -1 if top is None else top + 1, WINDOW):
        yield lo, lo + WINDOW


def read_windows(
    conn: Connection, name: str, query: dict[str, Any], projection: dict[str, Any], what: str
) -> Iterator[list[dict[str, Any]]]:
    """The documents of ``name`` matching ``query``, ``projection``'s fields, a window at a time: what an
    aggregation over them would read, in bounded server memory on the embedded engine."""
    coll = conn.db[name]
    for lo, hi in windows(conn, name):
        q = conjoin({"idx": {"$gte": lo, "$lt": hi}}, query)
        yield with_retries(lambda q=q: list(coll.find(q, projection)), conn.config, what)


def count_numbered(conn: Connection, name: str, query: dict[str, Any], what: str) -> int:
    """The documents of ``name`` that ``query`` matches, among those with an idx (0 to the largest).

    mongod counts from its index. The embedded engine tests every document of the collection for a
    count with a condition, after building the whole list of them in its memory (2.5 GB at 200,000
    documents of 1.7 KB): there the windows' ``_id`` are read and counted here."""
    if not conn.counts_walk:
        numbered = conjoin({"idx": {"$exists": True}}, query)
        return int(patiently(conn, lambda db: db[name].count_documents(numbered), what))
    return sum(len(docs) for docs in read_windows(conn, name, query, {"_id": 1}, what))


def count_where(conn: Connection, name: str, query: dict[str, Any], what: str) -> int:
    """The documents of ``name`` that ``query`` matches, numbered or not (:func:`count_in`, retried): for a
    query an index bounds; :func:`count_numbered` for one it may not."""
    return int(with_retries(lambda: count_in(conn.db[name], query), conn.config, what))


def last_numbered(
    conn: Connection, name: str, query: dict[str, Any], projection: dict[str, Any], what: str
) -> dict[str, Any] | None:
    """The document of ``name`` with the largest idx that ``query`` matches (``projection``'s fields), or
    None: for a query whose idx range is short (the embedded engine reads all of it before sorting)."""
    q = conjoin({"idx": {"$exists": True}}, query)
    return with_retries(lambda: conn.db[name].find_one(q, projection, sort=[("idx", -1)]), conn.config, what)


def integer_idx(conn: Connection, name: str, what: str) -> Iterator[list[int]]:
    """The integer idx values of ``name``, a window at a time (in bounded server memory)."""
    for docs in read_windows(conn, name, {}, {"_id": 0, "idx": 1}, what):
        yield [d["idx"] for d in docs if isinstance(d.get("idx"), int) and not isinstance(d["idx"], bool)]


def first_numbered(
    conn: Connection, name: str, query: dict[str, Any], projection: dict[str, Any], what: str
) -> dict[str, Any] | None:
    """The document of ``name`` with the smallest idx that ``query`` matches (``projection``'s fields),
    or None (:func:`first_in_order`)."""
    first = first_in_order(conn, name, query, projection, what, n=1)
    return first[0] if first else None


def first_in_order(
    conn: Connection, name: str, query: dict[str, Any], projection: dict[str, Any], what: str, *, n: int
) -> list[dict[str, Any]]:
    """The ``n`` numbered documents of ``name`` of smallest idx that ``query`` matches (``projection``'s
    fields, and idx), in idx order: mongod sorts on the idx index and stops at ``n``; the embedded
    engine would read every match before its limit, so there the windows are read until ``n`` are."""
    projection = {**projection, "idx": 1}
    if not conn.counts_walk:
        q = conjoin({"idx": {"$exists": True}}, query)
        return with_retries(
            lambda: list(conn.db[name].find(q, projection).sort("idx", 1).limit(n)), conn.config, what
        )
    found: list[dict[str, Any]] = []
    for docs in read_windows(conn, name, query, projection, what):
        found += sorted(docs, key=lambda d: d["idx"])
        if len(found) >= n:
            break
    return found[:n]
