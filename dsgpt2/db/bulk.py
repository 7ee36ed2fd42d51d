"""Many values asked at once and many writes sent at once, in the shapes each engine answers fast: a
``$in`` query per list the server answers in linear time (:meth:`Connection.in_lists`), and a bulk of
writes as one transaction on the embedded engine (:meth:`Connection.bulk_write`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsgpt2.db.client import Connection, with_retries


def write_ops(conn: Connection, name: str, ops: list[Any], what: str) -> int:
    """``ops`` (pymongo write operations) on ``name``: one unordered bulk write (one transaction on the
    embedded engine: :meth:`Connection.bulk_write`), retried as a whole (each operation sets values, so
    a retry after a partial write ends where one write would). Returns how many documents it modified."""
    if not ops:
        return 0
    return with_retries(lambda: conn.bulk_write(name, ops), conn.config, f"{what}: writing {name}")


def find_in(
    conn: Connection,
    name: str,
    field: str,
    values: Sequence[Any],
    *,
    fields: dict[str, Any],
    what: str,
    also: dict[str, Any] | None = None,
    longest: int | None = None,
) -> list[dict[str, Any]]:
    """The documents of ``name`` whose ``field`` holds one of ``values`` (and that match ``also``), with
    ``fields``: one ``$in`` query per list of :meth:`Connection.in_lists` (at most ``longest`` values),
    each retried. A document whose array ``field`` holds values of two lists comes once per list."""
    coll = conn.db[name]
    found: list[dict[str, Any]] = []
    for part in conn.in_lists(values, longest):
        q = {field: {"$in": part}, **(also or {})}
        found += with_retries(lambda q=q: list(coll.find(q, fields)), conn.config, what)
    return found
