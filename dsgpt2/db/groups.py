"""Values that several documents share, across collections: what dedup groups by (a text's hash, a
band of its signature).

A document is named over all the collections asked by its key, ``rank * SPAN + idx`` (``rank`` its
collection's place in the list). mongod answers each question in one aggregation that it streams to
disk as needed. The embedded engine would hold every document of the collections in its memory for that
aggregation: there the (value, key) pairs are read a window of idx values at a time and grouped here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dsgpt2.db.client import Connection, patiently
from dsgpt2.db.summaries import read_windows

SPAN = 2**40  # a document's key over all collections: rank * SPAN + idx


def repeated_values(
    conn: Connection, names: Sequence[str], field: str, what: str
) -> list[tuple[str, int, list[int]]]:
    """``(value, first, ranks)`` for every string ``field`` held by more than one numbered document of
    ``names``: ``first`` the key of its first copy, ``ranks`` the collections holding it. On the embedded
    engine about 150 bytes a distinct value are held here."""
    if not conn.counts_walk:
        return patiently(conn, lambda db: list(value_groups(db, names, field)), what)
    seen: dict[str, list[Any]] = {}  # value -> [first key, copies, ranks]
    for rank, name in enumerate(names):
        query = {field: {"$type": "string"}}
        for docs in read_windows(conn, name, query, {"_id": 0, field: 1, "idx": 1}, what):
            for d in docs:
                k = rank * SPAN + int(d["idx"])
                held = seen.get(d[field])
                if held is None:
                    seen[d[field]] = [k, 1, {rank}]
                else:
                    held[0], held[1] = min(held[0], k), held[1] + 1
                    held[2].add(rank)
    return [(v, first, sorted(ranks)) for v, (first, n, ranks) in seen.items() if n > 1]


def value_groups(db: Any, names: Sequence[str], field: str) -> Iterator[tuple[str, int, list[int]]]:
    """:func:`repeated_values` as one aggregation over ``names`` of database ``db``."""

    def keyed(rank: int) -> list[dict[str, Any]]:
        return [
            {"$match": {field: {"$type": "string"}, "idx": {"$exists": True}}},
            {
                "$project": {
                    "_id": 0,
                    "h": f"${field}",
                    "k": {"$add": [rank * SPAN, "$idx"]},
                    "r": {"$literal": rank},
                }
            },
        ]

    group = {"$group": {"_id": "$h", "first": {"$min": "$k"}, "n": {"$sum": 1}, "ranks": {"$addToSet": "$r"}}}
    pipeline = keyed(0)
    for rank, name in enumerate(names[1:], 1):
        pipeline.append({"$unionWith": {"coll": name, "pipeline": keyed(rank)}})
    pipeline += [group, {"$match": {"n": {"$gt": 1}}}]
    for g in db[names[0]].aggregate(pipeline, allowDiskUse=True):
        yield g["_id"], int(g["first"]), sorted(g["ranks"])


def shared_elements(
    conn: Connection, names: Sequence[str], field: str, query: dict[str, Any], what: str
) -> list[list[int]]:
    """The sorted keys of the numbered documents of ``names`` matching ``query`` that share each integer
    held in their ``field`` arrays by more than one document. On the embedded engine the (value, key)
    pairs are held here in two arrays of int64, sorted by value (16 bytes a pair: 300 MB at a million
    documents of 20 values)."""
    if not conn.counts_walk:
        return patiently(conn, lambda db: list(element_groups(db, names, field, query)), what)
    values, keys = [], []
    for rank, name in enumerate(names):
        for docs in read_windows(conn, name, query, {"_id": 0, field: 1, "idx": 1}, what):
            for d in docs:
                values.append(np.asarray(d[field], dtype=np.int64))
                keys.append(np.full(len(d[field]), rank * SPAN + int(d["idx"]), dtype=np.int64))
    if not values:
        return []
    value, owner = np.concatenate(values), np.concatenate(keys)
    del values, keys
    order = np.lexsort((owner, value))
    value, owner = value[order], owner[order]
    starts = np.flatnonzero(np.r_[True, value[1:] != value[:-1]])
    ends = np.r_[starts[1:], len(value)]
    return [owner[a:b].tolist() for a, b in zip(starts, ends, strict=True) if b - a > 1]


def element_groups(db: Any, names: Sequence[str], field: str, query: dict[str, Any]) -> Iterator[list[int]]:
    """:func:`shared_elements` as one aggregation over ``names`` of database ``db``."""

    def keyed(rank: int) -> list[dict[str, Any]]:
        return [
            {"$match": {**query, "idx": {"$exists": True}}},
            {"$project": {"_id": 0, "k": {"$add": [rank * SPAN, "$idx"]}, "b": f"${field}"}},
            {"$unwind": "$b"},
        ]

    group = {"$group": {"_id": "$b", "keys": {"$push": "$k"}, "n": {"$sum": 1}}}
    pipeline = keyed(0)
    for rank, name in enumerate(names[1:], 1):
        pipeline.append({"$unionWith": {"coll": name, "pipeline": keyed(rank)}})
    pipeline += [group, {"$match": {"n": {"$gt": 1}}}, {"$project": {"_id": 0, "keys": 1}}]
    for g in db[names[0]].aggregate(pipeline, allowDiskUse=True):
        yield sorted(int(k) for k in g["keys"])
