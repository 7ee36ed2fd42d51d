"""Whole-collection summaries asked per idx window on the embedded engine: the rows of one aggregation."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import make_config, seed
from dsgpt2.db import summaries
from dsgpt2.db.client import Connection
from dsgpt2.db.summaries import aggregate_summary

FACET = [
    {"$match": {"idx": {"$exists": True}}},
    {"$facet": {
        "documents": [{"$count": "n"}],
        "odd": [{"$match": {"odd": True}}, {"$count": "n"}],
        "none": [{"$match": {"odd": "never"}}, {"$count": "n"}],
        "first_odd": [{"$match": {"odd": True}}, {"$sort": {"idx": 1}}, {"$limit": 2},
                      {"$project": {"_id": 0, "idx": 1}}],
        "by_kind": [{"$group": {"_id": "$kind", "n": {"$sum": 1}, "weight": {"$sum": "$w"}}}],
    }},
]  # fmt: skip
GROUP = [
    {"$match": {"idx": {"$exists": True}, "kind": {"$ne": "c"}}},
    {"$project": {"kind": 1, "w": 1}},
    {"$group": {"_id": {"$ifNull": ["$kind", "none"]}, "n": {"$sum": 1}, "w": {"$sum": "$w"}}},
]


def _sorted(rows: list[Any]) -> list[Any]:
    """Rows in one order; a count of nothing as mongod gives it (no row; the embedded engine gives 0)."""
    return sorted((r for r in rows if r != {"n": 0}), key=repr)


@pytest.fixture
def conn() -> Connection:
    conn = Connection(make_config(["s", "empty"]))
    seed(conn, "s", [f"t{i}" for i in range(23)])
    for i in range(23):
        kind = {0: "a", 1: "b", 2: "c"}[i % 3] if i % 5 else None
        conn.db["s"].update_one({"idx": i}, {"$set": {"odd": i % 2 == 1, "kind": kind, "w": i}})
    seed(conn, "empty", [])
    return conn


def test_windows_give_the_rows_of_one_aggregation(conn: Connection, monkeypatch: Any) -> None:
    assert conn.counts_walk  # the shared test server is the embedded engine: windows are asked
    whole = {name: list(conn.db["s"].aggregate(p)) for name, p in (("facet", FACET), ("group", GROUP))}
    monkeypatch.setattr(summaries, "WINDOW", 4)  # 6 windows over 23 documents
    asked: list[Any] = []
    original = type(conn.db["s"]).aggregate

    def spy(self: Any, pipeline: Any, *a: Any, **k: Any) -> Any:
        asked.append(pipeline)
        return original(self, pipeline, *a, **k)

    monkeypatch.setattr(type(conn.db["s"]), "aggregate", spy)
    (facet,) = aggregate_summary(conn, "s", FACET, "test")
    (expected,) = whole["facet"]
    assert facet["first_odd"] == expected["first_odd"] == [{"idx": 1}, {"idx": 3}]
    assert {k: _sorted(v) for k, v in facet.items()} == {k: _sorted(v) for k, v in expected.items()}
    assert facet["none"] == [] and facet["documents"] == [{"n": 23}]
    assert _sorted(aggregate_summary(conn, "s", GROUP, "test")) == _sorted(whole["group"])
    assert len(asked) == 12 and all("$gte" in str(p[0]) for p in asked)
    assert aggregate_summary(conn, "empty", GROUP, "test") == []
    (empty,) = aggregate_summary(conn, "empty", FACET, "test")
    assert empty == {k: [] for k in FACET[1]["$facet"]}


def test_mongod_is_asked_once(conn: Connection, monkeypatch: Any) -> None:
    conn._engine = (__import__("os").getpid(), False, False)  # what mongod answers
    monkeypatch.setattr(summaries, "WINDOW", 4)
    assert _sorted(aggregate_summary(conn, "s", GROUP, "test")) == _sorted(
        list(conn.db["s"].aggregate(GROUP))
    )


def test_counts_on_the_embedded_engine_are_its_count_command_not_an_aggregation(
    conn: Connection, monkeypatch: Any
) -> None:
    """``count_documents`` is an aggregation, which the embedded engine holds whole in memory."""
    from dsgpt2.db import client

    coll = conn.db["s"]

    def no_aggregation(self: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError("an aggregation was sent")

    monkeypatch.setattr(type(coll), "count_documents", no_aggregation)
    assert client.count_in(coll, {"odd": True}) == 11 and client.count_in(coll, {}) == 23
    monkeypatch.setitem(client._EMBEDDED_CLIENTS, id(coll.database.client), False)  # what mongod answers
    with pytest.raises(AssertionError, match="an aggregation was sent"):
        client.count_in(coll, {"odd": True})
