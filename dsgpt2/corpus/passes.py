"""A pass over a collection's documents in idx order, in batches, writing fields back with bulk
writes: the shape of every curation pass (hashes, quality signals).

Resumable by its query: a pass selects the documents still without its result, so a pass killed
and run again continues with those, and ends as a straight one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pymongo
from tqdm import tqdm

from dsgpt2.corpus.mongo import Connection, with_retries
from dsgpt2.errors import CorpusError


def require_present(conn: Connection, names: Sequence[str], what: str) -> None:
    """Raises CorpusError naming those of ``names`` the database does not hold."""
    present = with_retries(conn.db.list_collection_names, conn.config, f"{what}: collections")
    missing = [n for n in names if n not in present]
    if missing:
        raise CorpusError(
            f"collection(s) {', '.join(map(repr, missing))} not found in database {conn.config.db!r}"
        )


def each_batch(
    conn: Connection,
    name: str,
    query: dict[str, Any],
    fields: dict[str, int],
    batch_size: int,
    desc: str,
    progress: bool = False,
) -> Iterator[list[dict[str, Any]]]:
    """The numbered documents of ``name`` matching ``query``, ``batch_size`` at a time, in idx order
    (each batch a range on the idx index after the last one), with ``_id``, ``idx`` and ``fields``."""
    coll = conn.db[name]
    wanted = {"_id": 1, "idx": 1, **fields}
    last = -1
    bar = tqdm(desc=desc, unit="doc", disable=None if progress else True)
    try:
        while True:
            q = {**query, "idx": {"$gt": last}}
            batch = with_retries(lambda q=q: list(coll.find(q, wanted).sort("idx", 1).limit(batch_size)),
                                 conn.config, f"{desc}: reading {name}")  # fmt: skip
            if not batch:
                return
            yield batch
            last = batch[-1]["idx"]
            bar.update(len(batch))
    finally:
        bar.close()


def set_fields(conn: Connection, name: str, updates: list[tuple[Any, dict[str, Any]]], what: str) -> None:
    """``$set`` each ``(_id, fields)`` of ``updates`` on ``name``: one unordered bulk write."""
    coll = conn.db[name]

    def write() -> None:
        if conn.config.is_mock:  # mongomock's bulk_write does not take pymongo 4's UpdateOne
            for _id, fields in updates:
                coll.update_one({"_id": _id}, {"$set": fields})
            return
        coll.bulk_write([pymongo.UpdateOne({"_id": _id}, {"$set": f}) for _id, f in updates], ordered=False)

    if updates:
        with_retries(write, conn.config, f"{what}: writing {name}")
