"""Every path a user runs, against a MongoDB wire-protocol server of its own: kills, hangs, restarts.

Each test runs against the wire-protocol test server that ``make test`` provides (mongoeco over TCP
with SCRAM, see tests/wire_server.py) and against the server that DSGPT2_TEST_MONGO_URI names, if
any, for example the compose stack:
    DSGPT2_TEST_MONGO_URI='mongodb://user:pass@127.0.0.1:27017/?authSource=admin' make test
The password travels in the environment as a user's would, and is looked for in every output.
The wire server inserts slowly (about 50 documents/s through ingest): corpora stay small.
"""

from __future__ import annotations

import json
import random
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from pymongo import monitoring

from conftest import logged_blocks, make_config, trained_on
from corpora import Corpus, password_of
from dsgpt2.db.client import EMBEDDED_IN_LIST, Connection, connect
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import ConfigError, MongoUnavailableError
from dsgpt2.train.metrics import read_metrics

pytestmark = [pytest.mark.mongo_live, pytest.mark.slow]
DOCS = 240


@pytest.fixture(scope="module")
def corpus(server_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    c = Corpus(server_uri, tmp_path_factory.mktemp("live"))
    result = c.cli("ingest", "--config", str(c.config), "--sample", "stdlib", "--limit", str(DOCS),
                   "--batch_size", "60", "--no_progress")  # fmt: skip
    assert result.returncode == 0, result.stderr
    yield c
    conn = Connection(c.mongo)
    conn.client.drop_database(c.db)
    conn.close()


@pytest.fixture
def vocab(corpus: Corpus) -> Path:
    """The corpus's vocabulary, ``corpus.base / "tok"`` (where ``Corpus.train`` reads it), trained from
    the server once per module and worker: a test that trains needs it whichever worker ran the
    vocabulary's own test."""
    tok = corpus.base / "tok"
    if not (tok / "vocab.json").exists():
        made = corpus.cli("vocab", "train", "--from_mongo", "--config", str(corpus.config), "--out", str(tok),
                          "--vocab_size", "400", "--no_progress")  # fmt: skip
        assert made.returncode == 0, made.stderr
    return tok


@pytest.fixture
def scratch(server_uri: str) -> Iterator[Connection]:
    """An empty database of its own on the server."""
    cfg = make_config(
        ["a"], MONGO_CONNECTION_STRING=server_uri, MONGO_CONNECTION_DB=f"dsgpt2_test_{uuid.uuid4().hex[:8]}"
    )
    conn = connect(cfg)
    yield conn
    conn.client.drop_database(cfg.db)
    conn.close()


def test_ingest_validate_info_from_the_cli(corpus: Corpus) -> None:
    conn = Connection(corpus.mongo)
    coll = conn.db["stdlib"]
    assert coll.count_documents({}) == DOCS
    assert sorted(d["idx"] for d in coll.find({}, {"idx": 1})) == list(range(DOCS))
    assert conn.db["meta_info"].find_one({"collection": "stdlib"})["count"] == DOCS
    validate = corpus.cli("validate", "--config", str(corpus.config))
    assert validate.returncode == 0, validate.stderr
    assert f"stdlib: {DOCS} documents, OK" in validate.stdout
    info = corpus.cli("info", "--config", str(corpus.config))
    assert info.returncode == 0, info.stderr
    assert f"stdlib: {DOCS} documents" in info.stdout
    # Re-run: nothing is inserted twice.
    again = corpus.cli("ingest", "--config", str(corpus.config), "--sample", "stdlib", "--limit", str(DOCS),
                       "--no_progress")  # fmt: skip
    assert again.returncode == 0 and "already ingested" in again.stdout
    assert coll.count_documents({}) == DOCS
    conn.close()


def test_reads_take_numpy_indices_and_one_query_per_collection(corpus: Corpus) -> None:
    class Count(monitoring.CommandListener):
        def __init__(self) -> None:
            self.commands: list[str] = []

        def started(self, event: monitoring.CommandStartedEvent) -> None:
            target = event.command.get("find") or event.command.get("collection")
            if event.command_name in ("find", "getMore") and target == "stdlib":
                self.commands.append(event.command_name)

        def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
            pass

        def failed(self, event: monitoring.CommandFailedEvent) -> None:
            pass

    listener = Count()
    monitoring.register(listener)  # applies to clients made from now on
    conn = Connection(corpus.mongo)
    wrapper = MongoWrapper(corpus.mongo, connection=conn)
    # The indices the training path computes are numpy integers; pymongo refuses those.
    lo, hi = np.int64(10), np.int64(DOCS)
    docs = wrapper.get_range(lo, hi)
    assert [d.index for d in docs] == list(range(10, DOCS))
    assert all(type(d.index) is int for d in docs)
    picked = wrapper.get_many(np.arange(0, DOCS, 7))
    assert [d.index for d in picked] == list(range(0, DOCS, 7))
    # More documents than a server's default first batch (101), still one find and no getMore; on the
    # stock SecantusDB, whose $in costs the square of its length, one find per EMBEDDED_IN_LIST idx.
    lists = 1 if conn.in_list_max is None else -(-len(range(0, DOCS, 7)) // EMBEDDED_IN_LIST)
    assert listener.commands == ["find"] * (1 + lists), listener.commands
    assert wrapper[np.int64(10)] == docs[0].text
    conn.close()


def test_vocab_download_and_train_from_the_cli(corpus: Corpus) -> None:
    shards = corpus.base / "shards"
    down = corpus.cli("vocab", "download", "--config", str(corpus.config), "--out", str(shards),
                      "--workers", "2", "--shards", "3", "--chunk", "50", "--no_progress")  # fmt: skip
    assert down.returncode == 0, down.stderr
    lines = [json.loads(x) for p in sorted(shards.glob("shard-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["idx"] for x in lines] == list(range(DOCS))
    train = corpus.cli("vocab", "train", "--input", str(shards), "--out", str(corpus.base / "tok_shards"),
                       "--vocab_size", "400", "--no_progress")  # fmt: skip
    assert train.returncode == 0, train.stderr
    streamed = corpus.cli("vocab", "train", "--from_mongo", "--config", str(corpus.config),
                          "--out", str(corpus.base / "tok_streamed"), "--vocab_size", "400",
                          "--no_progress")  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    # The same texts, from the shards or straight from the server: the same vocabulary.
    assert (corpus.base / "tok_streamed" / "vocab.json").read_text() == (
        corpus.base / "tok_shards" / "vocab.json"
    ).read_text()


def test_training_streaming_and_cached_evaluate_and_record(corpus: Corpus, vocab: Path) -> None:
    streaming = corpus.train(corpus.base / "streaming", "--train_iters", "8")
    cached = corpus.train(corpus.base / "cached", "--train_iters", "8", "--data_mode", "cached")
    assert "stopped: done at step 8" in streaming.stdout
    assert "token cache" in cached.stderr

    def losses(run: str) -> list[float]:
        metrics = read_metrics(corpus.base / run / "ws" / "metrics.jsonl")
        return [r["loss"] for r in metrics if r["event"] == "train"]

    # The same blocks from the server or from the token cache: the same losses.
    assert len(losses("streaming")) == 8
    assert losses("streaming") == losses("cached")

    report = corpus.base / "eval.json"
    ev = corpus.cli("evaluate", "--model", str(corpus.base / "streaming" / "ckpt"),
                    "--config", str(corpus.config), "--report", str(report), "--no_progress")  # fmt: skip
    assert ev.returncode == 0, ev.stderr
    result = json.loads(report.read_text())
    assert result["metrics"]["tokens"] > 0 and np.isfinite(result["metrics"]["perplexity"])
    conn = Connection(corpus.mongo)
    stored = list(conn.db["eval_results"].find({}))
    assert len(stored) == 1 and stored[0]["metrics"] == result["metrics"]
    assert corpus.secret is None or corpus.secret not in json.dumps(stored, default=str)
    conn.close()


def test_undecodable_text_is_one_skipped_document(scratch: Connection) -> None:
    import bson
    from bson.raw_bson import RawBSONDocument
    from pymongo.errors import PyMongoError

    coll = scratch.db["a"]
    coll.create_index("idx", unique=True)
    coll.insert_one({"idx": 0, "filt_text": "good"})
    raw = bson.encode({"idx": 1, "filt_text": "bad XX"}).replace(b"bad XX", b"bad \xff\xfe")
    try:
        coll.insert_one(RawBSONDocument(raw))
    except PyMongoError:
        pytest.skip("this server refuses invalid UTF-8 at insert (the wire test server does)")
    coll.insert_one({"idx": 2, "filt_text": "good too"})
    scratch.db["meta_info"].insert_one({"collection": "a", "count": 3})
    wrapper = MongoWrapper(scratch.config.with_collections(["a"]), connection=scratch)
    assert [d.text for d in wrapper.get_range(0, 3)] == ["good", "good too"]
    assert dict(wrapper.skipped) == {"invalid_unicode": 1}


def test_wrong_password_is_refused_clearly(server_uri: str) -> None:
    password = password_of(server_uri)
    if password is None:
        pytest.skip("the server URI carries no credentials")
    wrong = server_uri.replace(f":{password}@", ":definitely-wrong@")
    cfg = make_config(["a"], MONGO_CONNECTION_STRING=wrong)
    with pytest.raises(MongoUnavailableError) as err:
        connect(cfg)
    assert "definitely-wrong" not in str(err.value)
    assert "refused the login" in str(err.value)


def test_demo_runs_against_a_server(server_uri: str, tmp_path: Path) -> None:
    c = Corpus(server_uri, tmp_path)
    result = c.cli("demo", "--config", str(c.config), "--out", str(tmp_path / "demo"), "--limit", "120",
                   "--steps", "4", "--chat_steps", "2", "--no_progress")  # fmt: skip
    conn = Connection(c.mongo)
    try:
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
        assert summary["ingest"]["documents"] == 120 and summary["db"] == c.db
        assert summary["train"]["steps"] == 4 and summary["chat"]["train"]["steps"] == 2
        assert conn.db["stdlib"].count_documents({}) == 120
        assert conn.db["eval_results"].count_documents({}) == 4  # before, after, chat before and after
    finally:
        conn.client.drop_database(c.db)
        conn.close()


def test_reads_follow_read_preference_and_name_their_server(
    corpus: Corpus, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses
    import logging

    from dsgpt2.db import wrapper

    config = dataclasses.replace(corpus.mongo, read_preference="secondaryPreferred")
    wrapper._READER_LOGGED.clear()
    caplog.set_level(logging.INFO, logger="dsgpt2.db.wrapper")
    conn = Connection(config)
    docs = MongoWrapper(config, connection=conn).get_range(0, 30)
    MongoWrapper(config, connection=conn).get_range(30, 60)
    conn.close()
    assert [d.index for d in docs] == list(range(30))
    # A standalone server answers secondaryPreferred reads itself; the process says which, once.
    host = config.hosts  # "127.0.0.1:PORT"
    said = [r.getMessage() for r in caplog.records if "reads from" in r.getMessage()]
    assert len(said) == 1 and host in said[0] and "secondaryPreferred" in said[0], said


def test_follow_takes_in_documents_ingested_during_the_run(
    corpus: Corpus, vocab: Path, tmp_path: Path
) -> None:
    """Another process ingests while the run trains on the server; --follow deals the new chunks;
    info then shows the mark the run reached and what came after it."""
    from dsgpt2.corpus.builtin import stdlib_documents

    live = Corpus(corpus.uri, tmp_path)
    try:
        first = live.cli("ingest", "--config", str(live.config), "--sample", "stdlib", "--limit", "100",
                         "--batch_size", "50", "--no_progress")  # fmt: skip
        assert first.returncode == 0, first.stderr
        for name, docs in (("more", range(100, 160)), ("later", range(160, 190))):
            texts = list(stdlib_documents(docs.stop))[docs.start :]
            (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        ingest = f"{sys.executable} -m dsgpt2 ingest --config {live.config} --format jsonl --no_progress"
        (tmp_path / "tok").symlink_to(vocab)
        live.train(tmp_path / "run", "--train_iters", "6", "--follow", "2", "--log_block_ids",
                   faults=("--after", f"3={ingest} {tmp_path / 'more.jsonl'}"))  # fmt: skip
        metrics = read_metrics(tmp_path / "run" / "ws" / "metrics.jsonl")
        growth = [r for r in metrics if r["event"] == "growth"]
        assert [(g["step"], g["added"]) for g in growth] == [(4, {"stdlib": 60})]
        later = {c for r in metrics if r["event"] == "train" and r["step"] > 4 for _, c, _ in r["block_ids"]}
        assert later & set(range(5, 8)), later  # chunks 5-7: documents 100-159
        # Which steps read each document, new ones included: the replay against the server's corpus.
        docs = [a for i in range(160) for a in ("--doc", f"stdlib:{i}")]
        found = live.cli("lineage", "--ckpt_dir", str(tmp_path / "run" / "ckpt"), *docs, "--json")
        assert found.returncode == 0, found.stderr
        answer = json.loads(found.stdout)
        logged = logged_blocks(tmp_path / "run" / "ws", 1, 6)
        held = trained_on(tmp_path / "run" / "ckpt", answer["checkpoint"], live.mongo, logged)
        for d in answer["docs"]:
            want = held.get((0, int(d["doc"].rpartition(":")[2])), set())
            assert {(s["step"], s["rank"]) for s in d["sightings"]} == want, d["doc"]
        assert any(d["status"] == "trained" and d["chunk"] >= 5 for d in json.loads(found.stdout)["docs"])
        assert live.cli("ingest", "--config", str(live.config), "--format", "jsonl", "--no_progress",
                        str(tmp_path / "later.jsonl")).returncode == 0  # fmt: skip
        info = live.cli("info", "--config", str(live.config), "--json")
        (entry,) = json.loads(info.stdout)["collections"]
        assert entry["count"] == 190 and entry["last_run"]["mark"] == 160
        assert entry["growth_since_last_run"] == 30
    finally:
        conn = Connection(live.mongo)
        conn.client.drop_database(live.db)
        conn.close()


def test_index_numbers_a_foreign_collection_in_place_and_later_documents_next(scratch: Connection) -> None:
    """`dsgpt2 index` on a real server: bulk numbering, the sparse unique index that lets the
    application go on inserting documents without idx, the quick check through that index."""
    from dataclasses import replace

    from dsgpt2.db.meta import read_meta
    from dsgpt2.db.numbering import index_collection
    from dsgpt2.db.validate import quick_check, validate_collection

    conn = Connection(replace(scratch.config, collections=("articles",), text_field="body"))
    coll = conn.db["articles"]
    coll.insert_many([{"_id": f"a{i:04d}", "body": f"Article {i}."} for i in range(120)])
    first = index_collection(conn, "articles", "body", batch_size=50)
    assert (first.numbered, first.count) == (120, 120)
    coll.insert_many([{"_id": f"b{i:04d}", "body": f"Later {i}."} for i in range(15)])  # no idx
    meta = read_meta(conn, ["articles"])["articles"]
    assert quick_check(conn, "articles", meta).ok and validate_collection(conn, "articles").ok
    second = index_collection(conn, "articles", "body", batch_size=50)
    assert (second.numbered, second.count) == (15, 135)
    texts = [d.text for d in MongoWrapper(conn.config, connection=conn).get_range(0, 135)]
    assert texts == [f"Article {i}." for i in range(120)] + [f"Later {i}." for i in range(15)]
    conn.close()


def test_dedup_exact_groups_on_the_server_and_ingest_dedup_skips(scratch: Connection) -> None:
    """`dedup --exact` on a real server: the hash index, $group over collections joined by
    $unionWith, bulk UpdateMany marks; `ingest --dedup` asks the hash index."""
    from dataclasses import replace

    from corpora import marks, planted, reference
    from dsgpt2.corpus.ingest import ingest
    from dsgpt2.corpus.records import Source, Text
    from dsgpt2.curation.dedup import Hashing, HeldTexts
    from dsgpt2.curation.passes import run_pass

    def memory_source(key: str, batch: list[str]) -> Source:
        return Source(key, key, "text", read=lambda: (Text(t) for t in batch))

    conn = Connection(replace(scratch.config, collections=("news", "web")))
    texts = {"news": planted(7, 60, 25), "web": planted(8, 40, 25)}
    for name, batch in texts.items():
        ingest(conn, name, [memory_source(name, batch)], batch_size=50)
    first = run_pass(conn, ["news", "web"], Hashing(), batch_size=32)
    expected = reference(texts)
    assert marks(conn, ["news", "web"]) == expected
    assert sum(c.marked for c in first.collections) == len(expected)
    assert sum(c.marked for c in run_pass(conn, ["news", "web"], Hashing()).collections) == 0
    more = planted(9, 30, 40)
    report = ingest(conn, "web", [memory_source("more", more)], batch_size=8, steps=[HeldTexts()])
    held = set(texts["news"]) | set(texts["web"])
    fresh = [t for i, t in enumerate(more) if t not in held and t not in more[:i]]
    assert report.sources[0].skipped["duplicate"] == 30 - len(fresh)
    assert [d["filt_text"] for d in conn.db["web"].find({"idx": {"$gte": 40}}).sort("idx", 1)] == fresh
    conn.close()


def test_dedup_near_in_worker_processes_on_the_server(scratch: Connection) -> None:
    """`dedup --near` on a real server: two worker processes sign their idx ranges with bulk writes,
    the bands are indexed and grouped by $unwind/$group over $unionWith, the marks equal a straight
    in-memory clustering of the same texts; `curate` in two workers judges every document once."""
    from dataclasses import replace

    from corpora import corpus, near_marks
    from dsgpt2.curation.curate import Curation
    from dsgpt2.curation.minhash import LshParams, cluster_texts
    from dsgpt2.curation.neardup import Signing
    from dsgpt2.curation.passes import run_pass
    from dsgpt2.curation.quality import resolve_thresholds
    from dsgpt2.curation.steps import Split

    docs, _ = corpus(originals=25, seed=3)
    half = len(docs) // 2
    conn = Connection(replace(scratch.config, collections=("news", "web")))
    for name, part in (("news", docs[:half]), ("web", docs[half:])):
        conn.db[name].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(part)])
        conn.db[name].create_index("idx", unique=True)
    params = LshParams(threshold=0.8)
    report = run_pass(conn, ["news", "web"], Signing(params), batch_size=8, split=Split(workers=2))
    assert [c.signed for c in report.collections] == [half, len(docs) - half]
    labels = [f"news:{i}" for i in range(half)] + [f"web:{i}" for i in range(len(docs) - half)]
    straight = {labels[k]: labels[v] for k, v in cluster_texts(docs, params).items()}
    assert straight and near_marks(conn, ["news", "web"]) == straight
    assert "lsh_1" in {i["name"] for i in conn.db["web"].list_indexes()}
    from corpora import near_copy
    from dsgpt2.corpus.ingest import ingest
    from dsgpt2.corpus.records import Source, Text
    from dsgpt2.curation.dedup import HeldTexts

    copy = near_copy(random.Random(0), docs[0].split(), changes=2)  # arriving later: asked of the lsh index
    report = ingest(
        conn, "more", [Source("more", "more", "text", read=lambda: iter([Text(copy)]))], steps=[HeldTexts()]
    )
    assert report.sources[0].near_duplicates == 1
    assert conn.db["more"].find_one({"idx": 0})["near_dup_of"] == straight.get("news:0", "news:0")
    judged = run_pass(
        conn, ["news"], Curation(["gopher"], resolve_thresholds({})), batch_size=8, split=Split(workers=2)
    )
    assert judged.collections[0].judged == half
    assert conn.db["news"].count_documents({"passes.gopher": {"$exists": True}}) == half
    conn.close()


def test_filter_on_the_server_skips_counts_and_refuses_bad_operators(scratch: Connection) -> None:
    """FILTER on a real server: reads ask `$and` of the idx range and the filter, the documents left out
    are found with `$nor` (idx only) and counted; an operator the server refuses is one line."""
    from dataclasses import replace

    from corpora import KEEP, left_out, mark, texts
    from dsgpt2.db.client import check_filter
    from dsgpt2.db.config import canonical_filter
    from dsgpt2.db.meta import write_meta
    from dsgpt2.db.wrapper import MongoWrapper

    scratch.db["a"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts(40))])
    scratch.db["a"].create_index("idx", unique=True)
    write_meta(scratch, "a", {"count": 40})
    mark(scratch, "a", 40)
    cfg = replace(scratch.config, filter=canonical_filter(KEEP))
    wrapper = MongoWrapper(cfg)
    assert [d.index for d in wrapper.get_range(0, 40)] == [i for i in range(40) if not left_out(i)]
    assert dict(wrapper.skipped) == {"filtered": sum(map(left_out, range(40)))}
    wrapper.connection.close()
    refused = Connection(replace(scratch.config, filter=canonical_filter({"a": {"$nosuch": 1}})))
    with pytest.raises(ConfigError, match=r"the server refuses key .a., operator \$nosuch"):
        check_filter(refused)
    refused.close()


def test_curate_judges_in_place_on_the_server(scratch: Connection) -> None:
    """`curate` on a real server: bulk UpdateOne of signals and verdicts, counted by rule set."""
    from corpora import BAD, PROSE
    from dsgpt2.curation.curate import Curation
    from dsgpt2.curation.passes import run_pass
    from dsgpt2.curation.quality import RULES, resolve_thresholds
    from dsgpt2.curation.report import summarize

    texts = [PROSE, *BAD.values()] * 3
    scratch.db["a"].insert_many([{"_id": i, "idx": i, "filt_text": t} for i, t in enumerate(texts)])
    first = run_pass(scratch, ["a"], Curation(list(RULES), resolve_thresholds({})), batch_size=4)
    (part,) = first.collections
    assert (part.documents, part.judged, part.passing_all) == (15, 15, 3)
    assert part.failing == {"gopher": 6, "repetition": 6, "c4": 9}  # bullets fail all three
    again = run_pass(scratch, ["a"], Curation(list(RULES), resolve_thresholds({})), batch_size=4)
    assert again.collections[0].judged == 0
    (summary,) = summarize(scratch, ["a"])  # `curate report`: one $facet aggregation per collection
    assert summary.documents == 15 and summary.judged == 15
    assert {r: summary.removed[f"fails {r}"] for r in RULES} == part.failing
    assert summary.kept == 3 and len(summary.examples["fails c4"]) == 2
