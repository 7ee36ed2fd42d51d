"""`dsgpt2 index`: a collection another application wrote, numbered in place and trained on through
TEXT_FIELD; killed and re-run exactly once; documents added later numbered next; a concurrent pass
refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from bson import ObjectId

from conftest import db_for, make_config, run_cli, store_config
from dsgpt2.db import numbering
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta
from dsgpt2.db.validate import quick_check, validate_collection
from dsgpt2.db.wrapper import MongoWrapper


def articles(n: int, start: int = 0) -> list[dict]:
    """Documents as an application stores them: its own _id (out of insertion order), no idx."""
    docs = [{"_id": ObjectId(f"{(7919 * i) % 100003:024x}"), "title": f"t{i}", "body": f"Article {i} body."}
            for i in range(start, start + n)]  # fmt: skip
    return docs


def _file_store(tmp_path: Path, docs: list[dict]) -> tuple[Path, Path]:
    cfg, store = store_config(tmp_path, ["articles"])
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "TEXT_FIELD": "body"}))
    conn = _open(store)
    conn.db["articles"].insert_many(docs)
    return cfg, store


def _open(store: Path) -> Connection:
    return Connection(make_config(["articles"], **db_for(store),
                                  TEXT_FIELD="body"))  # fmt: skip


def _in_id_order(conn: Connection) -> list[tuple]:
    return [(d.get("idx"), d["body"]) for d in conn.db["articles"].find({}, sort=[("_id", 1)])]


def test_a_foreign_collection_is_numbered_in_place_and_read_through_text_field(tmp_path: Path) -> None:
    docs = articles(250)
    cfg, store = _file_store(tmp_path, docs)
    result = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body",
                     "--batch_size", "40")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "250 document(s) numbered by this run, idx 0..249" in result.stdout
    conn = _open(store)
    ordered = _in_id_order(conn)
    assert [i for i, _ in ordered] == list(range(250))  # in _id order
    assert conn.db["articles"].count_documents({"title": {"$exists": True}}) == 250  # nothing else touched
    meta = read_meta(conn, ["articles"])["articles"]
    assert meta["count"] == 250 and meta["numbered_in_place"]["field"] == "body"
    assert validate_collection(conn, "articles").ok and quick_check(conn, "articles", meta).ok
    wrapper = MongoWrapper(conn.config)
    assert [d.text for d in wrapper.get_range(0, 250)] == [body for _, body in ordered]


def test_documents_added_later_get_the_next_numbers(tmp_path: Path) -> None:
    cfg, store = _file_store(tmp_path, articles(100))
    assert (
        run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body").returncode == 0
    )
    conn = _open(store)
    # The application goes on inserting documents without idx: the partial unique index lets it.
    conn.db["articles"].insert_many(articles(30, start=100))
    meta = read_meta(conn, ["articles"])["articles"]
    report = validate_collection(conn, "articles")
    assert report.ok and any(
        p.kind == "unnumbered" and "30 document(s)" in p.message for p in report.problems
    )
    assert quick_check(conn, "articles", meta).ok  # training reads the 100 until they are numbered
    again = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body")
    assert again.returncode == 0 and "30 document(s) numbered by this run, idx 0..129" in again.stdout
    conn = _open(store)
    first = {d["body"]: d["idx"] for d in conn.db["articles"].find()}
    assert sorted(first.values()) == list(range(130))
    assert all(first[f"Article {i} body."] >= 100 for i in range(100, 130))
    later = sorted(articles(30, start=100), key=lambda d: d["_id"])
    assert [first[d["body"]] for d in later] == list(range(100, 130))
    assert validate_collection(conn, "articles").problems == []


class Crash(Exception):
    pass


@pytest.mark.parametrize("where", ["between_batches", "inside_a_batch"])
def test_a_killed_pass_finishes_exactly_once(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    conn = Connection(make_config(["articles"], TEXT_FIELD="body"))
    conn.db["articles"].insert_many(articles(500))
    straight = sorted(d["_id"] for d in conn.db["articles"].find())
    calls = {"n": 0}
    record, number = numbering._record, numbering._number

    def crash_record(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Crash
        record(*args, **kwargs)

    def crash_bulk(conn_, coll, ids, first):
        calls["n"] += 1
        if calls["n"] == 3:  # an ordered bulk write stopped half-way: its first half applied
            number(conn_, coll, ids[: len(ids) // 2], first)
            raise Crash
        return number(conn_, coll, ids, first)

    if where == "between_batches":
        monkeypatch.setattr(numbering, "_record", crash_record)
    else:
        monkeypatch.setattr(numbering, "_number", crash_bulk)
    with pytest.raises(Crash):
        numbering.index_collection(conn, "articles", "body", batch_size=60)
    done = conn.db["articles"].count_documents({"idx": {"$exists": True}})
    assert 0 < done < 500
    monkeypatch.undo()
    report = numbering.index_collection(conn, "articles", "body", batch_size=60)
    assert report.numbered == 500 - done and report.count == 500
    by_id = {d["_id"]: d["idx"] for d in conn.db["articles"].find()}
    assert [by_id[i] for i in straight] == list(range(500))


@pytest.mark.parametrize("code", [189, 11600])
def test_the_pass_reads_one_cursor_and_reopens_it_after_a_transient_error(tmp_path: Path, code: int) -> None:
    """The documents come from one sorted cursor (a query per batch would read the collection from the
    start each time on the embedded engine); a getMore that fails is retried on a new cursor after the
    last _id numbered, and the numbers are the straight run's."""
    from wire_server import fail_point

    cfg, store = _file_store(tmp_path, articles(300))
    uri = json.loads(cfg.read_text())["MONGO_CONNECTION_STRING"]
    try:
        fail_point(uri, {"skip": 1, "times": 2}, failCommands=["getMore"], errorCode=code)
        done = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body",
                       "--batch_size", "40", "--no_progress")  # fmt: skip
    finally:
        fail_point(uri, "off")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("transient MongoDB error") == 2, done.stderr
    conn = _open(store)
    assert [idx for idx, _ in _in_id_order(conn)] == list(range(300))
    assert validate_collection(conn, "articles").problems == []
    conn.close()


def test_refusals_are_one_line(tmp_path: Path) -> None:
    cfg, store = _file_store(tmp_path, articles(20))
    conn = _open(store)
    lease = {"indexing": {"owner": "elsewhere:42", "heartbeat": time.time()}}
    conn.db["meta_info"].update_one({"collection": "articles"}, {"$set": lease}, upsert=True)
    busy = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body")
    assert busy.returncode == 2 and "another process (elsewhere:42) is numbering 'articles'" in busy.stderr
    assert busy.stderr.count("\n") == 1
    conn.db["meta_info"].update_one({"collection": "articles"}, {"$set": {"indexing": {"owner": None},
                                     "sources": {"k": {"complete": False}}}})  # fmt: skip
    ingesting = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body")
    assert (
        ingesting.returncode == 2 and "an ingest into 'articles' is unfinished or running" in ingesting.stderr
    )
    # A lease whose holder stopped giving signs of life (a killed pass) is taken over.
    stale = {"indexing": {"owner": "dead:1", "heartbeat": time.time() - 61}}
    conn.db["meta_info"].update_one({"collection": "articles"}, {"$set": stale, "$unset": {"sources": ""}})
    took = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body")
    assert took.returncode == 0, took.stderr
    conn = _open(store)
    conn.db["articles"].update_many({}, {"$unset": {"idx": ""}})
    conn.db["articles"].drop_indexes()
    missing = run_cli("index", "--config", str(cfg), "--collection", "nope", "--field", "body")
    assert missing.returncode == 2 and "collection 'nope' does not exist" in missing.stderr
    conn.db["meta_info"].update_one({"collection": "articles"}, {"$unset": {"sources": ""}})
    conn.db["articles"].update_one({}, {"$set": {"idx": "7"}})
    broken = run_cli("index", "--config", str(cfg), "--collection", "articles", "--field", "body")
    assert broken.returncode == 2 and "have an idx that is not an integer" in broken.stderr
    assert _open(store).db["articles"].count_documents({"idx": {"$type": "int"}}) == 0  # nothing numbered
