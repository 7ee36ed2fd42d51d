"""The database's own records: the meta_info entry of each collection (counts, sources, marks) and the
evaluation results stored beside the corpus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pymongo.errors import OperationFailure

from dsgpt2.db.client import EVAL_RESULTS, Connection, first_line, with_retries
from dsgpt2.errors import MongoUnavailableError


def read_meta(conn: Connection, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The meta_info entries of ``names`` (one query), keyed by collection name."""
    meta = conn.meta
    docs = with_retries(
        lambda: list(meta.find({"collection": {"$in": list(names)}}, {"_id": 0})),
        conn.config,
        "reading meta_info",
    )
    return {d["collection"]: d for d in docs}


def write_meta(
    conn: Connection, name: str, fields: dict[str, Any], at_least: dict[str, Any] | None = None
) -> None:
    """Set ``fields`` on the meta_info entry of collection ``name`` (created if absent), and raise each
    field of ``at_least`` to its value (never lowered: another writer may have gone further)."""
    meta = conn.meta
    update: dict[str, Any] = {"$set": fields}
    if at_least:
        update["$max"] = at_least
    meta.update_one({"collection": name}, update, upsert=True)


def drop_collection(conn: Connection, name: str) -> None:
    """Drop the collection ``name`` and its meta_info entry (its ingest history and marks)."""
    with_retries(lambda: conn.db.drop_collection(name), conn.config, f"dropping {name}")
    with_retries(lambda: conn.meta.delete_many({"collection": name}), conn.config, f"dropping {name}")


def record_eval(conn: Connection, result: dict[str, Any], collection: str = EVAL_RESULTS) -> Any:
    """Store an evaluation result in ``collection`` beside the corpus; return its id."""
    import uuid

    coll = conn.db[collection]
    doc = {"_id": uuid.uuid4().hex, **result}
    # An upsert by a fixed _id: retrying after a lost acknowledgement cannot store it twice.
    try:
        with_retries(
            lambda: coll.replace_one({"_id": doc["_id"]}, doc, upsert=True),
            conn.config,
            f"writing {collection}",
        )
    except OperationFailure as exc:
        raise MongoUnavailableError(
            f"could not write to {conn.config.db}.{collection}: {conn.config.scrub(first_line(exc))}; "
            "the user needs the readWrite role on the database (or skip recording)"
        ) from None
    return doc["_id"]
