"""Queries bounded by idx in the shape the embedded engine serves from its idx index: field conditions
side by side, never a top-level ``$and`` or ``$or``, which the engine answers by reading every document
of the collection (each window of a windowed summary, each batch of a pass, each chunk a FILTER reads:
a read per window of the whole collection, quadratic in its size)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pymongo import monitoring

from conftest import listen, make_config, seed
from dsgpt2.curation.curate import Curation
from dsgpt2.curation.decontaminate import Decontamination, load_sets
from dsgpt2.curation.passes import run_pass
from dsgpt2.curation.quality import RULES, resolve_thresholds
from dsgpt2.db import summaries
from dsgpt2.db.client import Connection
from dsgpt2.db.filters import conjoin
from dsgpt2.db.summaries import aggregate_summary, count_numbered, first_numbered
from dsgpt2.db.wrapper import MongoWrapper

RANGE = {"idx": {"$gte": 2, "$lt": 9}}
CASES = [
    ((RANGE, {"kind": "a"}), {"idx": {"$gte": 2, "$lt": 9}, "kind": "a"}),
    ((RANGE, {"idx": {"$exists": True}, "w": {"$gt": 3}}), {"idx": {"$gte": 2, "$lt": 9}, "w": {"$gt": 3}}),
    ((RANGE, {"idx": {"$lt": 5}}), {"idx": {"$gte": 2, "$lt": 5}}),
    ((RANGE, {"idx": {"$gte": 4, "$lte": 12}}), {"idx": {"$gte": 4, "$lt": 9, "$lte": 12}}),
    ((RANGE, {"$and": [{"kind": "b"}, {"w": {"$lt": 10}}]}), {**RANGE, "kind": "b", "w": {"$lt": 10}}),
    ((RANGE, {"$or": [{"kind": {"$ne": "c"}}]}), {**RANGE, "kind": {"$ne": "c"}}),
    ((RANGE, {"kind": "a"}, {"kind": "b"}), {**RANGE, "kind": "a", "$and": [{"kind": "b"}]}),
    ((RANGE, {"idx": 3}), {**RANGE, "$and": [{"idx": 3}]}),
    ((RANGE, {"idx": {"$in": [1, 4]}}), {"idx": {"$gte": 2, "$lt": 9, "$in": [1, 4]}}),
    (({"idx": {"$exists": True}}, {"idx": {"$in": [1, 4]}}), {"idx": {"$in": [1, 4]}}),
    (({"idx": {"$exists": True}}, {"idx": {"$in": [1, None]}}), {"idx": {"$exists": True, "$in": [1, None]}}),
    ((RANGE, {"$or": [{"kind": "a"}, {"w": 2}]}), {**RANGE, "$or": [{"kind": "a"}, {"w": 2}]}),
    ((RANGE, {"sub": {"a": 1}}, {"sub": {"$exists": True}}),
     {**RANGE, "sub": {"a": 1}, "$and": [{"sub": {"$exists": True}}]}),
]  # fmt: skip


@pytest.fixture
def conn() -> Connection:
    conn = Connection(make_config(["s"]))
    seed(conn, "s", [f"t{i}" for i in range(30)])
    for i in range(30):
        kind = {0: "a", 1: "b", 2: "c"}[i % 3] if i % 4 else None
        conn.db["s"].update_one({"idx": i}, {"$set": {"kind": kind, "w": i % 7, "sub": {"a": i % 2}}})
    conn.db["s"].insert_one({"note": "a document without idx"})
    return conn


@pytest.mark.parametrize(("queries", "shape"), CASES)
def test_conjoin_is_the_same_query_as_an_and_in_the_indexed_shape(
    conn: Connection, queries: tuple[dict[str, Any], ...], shape: dict[str, Any]
) -> None:
    joined = conjoin(*queries)
    assert joined == shape
    assert next(iter(joined)) == next(iter(queries[0]))  # the first query's field leads
    coll = conn.db["s"]
    ids = {d["_id"] for d in coll.find(joined, {"_id": 1})}
    assert ids == {d["_id"] for d in coll.find({"$and": list(queries)}, {"_id": 1})}


class Queries(monitoring.CommandListener):
    """The filter of every find, aggregate (its first ``$match``) and count command sent."""

    def __init__(self) -> None:
        self.filters: list[tuple[str, dict[str, Any]]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        cmd = event.command
        if event.command_name == "find":
            self.filters.append(("find", cmd.get("filter") or {}))
        elif event.command_name == "count":
            self.filters.append(("count", cmd.get("query") or {}))
        elif event.command_name == "aggregate" and cmd.get("pipeline"):
            first = cmd["pipeline"][0]
            if "$match" in first:
                self.filters.append(("aggregate", first["$match"]))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.fixture
def queries(monkeypatch: pytest.MonkeyPatch) -> Iterator[Queries]:
    listener = Queries()
    listen(monkeypatch, listener)
    yield listener


def _bounded_by_idx(query: dict[str, Any]) -> bool:
    return "idx" in json.dumps(query, default=str)


def test_every_read_bounded_by_idx_is_served_by_the_idx_index(
    queries: Queries, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The windowed counts and summaries, a pass's batches (decontamination against two sets: its
    "checked against each" is no ``$or``) and training's reads under a FILTER that leaves documents out."""
    monkeypatch.setattr(summaries, "WINDOW", 8)
    config = make_config(["s"], FILTER={"kind": {"$ne": "c"}})
    conn = Connection(config)
    seed(conn, "s", [f"text number {i} of the corpus" for i in range(30)])
    for i in range(0, 30, 3):
        conn.db["s"].update_one({"idx": i}, {"$set": {"kind": "c"}})
    assert conn.counts_walk  # the shared test server is the embedded engine

    assert count_numbered(conn, "s", {"kind": "c"}, "test") == 10
    assert first_numbered(conn, "s", {"kind": "c", "idx": {"$gte": 1}}, {"_id": 0}, "test") == {"idx": 3}
    rows = aggregate_summary(conn, "s", [{"$match": {"idx": {"$exists": True}}}, {"$count": "n"}], "test")
    assert sum(r["n"] for r in rows) == 30
    sets = []
    for name in ("one", "two"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps({"text": f"{name} " * 20}) + "\n")
        sets.append(path)
    report = run_pass(conn, ["s"], Decontamination(load_sets(sets, [None, None], 13)), batch_size=7)
    assert report.collections[0].checked == 30
    wrapper = MongoWrapper(config)
    assert [d.index for d in wrapper.get_many([5, 6, 7, 8, 9, 26, 27])] == [5, 7, 8, 26]
    assert [d.index for d in wrapper.get_range(0, 7)] == [1, 2, 4, 5]
    assert wrapper.skipped.get("filtered", 0) >= 6

    bounded = [(cmd, q) for cmd, q in queries.filters if _bounded_by_idx(q)]
    assert len(bounded) >= 15, queries.filters
    served = [(cmd, q) for cmd, q in bounded if not any(k.startswith("$") for k in q)]
    assert served == bounded


class Writes(monitoring.CommandListener):
    """The updates of collection ``s`` and the commitTransaction commands sent, each with whether it ran in
    a transaction and how many statements it carried."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bool, int]] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        cmd = event.command
        if cmd.get("update") == "s" or event.command_name == "commitTransaction":
            in_txn = cmd.get("autocommit") is False
            self.sent.append((event.command_name, in_txn, len(cmd.get("updates", []))))

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "mongod"])
def test_a_pass_writes_each_batch_in_one_transaction_on_the_embedded_engine(
    embedded: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded engine commits each statement of a bulk write on its own (a durable commit each, the
    larger part of a pass's time): one transaction per batch commits once. mongod batches a bulk write
    itself and runs transactions only on a replica set: plain bulk writes there."""
    listener = Writes()
    listen(monkeypatch, listener)
    conn = Connection(make_config(["s"]))
    seed(conn, "s", [f"text number {i} of the corpus" for i in range(30)])
    conn._engine = (os.getpid(), embedded, embedded)  # what buildInfo answers (mongod: the second run)
    listener.sent.clear()
    run_pass(conn, ["s"], Curation(list(RULES), resolve_thresholds({})), batch_size=7)

    updates = [(txn, n) for name, txn, n in listener.sent if name == "update"]
    commits = [s for s in listener.sent if s[0] == "commitTransaction"]
    assert sum(n for _, n in updates) == 30 and len(updates) == 5, listener.sent  # batches of 7, 7, 7, 7, 2
    assert all(txn == embedded for txn, _ in updates)
    assert len(commits) == (5 if embedded else 0)
    assert conn.db["s"].count_documents({"passes.gopher": {"$exists": True}}) == 30
