"""High-water marks (dsgpt2/corpus/marks.py) on the embedded database: the marks are meta_info's counts;
a trained prefix is recorded as a seeded sample of its documents and checked again at resume, growth
accepted, a shrunken or edited prefix refused; a run's note of how far it read, kept across its
restarts and best effort."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from pymongo.errors import OperationFailure

from conftest import make_config, seed
from dsgpt2.corpus import marks
from dsgpt2.corpus.marks import (
    SAMPLE,
    prefix_problems,
    prefix_record,
    prefix_sample,
    read_marks,
    record_trained,
)
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta, write_meta


def docs(n: int, start: int = 0) -> list[str]:
    return [f"document {i} of the corpus" for i in range(start, start + n)]


@pytest.fixture
def conn() -> Connection:
    """Collections a (100 documents) and b (50), each with its meta_info count."""
    conn = Connection(make_config(["a", "b"]))
    seed(conn, "a", docs(100))
    seed(conn, "b", docs(50))
    return conn


def grow(conn: Connection, name: str, start: int, n: int) -> None:
    """Append ``n`` documents to ``name`` from idx ``start`` and raise its mark, as ingest does."""
    conn.db[name].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(docs(n, start), start)])
    write_meta(conn, name, {"count": start + n})


def test_the_marks_are_the_meta_info_counts_in_config_order(conn: Connection) -> None:
    assert read_marks(conn) == (100, 50)
    assert read_marks(Connection(make_config(["b", "a"]))) == (50, 100)
    # The mark is what meta_info records, not what the collection holds: documents past it are still
    # being ingested, and no run reads them yet.
    conn.db["a"].insert_one({"idx": 100, "filt_text": "arriving"})
    assert read_marks(conn) == (100, 50)
    grow(conn, "b", 50, 5)
    assert read_marks(conn) == (100, 55)


def test_a_collection_without_a_recorded_count_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    conn = Connection(make_config(["a", "c"]))
    seed(conn, "a", docs(10))
    seed(conn, "c", docs(7), meta=False)
    with caplog.at_level(logging.WARNING):
        assert read_marks(conn) == (10, 7)
    assert "meta_info has no count for 'c'; counted 7 documents" in caplog.text


def test_the_sample_holds_both_ends_and_depends_on_the_seed_alone() -> None:
    assert prefix_sample(0, 1) == [] and prefix_sample(-3, 1) == []
    assert prefix_sample(1, 1) == [0]
    for mark in (2, 5, 17, 1000, 10**8):
        sample = prefix_sample(mark, 7)
        assert sample[0] == 0 and sample[-1] == mark - 1
        assert sample == sorted(set(sample)) and len(sample) <= SAMPLE + 2
        assert all(0 <= i < mark for i in sample)
        assert prefix_sample(mark, 7) == sample  # the same at save and at resume
    assert prefix_sample(10**8, 7) != prefix_sample(10**8, 8)
    assert len(prefix_sample(10**8, 7)) == SAMPLE + 2  # 16 draws and the two ends, none the same
    assert prefix_sample(3, 7) == [0, 1, 2]  # a short prefix: every document


def test_a_record_names_each_collection_its_mark_sample_and_digest(conn: Connection) -> None:
    record = prefix_record(conn, (100, 50), seed=3)
    assert set(record) == {"a", "b"} and record["a"]["mark"] == 100 and record["b"]["mark"] == 50
    assert record["a"]["sample"] == prefix_sample(100, 3) and record["b"]["sample"] == prefix_sample(50, 3)
    assert len(record["a"]["digest"]) == 16 and record["a"]["digest"] != record["b"]["digest"]
    assert json.loads(json.dumps(record)) == record  # a checkpoint keeps it as JSON
    assert prefix_record(conn, (100, 50), seed=3) == record  # the same documents, the same record
    assert prefix_record(conn, (100, 50), seed=4)["a"]["digest"] != record["a"]["digest"]
    with pytest.raises(ValueError):
        prefix_record(conn, (100,), seed=3)  # a mark for every configured collection


def test_the_same_corpus_and_a_grown_one_hold_the_trained_prefix(conn: Connection) -> None:
    record = prefix_record(conn, (100, 50), seed=3)
    assert prefix_problems(conn, record, (100, 50)) == []
    grow(conn, "a", 100, 30)
    grow(conn, "b", 50, 1)
    assert prefix_problems(conn, record, read_marks(conn)) == []
    # A collection empty when the run saved may grow from nothing.
    empty = Connection(make_config(["a", "b", "e"]))
    seed(empty, "e", [])
    before = prefix_record(empty, (130, 51, 0), seed=3)
    assert before["e"] == {"mark": 0, "sample": [], "digest": before["e"]["digest"]}
    grow(empty, "e", 0, 4)
    assert prefix_problems(empty, before, (130, 51, 4)) == []


def test_a_shrunken_prefix_is_refused(conn: Connection) -> None:
    record = prefix_record(conn, (100, 50), seed=3)
    assert prefix_problems(conn, record, (90, 50)) == ["a holds 90 documents, fewer than the 100 trained on"]
    assert prefix_problems(conn, record, (99, 10)) == [
        "a holds 99 documents, fewer than the 100 trained on",
        "b holds 10 documents, fewer than the 50 trained on",
    ]


@pytest.mark.parametrize("change", ["edited", "removed", "renumbered"])
def test_a_changed_sampled_document_is_refused_and_its_original_accepted_again(
    conn: Connection, change: str
) -> None:
    record = prefix_record(conn, (100, 50), seed=3)
    idx = record["a"]["sample"][len(record["a"]["sample"]) // 2]
    original = conn.db["a"].find_one({"idx": idx})
    if change == "edited":
        conn.db["a"].update_one({"idx": idx}, {"$set": {"filt_text": "rewritten in place"}})
    elif change == "removed":
        conn.db["a"].delete_one({"idx": idx})
    else:
        conn.db["a"].update_one({"idx": idx}, {"$set": {"idx": 1000}})
    said = ["a: documents below idx 100 (trained on) were changed or removed"]
    assert prefix_problems(conn, record, (100, 50)) == said
    assert prefix_problems(conn, record, (120, 50)) == said  # growth does not hide it
    conn.db["a"].delete_many({"_id": original["_id"]})
    conn.db["a"].insert_one(original)
    assert prefix_problems(conn, record, (100, 50)) == []


def test_only_the_text_of_the_sampled_documents_counts(conn: Connection) -> None:
    """The check samples: an edit outside the sample, or of a field other than the text (curation's
    marks, say), leaves the prefix as trained."""
    record = prefix_record(conn, (100, 50), seed=3)
    outside = next(i for i in range(100) if i not in record["a"]["sample"])
    conn.db["a"].update_one({"idx": outside}, {"$set": {"filt_text": "rewritten in place"}})
    conn.db["a"].update_many({}, {"$set": {"dup_of": "b:0", "passes": {"gopher": False}}})
    assert prefix_problems(conn, record, (100, 50)) == []


def test_the_digest_reads_the_configured_text_field() -> None:
    conn = Connection(make_config(["a"], TEXT_FIELD="body"))
    conn.db["a"].insert_many([{"idx": i, "body": t, "filt_text": "same"} for i, t in enumerate(docs(20))])
    record = prefix_record(conn, (20,), seed=1)
    conn.db["a"].update_many({}, {"$set": {"filt_text": "other"}})
    assert prefix_problems(conn, record, (20,)) == []
    conn.db["a"].update_one({"idx": 19}, {"$set": {"body": "rewritten"}})  # the last is always sampled
    assert prefix_problems(conn, record, (20,)) == [
        "a: documents below idx 20 (trained on) were changed or removed"
    ]


def test_a_collection_the_record_does_not_name_is_not_checked(conn: Connection) -> None:
    """A collection added to COLLECTIONS after the save: nothing of it was trained on."""
    record = prefix_record(Connection(make_config(["a"])), (100,), seed=3)
    assert set(record) == {"a"}
    assert prefix_problems(conn, record, (100, 0)) == []


def test_a_run_notes_how_far_it_read_and_keeps_its_step_across_restarts(conn: Connection) -> None:
    started = time.time()
    record_trained(conn, (np.int64(100), 50), "runs/ckpt", step=np.int64(4))
    meta = read_meta(conn, ["a", "b"])
    assert meta["a"]["count"] == 100 and meta["b"]["count"] == 50  # the marks themselves untouched
    noted = meta["a"]["trained"]
    assert {k: noted[k] for k in ("mark", "run", "step")} == {"mark": 100, "run": "runs/ckpt", "step": 4}
    assert started - 1 <= noted["at"] <= time.time() + 1
    assert meta["b"]["trained"]["mark"] == 50 and meta["b"]["trained"]["step"] == 4
    assert read_marks(conn) == (100, 50)

    # The same run started again (no step yet): its mark moves on, the step its checkpoints reached stays.
    grow(conn, "a", 100, 20)
    record_trained(conn, (120, 50), "runs/ckpt")
    again = read_meta(conn, ["a"])["a"]["trained"]
    assert (again["mark"], again["run"], again["step"]) == (120, "runs/ckpt", 4)
    assert again["at"] >= noted["at"]

    # Another run: another run's step is not its own.
    record_trained(conn, (120, 50), "runs/other")
    other = read_meta(conn, ["a", "b"])
    assert [(m["trained"]["run"], m["trained"]["step"]) for m in other.values()] == [("runs/other", None)] * 2
    record_trained(conn, (120, 50), "runs/other", step=2)
    assert read_meta(conn, ["a"])["a"]["trained"]["step"] == 2


def test_a_note_the_server_refuses_is_logged_without_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A user allowed only to read may train: the note is best effort, and its failure says no secret."""
    conn = Connection(make_config(["a"], MONGO_CONNECTION_STRING="mongodb://u:hunter2secret@127.0.0.1:1/"))

    def refused(*args: object, **kwargs: object) -> None:
        raise OperationFailure(
            "not authorized: mongodb://u:hunter2secret@127.0.0.1:1/ may only read", code=13
        )

    monkeypatch.setattr(marks, "write_meta", refused)
    with caplog.at_level(logging.DEBUG, logger="dsgpt2.corpus.marks"):
        assert record_trained(conn, (10,), "runs/ckpt", step=1) is None
    assert "could not note the trained marks in meta_info: not authorized" in caplog.text
    assert "hunter2secret" not in caplog.text
