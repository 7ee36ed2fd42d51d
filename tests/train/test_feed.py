"""The data feed alone, with its own settings, on one process: where a fresh run starts, what a resume
takes in of the documents ingested since, what ``--follow`` deals at once, what the feed keeps for a
checkpoint and notes in meta_info, and the refusals of a corpus too small for the ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import make_config, seed
from dsgpt2.corpus.marks import prefix_record
from dsgpt2.data.cache import CachedChunks
from dsgpt2.data.dealing import ReadState
from dsgpt2.data.mixture import Stage
from dsgpt2.data.ramp import BatchRamp
from dsgpt2.data.sources import DataSpec, StreamingChunks, make_spec
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta
from dsgpt2.errors import ConfigError
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.train.config import DataOptions
from dsgpt2.train.feed import Feed, FeedSettings

SEED = 11
WORDS = ("the", "feed", "deals", "chunks", "of", "documents", "to", "every", "rank", "epoch", "after", "and",
         "takes", "in", "growth")  # fmt: skip


def texts(name: str, first: int, n: int) -> list[str]:
    return [
        f"{name} document {i}: " + " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 40))
        for i in range(first, first + n)
    ]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("feed") / "tok"
    train_vocab(iter(texts("a", 0, 200)), out, VocabSettings(vocab_size=300), "test", progress=False)
    return out


@pytest.fixture
def corpus() -> Connection:
    """Collections ``a`` (200 documents) and ``b`` (80) in a database of the test's own."""
    conn = Connection(make_config(["a", "b"]))
    seed(conn, "a", texts("a", 0, 200))
    seed(conn, "b", texts("b", 0, 80))
    return conn


def grow(conn: Connection, name: str, n: int) -> None:
    """Ingest ``n`` more documents into ``name``, as a running ingest does (documents, then the count)."""
    meta = conn.db[conn.config.meta_collection]
    count = meta.find_one({"collection": name})["count"]
    conn.db[name].insert_many(
        [{"idx": count + i, "filt_text": t} for i, t in enumerate(texts(name, count, n))]
    )
    meta.update_one({"collection": name}, {"$set": {"count": count + n}})


def settings(tmp_path: Path, tokenizer: Path, **data: Any) -> FeedSettings:
    # The options check that the connection config is there; the feed is handed the connection itself.
    (tmp_path / "c.json").write_text("{}")
    options = DataOptions(
        config_train=tmp_path / "c.json", vocab_dir=tokenizer, seed=SEED, chunk_docs=40, num_workers=0, **data
    )
    return FeedSettings(options, tokenizer, cache_dir=tmp_path / "cache", ckpt_dir=tmp_path / "ckpt")


def spec(tokenizer: Path) -> DataSpec:
    return make_spec(tokenizer, context=32, chunk_docs=40, tr_ratio=0.8, seed=SEED)


def feed(s: FeedSettings, conn: Connection, tokenizer: Path, rank: int = 0, world: int = 1) -> Feed:
    return Feed(s, conn.config, conn, spec(tokenizer), rank=rank, world=world)


def test_a_fresh_feed_starts_at_the_marks_and_keeps_what_a_checkpoint_needs(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    s = settings(tmp_path, tokenizer)
    f = feed(s, corpus, tokenizer)
    f.start((200, 80), None)
    assert f.schedule.table.marks == (200, 80)
    assert f.streams == [(0, 1)] and f.stages == []  # one pooled stream without mixture weights
    assert f.state == ReadState.start(1)
    assert f.resume_growth is None and f.growth == []
    assert isinstance(f.train_data, StreamingChunks) and (f.train_data.split, f.val_data.split) == (
        "train",
        "val",
    )
    assert f.poll(100) is None  # no --follow
    # Rank 0 notes in meta_info how far this run reads, under its checkpoint directory's name.
    trained = read_meta(corpus, ["a", "b"])
    assert [trained[n]["trained"]["mark"] for n in "ab"] == [200, 80]
    assert trained["a"]["trained"]["run"] == str(tmp_path / "ckpt")
    f.note_launch(0, 0, 4, BatchRamp(2))
    f.skipped_micro.append(3)
    kept = f.state_dict(f.state)
    assert kept["launches"] == [
        {"step": 0, "micro": 0, "world": 1, "micro_batch": 4, "grad_accum": 2, "stages": [], "follow": 0}
    ]
    assert kept["streams"] == [[0, 1]] and kept["skipped_micro"] == [3] and kept["growth"] == []
    assert kept["ranks"] == [ReadState.start(1).to_dict()]
    assert kept["prefix"] == prefix_record(corpus, (200, 80), SEED)  # hashed at the start, for any save


def test_a_mixture_reads_each_collection_as_a_stream_of_its_own(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    f = feed(settings(tmp_path, tokenizer, mixture="a=0.75,b=0.25; 10: a=0.5,b=0.5"), corpus, tokenizer)
    f.start((200, 80), None)
    assert f.streams == [(0,), (1,)]
    assert f.stages == [Stage(0, (0.75, 0.25)), Stage(10, (0.5, 0.5))]
    assert len(f.state.streams) == 2
    f.note_launch(0, 0, 4, BatchRamp(1))
    assert f.launches[-1]["stages"] == [[0, [0.75, 0.25]], [10, [0.5, 0.5]]]


def test_a_corpus_with_fewer_chunks_than_ranks_is_refused_naming_the_chunk_size_that_fits(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    pooled = (
        r"^a, b: 280 documents make 7 chunk\(s\) of --chunk_docs 40, fewer than the 8 ranks that each read "
        r"one per epoch; lower --chunk_docs \(at most 35\)$"
    )
    with pytest.raises(ConfigError, match=pooled):
        feed(settings(tmp_path, tokenizer), corpus, tokenizer, world=8).start((200, 80), None)
    # With a mixture each collection is a stream: b's two chunks are too few for four ranks.
    mixed = settings(tmp_path, tokenizer, mixture="a=0.5,b=0.5")
    with pytest.raises(ConfigError, match=r"^b: 80 documents make 2 chunk\(s\) .* \(at most 20\) or drop the "
                       "collection's weight$"):  # fmt: skip
        feed(mixed, corpus, tokenizer, world=4).start((200, 80), None)


def saved_at_start(tmp_path: Path, tokenizer: Path, conn: Connection) -> dict[str, Any]:
    """What a checkpoint of a fresh run at marks (200, 80) keeps of the data, after one launch."""
    first = feed(settings(tmp_path, tokenizer), conn, tokenizer)
    first.start((200, 80), None)
    first.note_launch(0, 0, 4, BatchRamp(2))
    return first.state_dict(first.state)


def test_a_resume_takes_in_the_whole_chunks_ingested_since_from_the_next_epoch(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    saved = saved_at_start(tmp_path, tokenizer, corpus)
    grow(corpus, "a", 50)
    f = feed(settings(tmp_path, tokenizer), corpus, tokenizer)
    f.start((250, 80), saved)
    # One whole chunk of 40 taken in; the last 10 documents wait for the chunk to fill.
    assert f.schedule.table.marks == (240, 80)
    assert f.resume_growth == ((200, 80), (240, 80))
    assert f.state.streams[0].queue == []  # not dealt now: part of the epochs to come
    assert f.launches == saved["launches"]  # the run's history goes on
    record = f.record_growth(6, *f.resume_growth, "resume")
    assert record == {"step": 6, "added": {"a": 40}, "at": "resume"}
    kept = f.state_dict(f.state)
    assert kept["growth"] == [record]
    assert kept["prefix"] == prefix_record(corpus, (240, 80), SEED)
    assert read_meta(corpus, ["a"])["a"]["trained"]["mark"] == 240


def test_a_resume_with_follow_deals_the_new_chunks_at_once(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    saved = saved_at_start(tmp_path, tokenizer, corpus)
    grow(corpus, "b", 80)
    f = feed(settings(tmp_path, tokenizer, follow=5), corpus, tokenizer)
    f.start((200, 160), saved)
    assert f.resume_growth == ((200, 80), (200, 160))
    queue = f.state.streams[0].queue
    # b's two new chunks, at the head of this (only) rank's reading, none of their blocks read yet.
    assert sorted(c for _, c, _ in queue) == [7, 8] and all(first == 0 for _, _, first in queue)


def test_follow_polls_every_n_steps_and_deals_what_came_at_once(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    f = feed(settings(tmp_path, tokenizer, follow=2), corpus, tokenizer)
    f.start((200, 80), None)
    assert f.poll(3) is None and f.poll(4) == (200, 80)
    assert f.follow((200, 80), [f.state]) is None  # nothing new
    grow(corpus, "b", 45)
    marks = f.poll(6)
    assert marks == (200, 125)
    before = f.schedule.table.marks
    dealt = f.follow(marks, [f.state])
    assert dealt is not None and [c for _, c, _ in dealt[0]] == [7]  # b's one whole new chunk, dealt now
    assert f.schedule.table.marks == (200, 120) and f.train_data.table.marks == (200, 120)
    assert f.record_growth(6, before, f.schedule.table.marks, "follow") == {
        "step": 6, "added": {"b": 40}, "at": "follow"
    }  # fmt: skip
    assert read_meta(corpus, ["b"])["b"]["trained"]["mark"] == 120
    # A collection that shrank is not followed: the run goes on reading what it had.
    assert f.follow((200, 100), [f.state]) is None
    assert f.schedule.table.marks == (200, 120)


def test_cached_mode_builds_the_token_cache_in_the_settings_directory(
    tmp_path: Path, tokenizer: Path, corpus: Connection
) -> None:
    f = feed(settings(tmp_path, tokenizer, data_mode="cached"), corpus, tokenizer)
    f.start((200, 80), None)
    assert isinstance(f.train_data, CachedChunks) and isinstance(f.val_data, CachedChunks)
    cache = tmp_path / "cache"
    assert any(cache.iterdir()) and not list(cache.glob(".rank-*"))  # built; the ranks' probes removed
    assert len(f.train_data) == f.schedule.table.n_chunks == 7
