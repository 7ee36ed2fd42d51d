from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import make_config, run_cli, seed, store_config
from dsgpt2.db.client import Connection
from dsgpt2.db.validate import fix_collection, require_valid, validate_collection
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import CorpusError


def _conn(*names: str) -> Connection:
    return Connection(make_config(list(names) or ["a"]))


def _kinds(conn: Connection, name: str) -> dict[str, str]:
    return {p.kind: p.message + " | " + p.fix for p in validate_collection(conn, name).problems}


def test_clean_collection_passes() -> None:
    conn = _conn("a")
    seed(conn, "a", ["x", "y", "z"])
    report = validate_collection(conn, "a")
    assert report.ok and report.problems == [] and report.documents == 3


def test_missing_idx_index_is_named_with_the_fix() -> None:
    conn = _conn("a")
    seed(conn, "a", ["x", "y"], index=False)
    kinds = _kinds(conn, "a")
    assert list(kinds) == ["missing_idx_index"]
    assert "createIndex({idx: 1}, {unique: true})" in kinds["missing_idx_index"]
    assert "validate --fix" in kinds["missing_idx_index"]


def test_gaps_report_count_and_first_missing() -> None:
    conn = _conn("a")
    seed(conn, "a", [f"t{i}" for i in range(10)])
    conn.db["a"].delete_many({"idx": {"$in": [3, 7]}})
    conn.db["meta_info"].update_one({"collection": "a"}, {"$set": {"count": 8}})
    kinds = _kinds(conn, "a")
    assert list(kinds) == ["gaps"]
    assert "2 idx value(s) between 0 and 9" in kinds["gaps"]
    assert "first missing idx is 3" in kinds["gaps"]


def test_duplicates_and_string_idx_and_meta_mismatch() -> None:
    conn = _conn("a")
    seed(conn, "a", ["a", "b", "c"], index=False)
    conn.db["a"].insert_many([{"idx": 1, "filt_text": "dup"}, {"idx": "7", "filt_text": "str"}])
    kinds = _kinds(conn, "a")
    assert set(kinds) == {"duplicate_idx", "non_integer_idx", "missing_idx_index", "meta_count_mismatch"}
    assert "e.g. [1]" in kinds["duplicate_idx"]
    assert "'7' (str)" in kinds["non_integer_idx"] and "NumberLong" in kinds["non_integer_idx"]
    assert "says 3 documents, the collection holds 5" in kinds["meta_count_mismatch"]


def test_empty_and_missing_meta() -> None:
    conn = _conn("a", "b")
    seed(conn, "a", ["x"], meta=False)
    assert _kinds(conn, "b").keys() == {"empty"}
    report = validate_collection(conn, "a")
    assert report.ok  # a missing meta count is a warning: the wrapper counts instead
    assert [p.kind for p in report.problems] == ["no_meta_count"]


def test_training_refuses_a_broken_corpus() -> None:
    conn = _conn("a")
    seed(conn, "a", ["x", "y", "z"])
    conn.db["a"].delete_one({"idx": 1})
    with pytest.raises(CorpusError, match=r"a: gaps .*fix: .*validate"):
        require_valid(conn)
    conn.db["a"].insert_one({"idx": 1, "filt_text": "back"})
    assert [r.name for r in require_valid(conn)] == ["a"]


def test_an_empty_collection_is_not_offered_a_way_past_it() -> None:
    """Training past a problem skips bad documents; a collection with none has nothing to skip to."""
    anyway = ", or train on it anyway with --allow_corpus_problems"
    conn = _conn("a", "b")
    seed(conn, "a", ["x", "y"])
    conn.db.create_collection("b")
    with pytest.raises(CorpusError) as refused:
        require_valid(conn, full=False, override=anyway)
    assert "b: empty" in str(refused.value) and "--allow_corpus_problems" not in str(refused.value)
    conn.db["a"].delete_one({"idx": 1})
    conn.db["a"].insert_one({"idx": 3, "filt_text": "z"})
    with pytest.raises(CorpusError, match="--allow_corpus_problems"):
        require_valid(conn, override=anyway)


def _break(conn: Connection, how: str) -> None:
    a, meta = conn.db["a"], conn.db["meta_info"]
    if how == "no index":
        a.drop_indexes()
    elif how == "gap, count kept":
        a.delete_one({"idx": 2})
    elif how == "gap, count lowered":
        a.delete_one({"idx": 2})
        meta.update_one({"collection": "a"}, {"$set": {"count": 4}})
    elif how == "string idx":
        a.insert_one({"idx": "7", "filt_text": "str"})
        meta.update_one({"collection": "a"}, {"$set": {"count": 6}})
    elif how == "string for an int":
        a.update_one({"idx": 2}, {"$set": {"idx": "2"}})
    elif how == "boolean for an int":
        a.update_one({"idx": 2}, {"$set": {"idx": True}})
    elif how == "null idx":
        a.update_one({"idx": 0}, {"$set": {"idx": None}})
    elif how == "no idx":
        a.update_one({"idx": 0}, {"$unset": {"idx": ""}})
    elif how == "negative idx":
        a.update_one({"idx": 0}, {"$set": {"idx": -1}})
    elif how == "count wrong":
        meta.update_one({"collection": "a"}, {"$set": {"count": 9}})


@pytest.mark.parametrize(
    ("how", "kind"),
    [
        ("no index", "missing_idx_index"),
        ("gap, count kept", "meta_count_mismatch"),
        ("gap, count lowered", "idx_ends"),
        ("string idx", "idx_ends"),
        ("string for an int", "idx_ends"),
        ("boolean for an int", "idx_ends"),
        ("null idx", "idx_ends"),
        ("no idx", "idx_ends"),
        ("negative idx", "idx_ends"),
        ("count wrong", "meta_count_mismatch"),
    ],
)
def test_the_quick_check_at_start_refuses_what_the_full_check_does(how: str, kind: str) -> None:
    """From the index and the counts alone, each broken corpus is refused, naming validate. The
    embedded engine keeps no count (counting walks every record): meta_info's count stands for it, a
    count that is wrong shows at the index's last end, and a document deleted from the middle is
    skipped and counted as missing where training reads it."""
    conn = _conn("a")
    seed(conn, "a", [f"t{i}" for i in range(5)])
    assert require_valid(conn, full=False)[0].problems == []
    _break(conn, how)
    if conn.counts_walk and how in ("gap, count kept", "count wrong"):
        kind = {"gap, count kept": "", "count wrong": "idx_ends"}[how]
    if not kind:
        assert require_valid(conn, full=False)[0].problems == []
        wrapper = MongoWrapper(conn.config, connection=conn)
        assert [d.index for d in wrapper.get_range(0, 5)] == [0, 1, 3, 4]
        assert wrapper.skipped["missing"] == 1
        assert not validate_collection(conn, "a").ok
        return
    with pytest.raises(CorpusError, match=rf"a: {kind} .*fix: .*validate") as refused:
        require_valid(conn, full=False)
    assert not validate_collection(conn, "a").ok, refused.value  # the full check agrees


def test_fix_creates_index_and_records_count() -> None:
    conn = _conn("a")
    seed(conn, "a", ["x", "y"], index=False, meta=False)
    done = fix_collection(conn, "a")
    assert done == ["a: fixed: created the unique index on idx", "a: fixed: recorded count 2 in meta_info"]
    assert validate_collection(conn, "a").problems == []
    # Run again: it says there is nothing left, rather than nothing at all.
    assert fix_collection(conn, "a") == ["a: nothing to fix"]


def test_fix_does_not_paper_over_duplicates() -> None:
    conn = _conn("a")
    seed(conn, "a", ["x", "y"], index=False)
    conn.db["a"].insert_one({"idx": 0, "filt_text": "dup"})
    (said,) = fix_collection(conn, "a")
    assert said.startswith("a: not fixed: duplicate_idx") and "re-ingest" in said
    assert "duplicate_idx" in _kinds(conn, "a")


def test_validate_cli_exit_codes_and_json(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path)
    from dsgpt2.db.config import load_config

    conn = Connection(load_config(cfg))
    seed(conn, "a", ["x", "y", "z"])
    ok = run_cli("validate", "--config", str(cfg))
    assert ok.returncode == 0, ok.stderr
    assert "a: 3 documents, OK" in ok.stdout

    conn.db["a"].delete_one({"idx": 1})
    bad = run_cli("validate", "--config", str(cfg), "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report[0]["ok"] is False
    assert {p["kind"] for p in report[0]["problems"]} == {"gaps", "meta_count_mismatch"}
    assert bad.stderr.strip().splitlines()[-1].startswith("dsgpt2: error: problems found in a")
    assert "Traceback" not in bad.stderr


def test_documents_past_the_mark_of_a_running_ingest_are_no_problem() -> None:
    """An ingest inserts a batch, then raises the count: training may start (or resume) in between."""
    conn = Connection(make_config(["a"]))
    seed(conn, "a", ["one", "two", "three", "four", "five"])
    conn.db["meta_info"].update_one(
        {"collection": "a"}, {"$set": {"count": 3, "sources": {"k": {"complete": False}}}}
    )
    report = validate_collection(conn, "a")
    assert report.ok and [p.kind for p in report.problems] == ["ingest_in_progress"]
    conn.db["meta_info"].update_one({"collection": "a"}, {"$set": {"sources.k.complete": True}})
    assert [p.kind for p in validate_collection(conn, "a").problems] == ["meta_count_mismatch"]
