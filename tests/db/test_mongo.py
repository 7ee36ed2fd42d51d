from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import time
from pathlib import Path
from typing import Any

import pymongo
import pytest
from pymongo.errors import AutoReconnect, NetworkTimeout

from conftest import make_config, seed
from dsgpt2.db.client import EMBEDDED_IN_LIST, Connection, connect, database_errors, with_retries
from dsgpt2.db.config import config_from_dict
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.documents import Doc
from dsgpt2.errors import BadDocumentError, MongoUnavailableError


@pytest.fixture
def corpus() -> MongoWrapper:
    """Three collections, the middle one empty: 5 + 0 + 4 documents."""
    cfg = make_config(["a", "e", "b"])
    conn = Connection(cfg)
    seed(conn, "a", [f"a{i}" for i in range(5)])
    seed(conn, "e", [])
    seed(conn, "b", [f"b{i}" for i in range(4)])
    return MongoWrapper(cfg, connection=conn)


def test_unified_index_in_config_order(corpus: MongoWrapper) -> None:
    assert len(corpus) == 9
    assert corpus.counts == (5, 0, 4)
    assert [corpus[i] for i in range(9)] == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(4)]
    assert corpus.locate(4) == (0, 4)
    assert corpus.locate(5) == (2, 0)  # the empty collection owns no index
    assert corpus[-1] == "b3"
    with pytest.raises(IndexError):
        corpus[9]
    with pytest.raises(IndexError):
        corpus.locate(-10)


def test_opening_reads_only_counts() -> None:
    cfg = make_config(["a", "b"])
    conn = Connection(cfg)
    seed(conn, "a", ["x"] * 3)
    seed(conn, "b", ["y"] * 2)
    wrapper = MongoWrapper(cfg, connection=conn)
    assert wrapper.counts == (3, 2)
    assert dict(wrapper.queries) == {"meta": 1}


def test_counts_fall_back_to_counting(caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_config(["a"])
    conn = Connection(cfg)
    seed(conn, "a", ["x"] * 3, meta=False)
    with caplog.at_level(logging.WARNING, logger="dsgpt2"):
        wrapper = MongoWrapper(cfg, connection=conn)
    assert len(wrapper) == 3
    assert "no count for 'a'" in caplog.text and "validate --fix" in caplog.text


def test_get_many_one_query_per_collection_in_asked_order(corpus: MongoWrapper) -> None:
    before = corpus.total_queries
    docs = corpus.get_many([7, 0, 3, 8, 1])
    assert docs == [Doc(7, "b2"), Doc(0, "a0"), Doc(3, "a3"), Doc(8, "b3"), Doc(1, "a1")]
    assert corpus.total_queries - before == 2
    assert corpus.queries["e"] == 0


def test_range_read_is_one_query_per_collection_touched(corpus: MongoWrapper) -> None:
    before = dict(corpus.queries)
    docs = corpus.get_range(3, 7)
    assert [d.index for d in docs] == [3, 4, 5, 6]
    assert corpus.queries["a"] - before.get("a", 0) == 1
    assert corpus.queries["b"] - before.get("b", 0) == 1
    chunks = list(corpus.iter_range(0, 9, chunk=4))
    assert [[d.index for d in c] for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert corpus.get_range(8, 100) == [Doc(8, "b3")]
    assert corpus.get_range(5, 5) == []


def test_range_vs_in_query_filters(monkeypatch: pytest.MonkeyPatch, corpus: MongoWrapper) -> None:
    seen = []
    original = pymongo.collection.Collection.find

    def spy(self, filt=None, *a, **k):
        seen.append(filt)
        return original(self, filt, *a, **k)

    monkeypatch.setattr(pymongo.collection.Collection, "find", spy)
    corpus.get_many([1, 2, 3])
    corpus.get_many([0, 4])
    assert seen == [{"idx": {"$gte": 1, "$lt": 4}}, {"idx": {"$in": [0, 4]}}]


def test_long_in_lists_are_cut_for_stock_secantusdb_and_whole_for_mongod_and_the_embedded_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stock SecantusDB tests every document it finds against the whole ``$in`` list (k values cost
    O(k^2)): a chunk's list goes as lists of at most EMBEDDED_IN_LIST idx, a dense one as the range
    holding it; mongod's answer to one list is linear, and so is the server dsgpt2 starts (it says so
    in its buildInfo): there it stays one query."""
    cfg = make_config(["a"], FILTER={"keep": True})
    conn = Connection(cfg)
    seed(conn, "a", [f"t{i}" for i in range(400)])
    conn.db["a"].update_many({"idx": {"$mod": [7, 0]}}, {"$set": {"keep": False}})
    conn.db["a"].update_many({"keep": {"$exists": False}}, {"$set": {"keep": True}})
    seen: list[dict] = []
    original = pymongo.collection.Collection.find

    def spy(self, filt=None, *a, **k):
        seen.append(filt)
        return original(self, filt, *a, **k)

    monkeypatch.setattr(pymongo.collection.Collection, "find", spy)
    wrapper = MongoWrapper(cfg, connection=conn)
    assert conn.in_list_max is None  # the shared test server is the one dsgpt2 starts
    assert conn._engine == (os.getpid(), True, True)
    sparse = [i * 3 for i in range(133)][::-1]  # 133 idx over 397: sparse, asked in reverse
    expected = [Doc(i, f"t{i}") for i in sparse if i % 7]
    # What stock SecantusDB's buildInfo says, then mongod's, then the embedded server's.
    for engine, lists in (((True, False), 5), ((False, False), 1), ((True, True), 1)):
        conn._engine = (os.getpid(), *engine)
        seen.clear()
        before = wrapper.skipped["filtered"]
        assert wrapper.get_many(sparse) == expected
        assert wrapper.skipped["filtered"] - before == sum(1 for i in sparse if i % 7 == 0)
        asked = [f["idx"]["$in"] for f in seen if "keep" in f]  # the others: the idx FILTER left out
        assert len(asked) == lists and sorted(i for part in asked for i in part) == sorted(sparse)
        assert max(map(len, asked)) == (EMBEDDED_IN_LIST if lists > 1 else len(sparse))
    # Dense (the range holding them at most twice as long): one range on stock SecantusDB.
    conn._engine = (os.getpid(), True, False)
    seen.clear()
    dense = [i for i in range(100, 200) if i % 3]
    assert [d.index for d in wrapper.get_many(dense)] == [i for i in dense if i % 7]
    assert seen[0] == {"idx": {"$gte": 100, "$lt": 200}, "keep": True}


def test_a_short_list_asks_the_server_nothing_about_its_engine(corpus: MongoWrapper) -> None:
    conn = corpus.connection
    assert conn.in_lists(list(range(EMBEDDED_IN_LIST))) == [list(range(EMBEDDED_IN_LIST))]
    assert conn._engine is None  # no buildInfo for a list that needs no cut
    assert conn.in_lists([]) == []
    conn._engine = (os.getpid(), True, False)  # stock SecantusDB
    assert conn.in_lists(list(range(70)), longest=50) == [
        list(range(32)),
        list(range(32, 64)),
        [64, 65, 66, 67, 68, 69],
    ]
    conn._engine = (os.getpid(), True, True)
    assert conn.in_lists(list(range(70)), longest=50) == [list(range(50)), list(range(50, 70))]
    assert pickle.loads(pickle.dumps(conn))._engine is None


def _bad_corpus(strict: bool = False) -> MongoWrapper:
    cfg = make_config(["a"], MAX_TEXT_CHARS=1_000_000, STRICT=strict)
    conn = Connection(cfg)
    coll = conn.db["a"]
    coll.create_index("idx", unique=True)
    coll.insert_many(
        [
            {"idx": 0, "filt_text": "good one"},
            {"idx": 1},  # field missing
            {"idx": 2, "filt_text": None},
            {"idx": 3, "filt_text": 12345},
            {"idx": 4, "filt_text": "   "},
            {"idx": 5, "filt_text": "x" * 5_000_000},  # 5 MB
            {"idx": 6, "filt_text": b"\xff\xfe bytes"},
            # idx 7 is a gap
            {"idx": 8, "filt_text": "good two"},
        ]
    )
    # (Undecodable UTF-8, which the test server refuses to store: test_undecodable_utf8_from_a_server...)
    conn.db["meta_info"].insert_one({"collection": "a", "count": 9})
    return MongoWrapper(cfg, connection=conn)


def test_bad_documents_are_skipped_and_counted() -> None:
    wrapper = _bad_corpus()
    docs = [d for chunk in wrapper.iter_range(chunk=4) for d in chunk]
    assert docs == [Doc(0, "good one"), Doc(8, "good two")]
    assert dict(wrapper.skipped) == {
        "no_field": 1,
        "null": 1,
        "not_string": 2,
        "empty": 1,
        "too_long": 1,
        "missing": 1,
    }
    assert wrapper[2] is None and wrapper[0] == "good one"


def test_strict_mode_fails_fast_naming_the_document() -> None:
    wrapper = _bad_corpus(strict=True)
    assert wrapper.get_range(0, 1) == [Doc(0, "good one")]
    with pytest.raises(BadDocumentError, match=r"a idx=1 \(document 1\).*no_field.*STRICT"):
        wrapper.get_range(0, 3)


def _flaky_find(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[int]:
    calls = []
    original = pymongo.collection.Collection.find

    def find(self, *a, **k):
        calls.append(1)
        if len(calls) <= failures:
            raise (AutoReconnect if len(calls) % 2 else NetworkTimeout)("connection reset by peer")
        return original(self, *a, **k)

    monkeypatch.setattr(pymongo.collection.Collection, "find", find)
    return calls


def test_transient_errors_are_retried(monkeypatch: pytest.MonkeyPatch, corpus: MongoWrapper) -> None:
    calls = _flaky_find(monkeypatch, failures=2)
    assert [d.text for d in corpus.get_range(0, 2)] == ["a0", "a1"]
    assert len(calls) == 3


def test_persistent_failure_gives_up_after_bounded_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(["a"], RETRIES=3)
    conn = Connection(cfg)
    seed(conn, "a", ["x"])
    wrapper = MongoWrapper(cfg, connection=conn)
    calls = _flaky_find(monkeypatch, failures=10**6)
    with pytest.raises(MongoUnavailableError, match=r"failed 4 times.*RETRIES"):
        wrapper.get_range(0, 1)
    assert len(calls) == 4


def test_unreachable_server_fails_fast_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    cfg = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": "mongodb://user:secret@127.0.0.1:1/",
            "MONGO_CONNECTION_DB": "corpus",
            "COLLECTIONS": ["a"],
            "SERVER_SELECTION_TIMEOUT_MS": 300,
        },
        env={},
    )
    start = time.monotonic()
    with caplog.at_level(logging.DEBUG), pytest.raises(MongoUnavailableError) as err:
        MongoWrapper(cfg)
    assert time.monotonic() - start < 10
    message = str(err.value)
    assert "127.0.0.1:1" in message and "check that the server is running" in message
    assert "secret" not in message and "secret" not in repr(err.value)
    assert "secret" not in caplog.text
    with pytest.raises(MongoUnavailableError):
        connect(cfg)


def _client_owner(conn: Connection) -> tuple[int, int | None, int]:
    client = conn.client
    return os.getpid(), conn.client_pid, id(client)


def test_connection_makes_a_new_client_after_fork() -> None:
    cfg = make_config(["a"], MONGO_CONNECTION_STRING="mongodb://127.0.0.1:1/")
    conn = Connection(cfg)  # a real pymongo client, never connected
    parent_client = conn.client
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        results = pool.map(_client_owner, [conn, conn])
    for pid, owner, _ in results:
        assert pid != os.getpid() and owner == pid
    assert conn.client is parent_client  # the parent keeps its own
    assert pickle.loads(pickle.dumps(conn))._client is None
    conn.close()


def test_dataloader_workers_each_make_their_own_client(corpus: MongoWrapper) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, Dataset

    parent_client = corpus.connection.client  # made in this process before the fork

    class Texts(Dataset):
        def __len__(self) -> int:
            return len(corpus)

        def __getitem__(self, i: int):
            text = corpus[i]
            conn = corpus.connection
            return {"pid": os.getpid(), "owner": conn.client_pid, "client": id(conn.client), "text": text}

    loader = DataLoader(Texts(), batch_size=None, num_workers=2, multiprocessing_context="fork")
    items = list(loader)
    assert sorted(x["text"] for x in items) == sorted(corpus[i] for i in range(len(corpus)))
    pids = {x["pid"] for x in items}
    assert len(pids) == 2 and os.getpid() not in pids
    for x in items:
        assert x["owner"] == x["pid"]  # every client was made in the worker that uses it
    assert corpus.connection.client is parent_client
    assert torch is not None


def test_pickled_wrapper_carries_no_client(corpus: MongoWrapper) -> None:
    _ = corpus.connection.client
    clone = pickle.loads(pickle.dumps(corpus))
    assert clone.connection._client is None
    assert clone.counts == corpus.counts
    assert clone[0] == "a0"


def test_undecodable_utf8_from_a_server_is_one_bad_document() -> None:
    import bson
    from bson.raw_bson import RawBSONDocument

    from dsgpt2.db.wrapper import decode_document
    from dsgpt2.documents import text_problem

    good = bson.encode({"idx": 3, "filt_text": "ok ab"})
    bad = good.replace(b"ok ab", b"ok \xff\xfe")
    assert decode_document(RawBSONDocument(good), "filt_text") == {"idx": 3, "filt_text": "ok ab"}
    doc = decode_document(RawBSONDocument(bad), "filt_text")
    assert doc["idx"] == 3
    assert text_problem(doc["filt_text"], 100) == "invalid_unicode"


def test_record_eval_stores_once_and_explains_a_refused_write(monkeypatch: pytest.MonkeyPatch) -> None:
    from pymongo.errors import OperationFailure

    from dsgpt2.db.client import EVAL_RESULTS
    from dsgpt2.db.meta import record_eval

    conn = Connection(make_config(["a"]))
    first = record_eval(conn, {"model": "m", "metrics": {"loss": 1.5}})
    record_eval(conn, {"model": "m", "metrics": {"loss": 1.25}})
    stored = list(conn.db[EVAL_RESULTS].find().sort("metrics.loss", -1))
    assert [d["metrics"]["loss"] for d in stored] == [1.5, 1.25] and stored[0]["_id"] == first

    def refuse(*args: object, **kwargs: object) -> None:
        raise OperationFailure("not authorized on testdb to execute command", code=13)

    monkeypatch.setattr(type(conn.db[EVAL_RESULTS]), "replace_one", refuse)
    with pytest.raises(MongoUnavailableError, match="readWrite"):
        record_eval(conn, {"model": "m"})


def test_the_test_store_refuses_what_pymongo_refuses_and_the_wrapper_sends_ints() -> None:
    import bson
    import numpy as np

    conn = Connection(make_config(["a"]))
    seed(conn, "a", [f"text {i}" for i in range(30)])
    coll = conn.db["a"]
    # What pymongo refuses before anything reaches a server, the in-process store refuses too.
    with pytest.raises(TypeError, match="batch_size must be an integer"):
        coll.find({}).batch_size(np.int64(3))
    with pytest.raises(bson.errors.InvalidDocument):
        coll.find_one({"idx": np.int64(3)})
    with pytest.raises(bson.errors.InvalidDocument):
        coll.insert_one({"idx": np.int64(99), "filt_text": "x"})
    # The training path computes numpy indices (chunk bounds, split masks): they reach the server as ints.
    wrapper = MongoWrapper(conn.config, connection=conn)
    assert [d.index for d in wrapper.get_range(np.int64(5), np.int64(12))] == list(range(5, 12))
    assert [d.text for d in wrapper.get_many(np.array([29, 3, 17]))] == ["text 29", "text 3", "text 17"]
    assert wrapper[np.int64(-1)] == "text 29"
    assert [
        d.index for chunk in wrapper.iter_range(np.int64(0), np.int64(30), chunk=7) for d in chunk
    ] == list(range(30))


def test_read_preference_reaches_the_training_reads() -> None:
    from pymongo.read_preferences import Primary, SecondaryPreferred

    from dsgpt2.db.client import read_preference

    config = make_config(READ_PREFERENCE="secondaryPreferred", READ_PREFERENCE_TAGS=[{"dc": "east"}, {}])
    pref = read_preference(config)
    assert isinstance(pref, SecondaryPreferred) and pref.tag_sets == [{"dc": "east"}, {}]
    assert isinstance(read_preference(make_config()), Primary)
    assert config.to_dict()["READ_PREFERENCE_TAGS"] == [{"dc": "east"}, {}]
    conn = Connection(config)
    seed(conn, "a", ["x", "y", "z"])
    assert [d.text for d in MongoWrapper(config, connection=conn).get_range(0, 3)] == ["x", "y", "z"]


def test_a_write_that_runs_out_of_retries_inside_a_command_ends_with_the_commands_advice() -> None:
    """Every way a command's database work fails ends with what to do: here the retries' own error."""
    config = make_config(["a"], RETRIES=1, RETRY_BACKOFF_S=0.0)

    def lost() -> None:
        raise AutoReconnect("connection refused")

    advice = "re-run the same command to resume"
    with pytest.raises(MongoUnavailableError) as caught, database_errors(config, "ingest into 'a'", advice):
        with_retries(lost, config, "recording progress")
    message = str(caught.value)
    assert message.startswith("recording progress failed 2 times") and message.endswith(
        "; re-run the same command to resume"
    ), message


def test_a_server_slow_to_answer_a_ping_is_lost_only_after_the_grace(monkeypatch: Any) -> None:
    """patiently()'s watch: a server at work on a big command may not answer a ping in time. An embedded
    server whose process is at work is never lost for it; another, only after ``grace`` seconds."""
    from dsgpt2.db import client, embedded
    from dsgpt2.errors import ServerLostError

    conn = Connection(make_config(["a"]))
    conn.client.admin.command("ping")

    def no_answer(*a: Any, **k: Any) -> Any:
        raise NetworkTimeout("timed out")

    monkeypatch.setattr(type(conn.client.admin), "command", no_answer)
    monkeypatch.setattr(client, "revive", lambda config: False)
    try:
        monkeypatch.setattr(embedded, "is_local", lambda uri: True)
        monkeypatch.setattr(embedded, "local_dir", lambda uri: Path("/nowhere"))
        monkeypatch.setattr(embedded, "working", lambda directory: True)
        assert client.answering(conn, "test", time.monotonic()) is None  # its process is at work
        monkeypatch.setattr(embedded, "is_local", lambda uri: False)  # a deployment
        silent = client.answering(conn, "test", time.monotonic(), None, grace=60)
        assert silent is not None
        assert client.answering(conn, "test", time.monotonic(), silent, grace=60) == silent
        with pytest.raises(ServerLostError, match="stopped answering"):
            client.answering(conn, "test", time.monotonic(), silent - 61, grace=60)
    finally:
        monkeypatch.undo()
