"""The embedded server's entry point (``dsgpt2/db/secantusd.py``): an update rewrites only the index entries
that change, and every index still answers as a read of every document does."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pymongo
import pytest
from pymongo.errors import BulkWriteError, DuplicateKeyError
from secantus import storage as engine

from conftest import make_config
from dsgpt2.db import secantusd
from dsgpt2.db.client import Connection

INDEXES = {"idx": {"unique": True}, "lsh": {}, "h": {}, "q": {"partialFilterExpression": {"keep": True}},
           "sub.a": {"sparse": True}}  # fmt: skip


def test_an_update_rewrites_only_the_index_entries_that_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In the server's process (here, this one): which indexes each write removes and writes entries of."""
    for name in ("_delete_index_entries", "_write_index_entries", "_delete_doc_row"):
        monkeypatch.setattr(engine.Storage, name, getattr(engine.Storage, name))  # put back afterwards
    written: list[list[str]] = []
    removed: list[list[str]] = []
    write, delete = secantusd._write_entries, secantusd._delete_entries

    def writing(self: Any, db: str, coll: str, doc: Any, indexes: Any, *args: Any, **kw: Any) -> None:
        written.append(sorted(i[0] for i in indexes))
        write(self, db, coll, doc, indexes, *args, **kw)

    def removing(self: Any, db: str, coll: str, doc: Any, indexes: Any, *args: Any, **kw: Any) -> None:
        removed.append(sorted(i[0] for i in indexes))
        delete(self, db, coll, doc, indexes, *args, **kw)

    monkeypatch.setattr(secantusd, "_write_entries", writing)
    monkeypatch.setattr(secantusd, "_delete_entries", removing)
    secantusd.keep_unchanged_index_entries()
    store = engine.Storage(str(tmp_path))
    for field, options in INDEXES.items():
        store.create_index("d", "c", f"{field}_1", {field: 1}, options)
    store.insert("d", "c", [{"idx": i, "lsh": [i, 100 + i], "h": i, "q": 1, "keep": True, "sub": {"a": 1},
                             "s": 0} for i in range(6)])  # fmt: skip
    everything = sorted(f"{f}_1" for f in INDEXES)
    assert written == [everything] * 6 and removed == []

    def after(filter: dict[str, Any], update: dict[str, Any]) -> tuple[list[str], list[str]]:
        written.clear()
        removed.clear()
        assert store.update_matching("d", "c", filter, update)["modified"] == 1
        assert written == removed[-1:] and len(written) == 1
        return written[0], removed[0]

    assert after({"idx": 0}, {"$set": {"s": 1, "passes": {"gopher": True}}}) == ([], [])
    assert after({"idx": 1}, {"$set": {"lsh.1": 7}}) == (["lsh_1"], ["lsh_1"])
    assert after({"idx": 2}, {"$set": {"h": 2.0}}) == (["h_1"], ["h_1"])  # 2 and 2.0: another BSON type
    assert after({"idx": 3}, {"$set": {"keep": False}}) == (["q_1"], ["q_1"])  # out of the partial index
    assert after({"idx": 4}, {"$unset": {"sub": ""}}) == (["sub.a_1"], ["sub.a_1"])
    removed.clear()
    store.delete_matching("d", "c", {"idx": 5})
    assert removed == [everything]


def test_every_index_answers_as_a_scan_after_updates_of_every_kind() -> None:
    """Through the server (the shim's process): indexed fields changed, kept, retyped, removed, moved in
    and out of a partial index, by updates one by one, in transactions and many at once; deletes; a
    duplicate idx refused. Each index then finds what reading every document finds."""
    conn = Connection(make_config(["c"]))
    coll = conn.db["c"]
    for field, options in INDEXES.items():
        coll.create_index(field, **options)
    rnd = random.Random(5)

    def doc(i: int) -> dict[str, Any]:
        return {"idx": i, "lsh": [rnd.randrange(30) for _ in range(4)], "h": rnd.randrange(10),
                "q": rnd.randrange(4), "keep": rnd.random() < 0.5,
                "sub": {"a": rnd.randrange(3)}}  # fmt: skip

    coll.insert_many([doc(i) for i in range(200)])
    updates = [
        lambda i: {"$set": {"s": rnd.random()}},
        lambda i: {"$set": {"lsh": [rnd.randrange(30) for _ in range(3)]}},
        lambda i: {"$set": {"h": rnd.choice([1, 1.0, True, "1", None])}},
        lambda i: {"$set": {"keep": not rnd.random() < 0.5, "q": rnd.randrange(4)}},
        lambda i: {"$unset": {"sub": ""}} if rnd.random() < 0.5 else {"$set": {"sub.a": rnd.randrange(3)}},
        lambda i: {"$push": {"lsh": rnd.randrange(30)}},
    ]
    for rounds in range(3):
        ops = [pymongo.UpdateOne({"idx": i}, rnd.choice(updates)(i)) for i in range(200)]
        if rounds == 0:
            for op in ops[:50]:
                coll.bulk_write([op])
        assert conn.bulk_write("c", ops) >= 0  # one transaction
        coll.update_many({"idx": {"$gte": 150}}, {"$inc": {"q": 1}, "$set": {"h": rounds}})
    coll.delete_many({"idx": {"$in": [3, 33, 133]}})
    with pytest.raises(DuplicateKeyError):
        coll.update_one({"idx": 4}, {"$set": {"idx": 5, "h": 99}})
    with pytest.raises(BulkWriteError):  # the transaction rolled back: idx 6 keeps its entries
        conn.bulk_write("c", [pymongo.UpdateOne({"idx": 6}, {"$set": {"h": 98}}),
                              pymongo.UpdateOne({"idx": 7}, {"$set": {"idx": 8}})])  # fmt: skip

    def ids(query: dict[str, Any], scan: bool = False) -> list[Any]:
        found = coll.find(query, {"_id": 1})
        return sorted(d["_id"] for d in (found.hint([("$natural", 1)]) if scan else found))

    queries = [{"idx": i} for i in range(0, 200, 7)] + [{"lsh": v} for v in range(30)]
    queries += [{"h": v} for v in (0, 1, 1.0, True, "1", None, 2, 98, 99)]
    queries += [{"q": v, "keep": True} for v in range(6)] + [{"sub.a": v} for v in range(3)]
    for query in queries:
        assert ids(query) == ids(query, scan=True), query
    assert coll.count_documents({}) == 197 and ids({"h": 98}) == []


def test_the_server_writes_no_oplog() -> None:
    """dsgpt2 opens no change stream: the oplog is not written (the stock server pruned its oldest entries
    at every commit, a walk that grew with the writes since WiredTiger's last checkpoint). Transactions
    still run: the server still says it is a replica set's primary."""
    conn = Connection(make_config(["c"]))
    oplog = conn.client.local["oplog.rs"]
    before = oplog.count_documents({})
    conn.db["c"].insert_many([{"idx": i} for i in range(20)])
    assert conn.bulk_write("c", [pymongo.UpdateOne({"idx": i}, {"$set": {"s": i}}) for i in range(20)]) == 20
    conn.db["c"].delete_one({"idx": 3})
    assert oplog.count_documents({}) == before
    assert conn.client.admin.command("hello").get("setName")


def _entries(store: engine.Storage, name: str) -> list[bytes]:
    c = store._cursor(engine._IDX_ENTRIES_TABLE)
    c.set_key("d", "c", name, b"")
    found, out = c.search_near(), []
    if found < 0:
        found = c.next()
    while found != engine.wt.WT_NOTFOUND and tuple(c.get_key()[:3]) == ("d", "c", name):
        out.append(bytes(c.get_key()[3]))
        found = c.next()
    return out


def test_an_index_built_over_documents_holds_the_stock_builds_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In the server's process: an index made after the documents (multikey, mixed types, sparse, partial,
    descending, compound) holds exactly the entries and catalog options of the stock build, written in key
    order through sorted runs spilled to files and merged; what a killed build left is removed, and no
    run file stays behind."""
    monkeypatch.setattr(engine.Storage, "create_index", engine.Storage.create_index)
    monkeypatch.setattr(secantusd, "_RUN", 7)
    monkeypatch.setattr(secantusd, "_TXN", 5)
    rnd = random.Random(3)
    docs = [{"idx": i, "lsh": [rnd.randrange(40) for _ in range(rnd.randrange(4))],
             "h": rnd.choice([1, 1.0, "1", None]), "keep": rnd.random() < 0.5,
             **({"sub": {"a": rnd.randrange(3)}} if i % 3 else {})}
            for i in range(60)]  # fmt: skip
    specs = {"lsh_1": ({"lsh": 1}, {}), "h_-1": ({"h": -1}, {}), "sub.a_1": ({"sub.a": 1}, {"sparse": True}),
             "keep_h": ({"keep": 1, "h": 1}, {"partialFilterExpression": {"keep": True}})}  # fmt: skip
    stock, ours = engine.Storage(str(tmp_path / "stock")), engine.Storage(str(tmp_path / "ours"))
    for store in (stock, ours):
        store.insert("d", "c", [dict(d) for d in docs])
    leftover = ours._cursor(engine._IDX_ENTRIES_TABLE)
    leftover["d", "c", "lsh_1", engine._pack_entry(b"killed build", 12345)] = b""  # a build killed half-way
    for name, (key, options) in specs.items():
        stock.create_index("d", "c", name, key, options)
    secantusd.build_indexes_in_key_order()
    writes: list[int] = []
    write = secantusd._write_in_key_order

    def counting(self: Any, db: str, coll: str, name: str, entries: Any) -> None:
        writes.append(1)
        write(self, db, coll, name, entries)

    monkeypatch.setattr(secantusd, "_write_in_key_order", counting)
    for name, (key, options) in specs.items():
        assert ours.create_index("d", "c", name, key, options) is True
        assert ours.create_index("d", "c", name, key, options) is False  # made already
    assert len(writes) == len(specs)
    for name in specs:
        assert _entries(ours, name) == _entries(stock, name) and _entries(ours, name), name
    assert {i["name"]: i for i in ours.list_indexes("d", "c")} == {
        i["name"]: i for i in stock.list_indexes("d", "c")
    }
    assert len(_entries(ours, "lsh_1")) > 3 * secantusd._RUN  # the merge of several runs was exercised
    assert not [f for f in os.listdir(ours.home_path) if f.startswith("index-build-")]
    with pytest.raises(engine.IndexConflict):  # unique builds keep the stock checks
        ours.create_index("d", "c", "h_u", {"h": 1}, {"unique": True})

    class Killed(Exception):
        pass

    def killed_after_two_transactions(self: Any, db: str, coll: str, name: str, entries: Any) -> None:
        def some() -> Any:
            for n, entry in enumerate(entries):
                if n == 2 * secantusd._TXN:
                    raise Killed
                yield entry

        write(self, db, coll, name, some())

    monkeypatch.setattr(secantusd, "_write_in_key_order", killed_after_two_transactions)
    with pytest.raises(Killed):
        ours.create_index("d", "c", "lsh_2", {"lsh": 1}, {})
    assert "lsh_2" not in {i["name"] for i in ours.list_indexes("d", "c")}  # no index for part of them
    assert len(_entries(ours, "lsh_2")) == 2 * secantusd._TXN  # what the two transactions committed
    monkeypatch.setattr(secantusd, "_write_in_key_order", write)
    assert ours.create_index("d", "c", "lsh_2", {"lsh": 1}, {}) is True
    assert _entries(ours, "lsh_2") == _entries(stock, "lsh_1")


def test_indexes_built_over_documents_answer_as_a_scan_through_the_server() -> None:
    """Through the server: indexes made after the documents find what reading every document finds, and
    keep doing so as the documents change."""
    conn = Connection(make_config(["c"]))
    coll = conn.db["c"]
    rnd = random.Random(9)
    coll.insert_many([{"idx": i, "lsh": [rnd.randrange(30) for _ in range(4)], "h": rnd.choice([1, 1.0, "1"]),
                       "q": rnd.randrange(4), "keep": rnd.random() < 0.5} for i in range(300)])  # fmt: skip
    for field, options in INDEXES.items():
        coll.create_index(field, **options)
    conn.bulk_write(
        "c", [pymongo.UpdateOne({"idx": i}, {"$set": {"lsh": [rnd.randrange(30)]}}) for i in range(0, 300, 4)]
    )
    coll.delete_many({"idx": {"$in": [5, 6]}})

    def ids(query: dict[str, Any], scan: bool = False) -> list[Any]:
        found = coll.find(query, {"_id": 1})
        return sorted(d["_id"] for d in (found.hint([("$natural", 1)]) if scan else found))

    queries = [{"lsh": v} for v in range(30)] + [{"h": v} for v in (1, 1.0, "1")] + [{"idx": 7}, {"idx": 5}]
    queries += [{"q": v, "keep": True} for v in range(4)]
    for query in queries:
        assert ids(query) == ids(query, scan=True), query
    assert sum(len(ids({"lsh": v})) for v in range(30)) > 300
    with pytest.raises(pymongo.errors.OperationFailure):  # a unique index over duplicates: refused
        coll.create_index("h", unique=True, name="h_unique")


def test_an_in_list_matches_as_the_stock_operator_with_one_set_lookup_a_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the server's process (here, this one): an ``$in`` matches the documents the stock operator
    matches, for lists and values of every type; a list of ints or of strings against values of its type
    costs no comparison with the list's values (the stock operator: one each, k^2 for a query of k)."""
    from bson import Decimal128, Int64, ObjectId, Regex
    from secantus import query
    from secantus.collation import parse

    from dsgpt2.db.client import IN_LISTS_BY_SET

    assert secantusd.IN_LISTS_BY_SET == IN_LISTS_BY_SET
    ids = [ObjectId(), ObjectId()]
    values = [ids[0], [ids[1]], 7, 7.0, True, 1, 0, "7", "a", "A", None, Int64(7), Decimal128("7"), [7, 8],
              [["a"]], ["a", 3], [], {"x": 7}, float("nan"), 2**40]  # fmt: skip
    docs = [{"v": v} for v in values] + [
        {},
        {"v": {"w": 7}},
        {"v": [{"w": 7}]},
        {"v": [[7], 9]},
        {"v": [["a"]]},
    ]
    lists = [ids, ids[:1], [ids[0], 7], [7], [7, 8, 2**40], [1], [True], ["7"], ["a", "b"], [7, "a"], [None],
             [7.0], [], [[7, 8]], [Regex("^a")], ["A"], [Int64(7)], [0, 1], [{"x": 7}],
             [float("nan")]]  # fmt: skip
    questions = [{"v": {"$in": k}} for k in lists] + [
        {"v.w": {"$in": [7, 8]}},
        {"v": {"$elemMatch": {"$in": [7]}}},
    ]
    questions += [{"v": {"$not": {"$in": [7, "a"]}}}, {"v": {"$nin": [7]}}, {"$or": [{"v": {"$in": ["a"]}}]}]
    questions += [{"v": {"$elemMatch": {"$in": ["a"]}}}]
    # Strings compared under a collation keep the stock operator ("a" is "A" at strength 2).
    collations = [None, parse({"locale": "en", "strength": 2})]
    stock = [[query.matches(d, q, collation=c) for d in docs] for q in questions for c in collations]
    monkeypatch.setattr(query, "_op_matches", query._op_matches)  # put back afterwards
    secantusd.match_in_lists_by_set()
    assert [[query.matches(d, q, collation=c) for d in docs] for q in questions for c in collations] == stock
    assert query.matches({"v": "A"}, {"v": {"$in": ["a", "b"]}}, collation=collations[1])

    compared = []
    equal = query._eq_numeric_aware
    monkeypatch.setattr(query, "_eq_numeric_aware", lambda a, b, c=None: compared.append(1) or equal(a, b, c))
    ints, names = list(range(0, 2000, 2)), [f"h{i}" for i in range(1000)]
    for v in range(200):
        assert query.matches(
            {"v": v, "h": [f"h{v}", f"x{v}"]}, {"v": {"$in": ints}, "h": {"$in": names}}
        ) == (v % 2 == 0)
    assert compared == []
    monkeypatch.setattr(query, "_op_matches", secantusd._op_matches)
    assert query.matches({"v": 1999}, {"v": {"$in": ints}}) is False
    assert len(compared) == len(ints)  # the stock operator: every value of the list


_ABANDON = """
import sys, pymongo
client = pymongo.MongoClient(sys.argv[1])
coll = client[sys.argv[2]]["c"]
session = client.start_session()
session.start_transaction()
coll.update_one({"idx": 1}, {"$set": {"h": -1}}, session=session)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_transaction_its_client_abandoned_stops_holding_its_documents_within_seconds() -> None:
    """A pass killed mid-batch leaves its transaction open on the server (a session outlives its
    connections). Run again, the pass writes the same documents: it waits for that transaction to be
    reaped as idle, 10 s here (mongod's 60 s stalled every re-run of a killed pass for a minute)."""
    import subprocess
    import sys
    import time

    conn = Connection(make_config(["c"]))
    conn.db["c"].insert_many([{"idx": i, "h": 0} for i in range(3)])
    with subprocess.Popen([sys.executable, "-c", _ABANDON, conn.config.uri, conn.config.db],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as killed:  # fmt: skip
        try:
            assert killed.stdout is not None and killed.stdout.readline().strip() == "ready"
        finally:
            killed.kill()
    start = time.monotonic()
    assert conn.bulk_write("c", [pymongo.UpdateOne({"idx": i}, {"$set": {"h": 2}}) for i in range(3)]) == 3
    assert time.monotonic() - start < 30
    assert [d["h"] for d in conn.db["c"].find({}, {"h": 1}).sort("idx", 1)] == [2, 2, 2]
