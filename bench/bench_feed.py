"""The feed: what the training process receives from ``BlockStream``, with no model.

The sample corpus is one small epoch (about 0.7 M training tokens, chunks of 250 documents), so every
measured window crosses several epoch boundaries, as a long run crosses many.

- streaming tokens/s with 1 and 2 DataLoader workers (4 as info), each tokenizing on one thread;
  with one worker ÷ the tokenizer's own ``encode_batch`` on one thread over the same documents in the
  same chunks (target ≥ 0.8): what the training process receives against what one core can tokenize;
- cached tokens/s (``--data_mode cached``, the trainer's 2 workers): ≥ 2 M tokens/s;
- the training process's CPU time per micro-batch (its own, not its workers'), streaming and cached:
  ≤ 3 ms, small against a device step;
- epoch boundary: the stream is read by a consumer that waits like a device step, 1.25 × the feed's
  own time per micro-batch, so that a stall shows as a longer micro-batch; the slowest micro-batch that
  takes an epoch's first block ÷ the median micro-batch (target ≤ 2).

The store is the embedded database (``local://``, a SecantusDB server on this machine): its reads are
part of the end-to-end streaming figure, and they are not a MongoDB deployment's.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Metric, database_uri, instant_backend

MICRO = 32
CONTEXT = 1024
CHUNK_DOCS = 250
PACE = 1.25  # the paced consumer's step, in units of the feed's own time per micro-batch


@dataclass
class Reading:
    """One pass over the stream: the window after the first micro-batch (workers started)."""

    wall: float = 0.0  # seconds from the first micro-batch's arrival to the last's
    cpu: float = 0.0  # the training process's CPU seconds over the same window
    tokens: int = 0  # real tokens received in the window
    times: list[float] = field(default_factory=list)  # per micro-batch: wait (+ the paced step)
    boundary: list[int] = field(default_factory=list)  # micro-batches that take an epoch's first block

    @property
    def micro_batches(self) -> int:
        return len(self.times)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall

    @property
    def per_micro(self) -> float:
        """Seconds per micro-batch."""
        return self.wall / self.micro_batches

    @property
    def stall(self) -> float:
        """The slowest boundary micro-batch ÷ the median micro-batch."""
        return max(self.times[i] for i in self.boundary) / statistics.median(self.times)


def read(source: Any, schedule: Any, workers: int, epochs: int, step: float = 0.0) -> Reading:
    """Read ``epochs`` epochs after the first micro-batch; ``step`` seconds of waiting per micro-batch."""
    from dsgpt2.data.loader import BlockStream

    stream = BlockStream(source, schedule, rank=0, world=1, micro_batch=MICRO, workers=workers)
    batches = iter(stream)
    r = Reading()
    try:
        first = next(batches)
        epoch = first.block_ids[-1][0]
        last = epoch + epochs
        start, cpu = time.perf_counter(), time.process_time()
        while epoch < last:
            t = time.perf_counter()
            batch = next(batches)
            if step:
                time.sleep(step)
            r.times.append(time.perf_counter() - t)
            if batch.block_ids[-1][0] != epoch:
                r.boundary.append(len(r.times) - 1)
                epoch = batch.block_ids[-1][0]
            r.tokens += batch.tokens
        r.wall, r.cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        stream.close()
    return r


@contextmanager
def one_thread() -> Iterator[None]:
    """The tokenizer on one thread, as in a DataLoader worker."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode_rate(source: Any, tokenizer_dir: Path, repeats: int = 3) -> float:
    """Tokens/s of ``Tokenizer.encode_batch`` on one thread over the training documents of every
    chunk, chunk by chunk; a token per document for its end-of-text, as the stream counts them."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    chunks = [[d.text for d in source._documents(c)[0]] for c in range(len(source))]
    times, tokens = [], 0
    with one_thread():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            encoded = [raw.encode_batch(texts, add_special_tokens=False) for texts in chunks]
            times.append(time.perf_counter() - start)
            tokens = sum(len(e.ids) + 1 for chunk in encoded for e in chunk)
    return tokens / statistics.median(times[1:])


def every_chunk(source: Any, epochs: int) -> list[Any]:
    """Every chunk as the first ``epochs`` epochs read it (each epoch's chunks hold other documents)."""
    return [source[(e, c)] for e in range(epochs) for c in range(len(source))]


def _setup(texts: list[str], tokenizer_dir: Path) -> tuple[Any, Any, Any]:
    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.sources import StreamingChunks, make_spec
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict

    config = config_from_dict(
        {"MONGO_CONNECTION_STRING": database_uri(), "MONGO_CONNECTION_DB": "bench_feed",
         "COLLECTIONS": ["s"]}, env={},
    )  # fmt: skip
    conn = Connection(config)
    conn.db["s"].drop()
    conn.db["s"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    conn.db["meta_info"].update_one({"collection": "s"}, {"$set": {"count": len(texts)}}, upsert=True)
    spec = make_spec(tokenizer_dir, context=CONTEXT, chunk_docs=CHUNK_DOCS, tr_ratio=0.99, seed=0)
    table = ChunkTable.initial(config.collections, [len(texts)], spec.chunk_docs)
    source = StreamingChunks(config, table, tokenizer_dir, spec, "train")
    return config, spec, (source, ChunkOrders(table, [(0,)], seed=0))


def feed(texts: list[str], results: Path, epochs: int = 6, cached_epochs: int = 40) -> list[Metric]:
    from dsgpt2.data.cache import CachedChunks, prepare_cache

    tokenizer = results / "vocab_bench_tok"
    if not (tokenizer / "tokenizer.json").exists():
        from bench import bench_vocab

        bench_vocab.run(texts, results, repeats=1)
    work = results / "feed"
    config, spec, (source, schedule) = _setup(texts, tokenizer)
    where = f"micro {MICRO} × context {CONTEXT}, chunks of {CHUNK_DOCS} documents"

    anchor = encode_rate(source, tokenizer)
    end_to_end = read(source, schedule, 1, epochs)
    with instant_backend(lambda: every_chunk(source, epochs + 2)):
        streaming = {w: read(source, schedule, w, epochs) for w in (1, 2, 4)}
        paced = {w: read(source, schedule, w, epochs, step=PACE * streaming[w].per_micro) for w in (1, 2)}
    prepare_cache(config, tokenizer, spec, work / "cache", workers=2, force=True, table=schedule.table)
    cache = CachedChunks(work / "cache", "train", schedule.table)
    cached = read(cache, schedule, 2, cached_epochs)
    cached_paced = read(cache, schedule, 2, epochs, step=PACE * cached.per_micro)
    for name, r in [("local:// end to end, 1 worker", end_to_end)] + [
        (f"{w} worker(s)", r) for w, r in streaming.items()
    ]:
        print(f"   streaming, {name}: {r.tokens_per_s:,.0f} tokens/s over {r.micro_batches} micro-batches "
              f"and {len(r.boundary)} epoch boundaries", flush=True)  # fmt: skip

    replayed = "database answers replayed at no cost"
    one = streaming[1]
    metrics = [
        Metric("feed streaming, 1 worker (÷ encode_batch)", one.tokens_per_s, anchor, "tokens/s", ">= 0.8",
               one.tokens_per_s >= 0.8 * anchor, f"{where}; one tokenizer thread both sides; {replayed}"),
        Metric("feed streaming, 2 workers (÷ encode_batch)", streaming[2].tokens_per_s, anchor, "tokens/s",
               "info", True, replayed),
        Metric("feed streaming, 4 workers (÷ encode_batch)", streaming[4].tokens_per_s, anchor, "tokens/s",
               "info", True, f"more workers than cores; {replayed}"),
        Metric("feed streaming, 1 worker, local:// (÷ encode_batch)", end_to_end.tokens_per_s, anchor,
               "tokens/s", "info", True, "reads from the embedded server included"),
        Metric("feed cached", cached.tokens_per_s, 2e6, "tokens/s", ">= 2M", cached.tokens_per_s >= 2e6,
               f"{where}; 2 workers"),
    ]  # fmt: skip
    for name, r in (("streaming, 1 worker", one), ("cached", cached)):
        ms = 1e3 * r.cpu / r.micro_batches
        metrics.append(
            Metric(f"feed main-process CPU, {name}", ms, 3.0, "ms/micro", "<= 3 ms", ms <= 3.0,
                   "the training process's own CPU per micro-batch")
        )  # fmt: skip
    stalls = (("streaming, 1 worker", paced[1]), ("streaming, 2 workers", paced[2]), ("cached", cached_paced))
    for name, r in stalls:
        slowest, median = max(r.times[i] for i in r.boundary), statistics.median(r.times)
        note = f"slowest of {len(r.boundary)} boundary micro-batches ÷ median; steps {PACE}× the feed's"
        metrics.append(
            Metric(f"feed epoch boundary, {name}", slowest, median, "s", "<= 2x median", r.stall <= 2.0, note)
        )
    return metrics
