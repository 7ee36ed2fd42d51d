from __future__ import annotations

import itertools
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, make_config
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.data.cache import CachedChunks, build_cache, cached_spec
from dsgpt2.data.dealing import ChunkOrders, Position, ReadState
from dsgpt2.data.loader import BlockStream, eval_batches
from dsgpt2.data.ramp import BatchRamp
from dsgpt2.data.sources import DataSpec, StreamingChunks, fingerprint
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.client import Connection
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import ConfigError
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from pace import deadline, wait_for


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:

    conn = Connection(make_config(["s"]))
    ingest(conn, "s", [builtin_source("stdlib", 400)])
    out = tmp_path_factory.mktemp("tok") / "tok"
    texts, _ = mongo_texts(conn.config)
    train_vocab(texts, out, VocabSettings(vocab_size=400), "test", progress=False)
    return out


@pytest.fixture
def source(tokenizer: Path):
    conn = Connection(make_config(["s", "t"]))
    ingest(conn, "s", [builtin_source("stdlib", 300)])
    ingest(conn, "t", [builtin_source("stdlib", 250)])
    counts = MongoWrapper(conn.config, connection=conn).counts
    spec = DataSpec(context=32, chunk_docs=40, tr_ratio=0.8, seed=3, eot=0, pad=1)
    return conn, counts, spec


def pooled(data: StreamingChunks, seed: int) -> ChunkOrders:
    return ChunkOrders(data.table, [tuple(range(len(data.table.names)))], seed)


def served(data, epoch: int, chunk: int) -> list[tuple[int, int, int]]:
    """The block ids of ``chunk`` in ``epoch``, in the order training hands them out."""
    item = data[(epoch, chunk)]
    order = item.order if item.order is not None else range(len(item.blocks))
    return [(epoch, chunk, int(b)) for b in order]


def test_chunks_hold_only_their_split(source, tokenizer: Path) -> None:
    conn, counts, spec = source
    train = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    val = StreamingChunks(conn.config, counts, tokenizer, spec, "val")
    seen_train = seen_val = 0
    assert len(train) == 8 + 7  # 300 and 250 documents in chunks of 40, per collection
    for c in range(len(train)):
        coll, lo, hi = train.table.locate(c)
        t, v = train[c], val[c]
        n_train = int(split_mask(np.arange(lo, hi), spec.tr_ratio, spec.seed, ("s", "t")[coll]).sum())
        assert t.documents == n_train
        assert v.documents == hi - lo - n_train
        seen_train += t.documents
        seen_val += v.documents
        assert t.blocks.shape[1] == 32 and (t.blocks[:-1] != 1).all()  # only the last block may pad
    assert seen_train + seen_val == 550 and seen_val > 50


def test_two_ranks_read_disjoint_shards_covering_the_split(source, tokenizer: Path) -> None:
    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    per_rank = []
    for rank in range(2):
        stream = BlockStream(data, pooled(data, spec.seed), rank, 2, micro_batch=3, workers=0)
        chunks = set()
        for batch in stream:
            if any(epoch > 0 for epoch, _, _ in batch.block_ids):
                break
            chunks |= {c for _, c, _ in batch.block_ids}
        per_rank.append(chunks)
    assert per_rank[0].isdisjoint(per_rank[1])
    schedule = pooled(data, spec.seed)
    expected = set(schedule.rank_chunks(0, 0, 0, 2)) | set(schedule.rank_chunks(0, 0, 1, 2))
    # Every chunk that holds training blocks is read by exactly one rank (the last, partial
    # batch of an epoch may carry a few blocks over into the next).
    nonempty = {c for c in range(len(data)) if len(data[c].blocks)}
    assert (per_rank[0] | per_rank[1]) <= expected
    assert len(nonempty - (per_rank[0] | per_rank[1])) <= 2


def test_position_resumes_on_the_next_block(source, tokenizer: Path) -> None:
    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    straight = BlockStream(data, pooled(data, spec.seed), 0, 1, micro_batch=5, workers=2)
    it = iter(straight)
    first = [next(it) for _ in range(7)]
    saved = straight.state.copy()
    rest = [next(it) for _ in range(6)]
    resumed = BlockStream(data, pooled(data, spec.seed), 0, 1, micro_batch=5, state=saved, workers=0)
    again = [b for _, b in zip(range(6), resumed, strict=False)]
    assert [b.block_ids for b in again] == [b.block_ids for b in rest]
    for a, b in zip(again, rest, strict=True):
        assert (a.input_ids == b.input_ids).all() and (a.labels == b.labels).all()
    assert len({tuple(i) for b in first + rest for i in b.block_ids}) == 13 * 5  # no block twice


class _Logged(torch.utils.data.Dataset):
    """A dataset that notes each chunk its worker fetches, one line per chunk, in a file."""

    def __init__(self, data: StreamingChunks, log: Path) -> None:
        self.data, self.log = data, log

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: tuple[int, int]):
        with open(self.log, "a") as f:
            f.write(f"{key[1]}\n")
        return self.data[key]


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_one_loader_reads_every_epoch_and_fetches_across_the_boundary(
    source, tokenizer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's workers start once and fetch the next epoch's first chunk before its blocks are
    asked for: an epoch boundary waits for no new worker and no cold chunk."""
    from dsgpt2.data import loader

    made = []
    real = loader._make_loader
    monkeypatch.setattr(loader, "_make_loader", lambda *a, **k: made.append(a) or real(*a, **k))
    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    schedule = pooled(data, spec.seed)
    expected = [
        x for e in range(3) for c in schedule.rank_chunks(0, e, 0, 1) for x in served(data, e, int(c))
    ]
    first_epoch = sum(1 for e, _, _ in expected if e == 0)
    chunks = len(schedule.rank_chunks(0, 0, 0, 1))
    log = tmp_path / "fetched"
    stream = BlockStream(_Logged(data, log), schedule, 0, 1, micro_batch=1, workers=1)
    it = iter(stream)
    ids = [next(it).block_ids[0] for _ in range(first_epoch)]  # epoch 0, to its last block
    wait_for(lambda: len(_lines(log)) > chunks, 10, "the next epoch's first chunk read ahead", every=0.05)
    ahead = _lines(log)[chunks:]
    assert ahead and int(ahead[0]) == schedule.rank_chunks(0, 1, 0, 1)[0]
    ids += [next(it).block_ids[0] for _ in range(len(expected) - first_epoch)]
    stream.close()
    assert ids == expected
    assert len(made) == 1


@pytest.mark.parametrize("workers", [0, 1])
def test_a_rank_with_no_training_block_fails_at_once(source, tokenizer: Path, workers: int) -> None:
    from dsgpt2.errors import CorpusError

    conn, counts, spec = source
    nothing = StreamingChunks(conn.config, counts, tokenizer, DataSpec(32, 40, 0.0, 3, 0, 1), "train")
    with pytest.raises(CorpusError, match="rank 0 has no training block of s, t in a whole epoch"):
        next(iter(BlockStream(nothing, pooled(nothing, spec.seed), 0, 1, 2, workers=workers)))
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    with pytest.raises(CorpusError, match="rank 20 has no training block"):  # 15 chunks, 21 ranks
        next(iter(BlockStream(data, pooled(data, spec.seed), 20, 21, 2, workers=workers)))


def test_a_reader_saved_at_an_epoch_end_resumes_with_the_next_epoch(source, tokenizer: Path) -> None:
    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    schedule = pooled(data, spec.seed)
    ends = ReadState.start(1)
    ends.streams[0] = Position(0, len(schedule.rank_chunks(0, 0, 0, 1)), 0)
    first = next(iter(BlockStream(data, schedule, 0, 1, 1, state=ends, workers=0)))
    assert first.block_ids == served(data, 1, int(schedule.rank_chunks(0, 1, 0, 1)[0]))[:1]


def test_a_stream_dropped_mid_epoch_stops_its_workers_at_once(source, tokenizer: Path) -> None:
    """Left to the garbage collector (no close), a stream's DataLoader workers still stop at once."""
    import gc
    import multiprocessing

    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    stream = BlockStream(data, pooled(data, spec.seed), 0, 1, micro_batch=5, workers=2)
    it = iter(stream)
    next(it)
    workers = [p for p in multiprocessing.active_children() if p.daemon]
    assert len(workers) == 2
    started = time.monotonic()
    del it, stream
    gc.collect()
    for p in workers:
        p.join(deadline(3))
    assert not any(p.is_alive() for p in workers) and time.monotonic() - started < deadline(3)


@pytest.mark.parametrize(
    ("order", "packing"), [("spread", "end_to_end"), ("ranges", "end_to_end"), ("spread", "bos")]
)
def test_cache_gives_the_same_blocks_as_streaming(
    source, tokenizer: Path, tmp_path: Path, order: str, packing: str
) -> None:
    """Chunks as they lie (evaluation) and as each epoch reads them (training), both splits: the
    same blocks, block order and tokens per collection from the token files as from the database
    (``--packing bos``: training's blocks BOS-aligned, validation's end to end)."""
    from dataclasses import replace

    conn, counts, spec = source
    spec = replace(spec, order=order, packing=packing)
    streaming = {s: StreamingChunks(conn.config, counts, tokenizer, spec, s) for s in ("train", "val")}
    fp = fingerprint(conn.config, tokenizer, cached_spec(spec))  # a cache serves either packing
    totals = build_cache(
        StreamingChunks(conn.config, counts, tokenizer, spec, "all"), tmp_path, fp, 400, workers=0
    )
    assert totals["train"] > 4 * totals["val"] > 0
    assert (tmp_path / "tokens.bin").stat().st_size == (totals["train"] + totals["val"]) * 2
    for split in ("train", "val"):
        cached = CachedChunks(tmp_path, split, streaming[split].table, packing=packing)
        for key in [*range(len(cached)), *((e, c) for e in (0, 3) for c in range(len(cached)))]:
            a, b = streaming[split][key], cached[key]
            assert np.array_equal(a.blocks, b.blocks) and a.last == b.last
            assert np.array_equal(a.valid, b.valid)
            assert np.array_equal(a.shares, b.shares) and a.shares.sum() == a.valid.sum()
            padded = (a.valid < spec.context)[:-1].any()  # blocks before the last with padding
            assert padded == (packing == "bos" and split == "train"), (split, key)
            assert (a.order is None) == (b.order is None) and (
                a.order is None or np.array_equal(a.order, b.order)
            )
    va = eval_batches(streaming["val"], 0, 1, 4, limit=3)
    vb = eval_batches(CachedChunks(tmp_path, "val", streaming["val"].table), 0, 1, 4, limit=3)
    assert [x.block_ids for x in va] == [x.block_ids for x in vb]


@pytest.mark.parametrize("packing", ["end_to_end", "bos"])
def test_layout_places_each_document_where_its_chunk_packs_it(source, tokenizer: Path, packing: str) -> None:
    """Each training document's span in its chunk's blocks holds its tokens and its end-of-text;
    the spans tile the chunk (end to end; BOS-aligned: each starts a block or follows whole documents,
    the rest is padding); documents of the other split are absent (what lineage relies on)."""
    from dataclasses import replace

    from dsgpt2.tokenizer.bpe import load_tokenizer

    conn, counts, spec = source
    spec = replace(spec, packing=packing)
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    tok = load_tokenizer(tokenizer)
    names = ("s", "t")
    for key in (0, 9, (2, 0), (2, 9)):  # one chunk of each collection, as it lies and in epoch 2
        colls, idxs = data.chunks.wanted(key)
        where, flat = data.layout(key), data[key].blocks.reshape(-1)
        assert list(where) == list(zip(colls.tolist(), idxs.tolist(), strict=True))  # in reading order
        assert all(split_mask(np.array([i]), spec.tr_ratio, spec.seed, names[c])[0] for c, i in where)
        at, covered = 0, np.zeros(len(flat), dtype=bool)
        for c, idx in where:
            first, end = where[(c, idx)]
            text = conn.db[names[c]].find_one({"idx": idx})["filt_text"]
            assert first == at or packing == "bos"  # BOS-aligned: placed best-first, not in reading order
            assert packing == "end_to_end" or end - first >= 32 or first // 32 == (end - 1) // 32  # one block
            assert flat[end - 1] == spec.eot and not covered[first:end].any()
            assert flat[first : end - 1].tolist() == tok.encode(text, add_special_tokens=False).ids
            covered[first:end] = True
            at = end
        assert covered.sum() == data[key].valid.sum()
        if packing == "bos":  # each block's documents from its first token on, padding after them
            rows = covered.reshape(-1, spec.context)
            assert all(row[: row.sum()].all() for row in rows) and rows[:, 0].all()
            assert (flat[~covered] == spec.pad).all()


def test_a_replay_retraces_the_ranks_and_refuses_to_end_elsewhere(source, tokenizer: Path) -> None:
    """Two ranks under mixture weights with a stage change, 2 micro-batches a step, micro-batch 3
    skipped: the replay of that record yields each step's block ids and ends at the saved
    positions; a record that ends elsewhere is refused."""
    from dsgpt2.checkpoints.lineage import Replay, parse_doc
    from dsgpt2.data.mixture import Stage
    from dsgpt2.errors import ConfigError, LineageError

    assert parse_doc("t:12", ["s", "t"]) == (1, 12) and parse_doc("a:b:3", ["a:b"]) == (0, 3)
    for bad in ("t", "t:x", "t:-1", ":3"):
        with pytest.raises(ConfigError, match=r"write COLLECTION:IDX|not one of the run's collections"):
            parse_doc(bad, ["s", "t"])

    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    streams, stages = [(0,), (1,)], [Stage(0, (0.5, 0.5)), Stage(3, (0.9, 0.1))]
    schedule = ChunkOrders(data.table, streams, 5)
    ranks = [
        BlockStream(data, schedule, r, 2, 3, workers=0, stages=stages, ramp=BatchRamp(2)) for r in (0, 1)
    ]
    readers = [iter(b) for b in ranks]
    logged, micro = [], 0
    for _ in range(5):  # the trainer's steps: micro-batch 3 is drawn, then left out
        ids: list[list] = [[], []]
        trained = 0
        while trained < 2:
            micro += 1
            drawn = [next(r) for r in readers]
            if micro != 3:
                trained += 1
                for r, batch in enumerate(drawn):
                    ids[r].extend(batch.block_ids)
        logged.append(ids)
    record = {
        "table": data.table.to_dict(), "streams": [list(s) for s in streams], "growth": [],
        "launches": [{"step": 0, "micro": 0, "world": 2, "micro_batch": 3, "grad_accum": 2,
                      "stages": [[0, [0.5, 0.5]], [3, [0.9, 0.1]]], "follow": 0}],
        "skipped_micro": [3], "ranks": [b.state.to_dict() for b in ranks],
    }  # fmt: skip
    replay = Replay(record, 5, data)
    assert [ids for _, ids in replay.steps(5)] == logged
    replay.check("global_step5")
    record["skipped_micro"] = []
    replay = Replay(record, 5, data)
    list(replay.steps(5))
    with pytest.raises(LineageError, match="the ranks' positions differ from those global_step5 saved"):
        replay.check("global_step5")


def test_conversation_chunks_cache_and_batch_with_reply_labels(tokenizer: Path, tmp_path: Path) -> None:
    conn = Connection(make_config(["chat"]))
    ingest(conn, "chat", [builtin_source("stdlib-chat", 120)])
    counts = MongoWrapper(conn.config, connection=conn).counts
    spec = DataSpec(context=32, chunk_docs=50, tr_ratio=0.8, seed=3, eot=0, pad=1, task="conversation")
    streaming = {s: StreamingChunks(conn.config, counts, tokenizer, spec, s) for s in ("train", "val")}
    chunk = streaming["train"][0]
    assert chunk.loss is not None and chunk.loss.shape == chunk.blocks.shape
    assert 0 < chunk.loss.mean() < 1  # replies learned, questions and speaker tokens not
    everything = StreamingChunks(conn.config, counts, tokenizer, spec, "all")
    build_cache(everything, tmp_path, fingerprint(conn.config, tokenizer, spec), 400, workers=0)
    for split in ("train", "val"):
        cached = CachedChunks(tmp_path, split, streaming[split].table)
        for key in [*range(len(cached)), *((1, c) for c in range(len(cached)))]:
            a, b = streaming[split][key], cached[key]
            assert np.array_equal(a.blocks, b.blocks) and np.array_equal(a.loss, b.loss)
    (batch,) = eval_batches(CachedChunks(tmp_path, "train", streaming["train"].table), 0, 1, 4, limit=1)
    rows = [streaming["train"][c] for c in sorted({c for _, c, _ in batch.block_ids})]
    expected = np.concatenate([r.loss for r in rows])[: len(batch.labels)]
    assert np.array_equal((batch.labels.numpy() != -100), expected)
    spans = sorted(streaming["train"].layout(0).values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == chunk.valid.sum()


def test_tokenize_ahead_for_a_conversation_run(tokenizer: Path, tmp_path: Path) -> None:
    """`dsgpt2 tokenize --task conversation --read_order ranges` builds the cache such a run then reuses."""
    from conftest import write_config
    from dsgpt2.cli.main import main
    from dsgpt2.data.cache import cache_fingerprint
    from dsgpt2.db.config import load_config
    from dsgpt2.train.config import DataOptions, ModelOptions, data_spec

    conn = Connection(make_config(["chat"]))
    ingest(conn, "chat", [builtin_source("stdlib-chat", 120)])
    cfg = write_config(tmp_path / "c.json", **conn.config.to_dict() | {"COLLECTIONS": ["chat"]})
    cache = tmp_path / "cache"
    assert main(["tokenize", "--config_train", str(cfg), "--vocab_dir", str(tokenizer), "--context_length",
                 "32", "--chunk_docs", "50", "--cache_dir", str(cache), "--num_workers", "0", "--task",
                 "conversation", "--reply_speakers", "bot", "--read_order", "ranges"]) == 0  # fmt: skip
    data = DataOptions(config_train=cfg, vocab_dir=tokenizer, chunk_docs=50, read_order="ranges")
    run = data_spec(data, ModelOptions(context_length=32, task="conversation"), 32)
    assert run.task == "conversation"
    assert cache_fingerprint(cache) == fingerprint(load_config(cfg), tokenizer, run)


class _Pids(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        time.sleep(0.2)
        return os.getpid()


def test_loader_workers_outlive_a_group_sigterm() -> None:
    """A SIGTERM to the whole process group leaves the rank's workers to it: the rank saves first."""
    from dsgpt2.data.loader import start_loader

    it = iter(start_loader(_Pids(), range(6), workers=1, prefetch=1))
    worker = next(it)
    assert worker != os.getpid()
    os.kill(worker, signal.SIGTERM)
    assert list(it) == [worker] * 5


def test_index_state_does_not_grow_with_the_corpus() -> None:
    """A reader's state for 100M documents: the chunk order only, never a list of documents."""

    def peak(total: int) -> int:
        tracemalloc.start()
        table = ChunkTable.initial(["a"], [total], 1000)
        order = ChunkOrders(table, [(0,)], seed=1).rank_chunks(0, 0, 0, 8)
        _, lo, hi = table.locate(int(order[0]))
        split_mask(np.arange(lo, hi), 0.99, seed=1, collection="a")
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    # tracemalloc sees every thread of the process (a client's monitor, a finished test's pool): the
    # least of three measures is this code's own.
    small, huge = min(peak(10_000) for _ in range(3)), min(peak(100_000_000) for _ in range(3))
    assert huge < 4 * 1024 * 1024  # a permutation of 100k chunk ids, not of 100M documents
    assert small < 200 * 1024


WORKERS_OF_A_KILLED_RANK = """
import os, sys, time, torch
from dsgpt2.data.loader import start_loader

class Busy(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        os.write(1, b"%d\\n" % os.getpid())  # one write: the two workers' lines never interleave
        time.sleep(120)  # busy in a fetch: torch's own parent watchdog does not run here
        return i

it = iter(start_loader(Busy(), range(10), workers=2, prefetch=1))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_loader_workers_die_with_a_sigkilled_rank() -> None:
    import subprocess

    rank = subprocess.Popen([sys.executable, "-c", WORKERS_OF_A_KILLED_RANK], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert rank.stdout is not None
    workers: set[int] = set()
    try:
        workers = {int(rank.stdout.readline()), int(rank.stdout.readline())}
        assert rank.pid not in workers and all(_alive(p) for p in workers)
        rank.kill()
        rank.wait()
        wait_for(lambda: not any(_alive(p) for p in workers), 5, "the workers' end", every=0.05)
    finally:
        rank.kill()
        rank.wait()
        rank.stdout.close()
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_redeal_leaves_every_block_to_exactly_one_new_rank() -> None:
    from dsgpt2.data.dealing import redeal

    n, seed, blocks = 23, 5, lambda c: c % 4 + 1  # chunk c holds c % 4 + 1 blocks
    schedule = ChunkOrders(ChunkTable.initial(["a"], [n * 10], 10), [(0,)], seed)

    def epoch_order(n: int, seed: int, e: int) -> np.ndarray:
        return schedule.order(0, e)

    def read(positions: list[Position], world: int) -> set[tuple[int, int, int]]:
        """The epoch-0/1 blocks ranks at ``positions`` have read (a queue is what they have not)."""
        out = set()
        for r, p in enumerate(positions):
            for e in range(p.epoch + 1):
                mine = epoch_order(n, seed, e)[r::world]
                done = len(mine) if e < p.epoch else p.chunk
                out |= {(e, int(c), b) for c in mine[:done] for b in range(blocks(int(c)))}
                if e == p.epoch and p.chunk < len(mine) and not p.queue:
                    out |= {(e, int(mine[p.chunk]), b) for b in range(p.block)}
        return out

    every = {(e, c, b) for e in (0, 1) for c in range(n) for b in range(blocks(c))}
    # Two ranks stopped in different places, one of them already in epoch 1.
    two = [Position(0, 7, 1), Position(1, 2, 0)]
    three = redeal(two, lambda e: schedule.order(0, e), 3)
    left = [(e, c, b) for p in three for e, c, skip in p.queue for b in range(skip, blocks(c))]
    assert len(left) == len(set(left))
    assert set(left) | read(two, 2) == every
    assert set(left).isdisjoint(read(two, 2))
    assert all(p.epoch == 2 and p.chunk == 0 for p in three)
    # The resume's log line says the leftovers come first: not "epoch 2", as if epochs 0 and 1 were done.
    said = three[0].describe()
    assert said.startswith(f"first {len(three[0].queue)} chunk(s) of epoch 0, 1 left unread, then epoch 2"), (
        said
    )
    assert Position(3, 4, 5).describe() == "epoch 3, chunk 4, block 5"
    # Redealt again before the queues are done: still each block once.
    part = [Position(2, 0, 0, p.queue[1:]) for p in three]  # each new rank read its first item
    first = {(e, c, b) for p in three for e, c, skip in p.queue[:1] for b in range(skip, blocks(c))}
    one = redeal(part, lambda e: schedule.order(0, e), 1)
    again = [(e, c, b) for e, c, skip in one[0].queue for b in range(skip, blocks(c))]
    assert len(again) == len(set(again))
    assert {x for x in again if x[0] < 2} | first == set(left)  # the rest of epochs 0 and 1
    assert {x for x in again if x[0] == 2} == {(2, c, b) for c in range(n) for b in range(blocks(c))}


def test_the_feed_bench_counts_epoch_boundaries_and_replays_the_same_blocks(source, tokenizer: Path) -> None:
    """``python -m bench feed`` times what the trainer reads: its replayed database answers give the
    very blocks that the server gives, to forked workers too, and its windows cross the boundaries."""
    from bench.bench_feed import MICRO, every_chunk, read
    from bench.common import instant_backend

    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    schedule = pooled(data, spec.seed)

    def batches() -> list:
        return [b for _, b in zip(range(40), BlockStream(data, schedule, 0, 1, 7, workers=1), strict=False)]

    plain = batches()
    with instant_backend(lambda: every_chunk(data, 4)):
        replayed = batches()
        r = read(data, schedule, 1, epochs=2)
    assert [b.block_ids for b in replayed] == [b.block_ids for b in plain]
    assert all((a.input_ids == b.input_ids).all() for a, b in zip(replayed, plain, strict=True))
    assert len(r.boundary) == 2 and r.micro_batches == r.boundary[-1] + 1
    assert r.tokens <= r.micro_batches * MICRO * spec.context and r.tokens_per_s > 0 and r.cpu > 0


@pytest.mark.slow
def test_two_ranks_train_on_every_training_document_once_an_epoch(source, tokenizer: Path) -> None:
    """Spread order, two ranks: the blocks the ranks' streams hand out in an epoch are every block of
    the epoch's chunks once, and through the chunks' packing every training document once; a
    step's blocks come from all over both collections, never a run of neighbours."""
    from collections import Counter
    from functools import cache

    conn, counts, spec = source
    data = StreamingChunks(conn.config, counts, tokenizer, spec, "train")
    layout = cache(data.layout)  # a chunk's documents read and tokenized once, not once per block
    schedule = pooled(data, spec.seed)
    got: Counter = Counter()
    spans: dict[tuple[int, int], set[int]] = {}
    for rank in range(2):
        expected = [x for c in schedule.rank_chunks(0, 1, rank, 2) for x in served(data, 1, int(c))]
        start = ReadState.start(1)
        start.streams[0] = Position(1, 0, 0)
        stream = iter(BlockStream(data, schedule, rank, 2, micro_batch=1, state=start, workers=0))
        ids = [next(stream).block_ids[0] for _ in range(len(expected))]
        assert ids == expected
        got.update(ids)
        steps = [ids[i : i + 8] for i in range(0, len(ids) - 8, 8)]
        for step in steps[:5]:
            docs = {d for e, c, b in step for d, (first, end) in layout((e, c)).items()
                    if first < (b + 1) * spec.context and end > b * spec.context}  # fmt: skip
            assert len({i // 25 for c, i in docs}) >= 4  # spread over buckets of 25 documents
    assert max(got.values()) == 1
    for e, c, b in got:
        for d, (first, end) in layout((e, c)).items():
            if first < (b + 1) * spec.context and end > b * spec.context:
                spans.setdefault(d, set()).add(b)
    names = ("s", "t")
    train = {
        (c, i) for c, n in enumerate(counts) for i in range(n)
        if split_mask(np.array([i]), spec.tr_ratio, spec.seed, names[c])[0]
    }  # fmt: skip
    assert set(spans) == train


def test_a_cache_of_packed_blocks_is_rebuilt_as_tokens_per_document(
    source, tokenizer: Path, tmp_path: Path
) -> None:
    """A token cache written before tokens per document (packed blocks per split, no format) is
    not read as one: it is rebuilt, and its former files go."""
    import json

    conn, counts, spec = source
    everything = StreamingChunks(conn.config, counts, tokenizer, spec, "all")
    fp = fingerprint(conn.config, tokenizer, spec)
    (tmp_path / "train.bin").write_bytes(b"\0" * 64)
    (tmp_path / "cache.json").write_text(json.dumps({"fingerprint": fp, "dtype": "uint16", "chunks": 15}))
    with pytest.raises(ConfigError, match="holds no complete token cache"):
        CachedChunks(tmp_path, "train", everything.table)
    totals = build_cache(everything, tmp_path, fp, 400, workers=0)
    assert not (tmp_path / "train.bin").exists() and totals["train"] > 0
    cached = CachedChunks(tmp_path, "train", everything.table)
    assert np.array_equal(
        cached[(1, 4)].blocks, StreamingChunks(conn.config, counts, tokenizer, spec, "train")[(1, 4)].blocks
    )
