"""Shuffle quality: does a corpus stored in arrival order train as well as a shuffled copy of itself?

- spread of a step over the corpus (no model): the documents a rank reads per step, in the spread
  order (ours), in a global random permutation of the documents (the ideal) and in the ranges order
  (chunks of consecutive documents, the order before): distinct 1 % buckets of the unified index per
  step, and the share of a step's buckets the step before also touched;
- held-out perplexity (the demo's recipe: tiny preset, 16 × 128 tokens, cosine 3e-3): the sample
  corpus as it is stored (module by module) and the same documents randomly permuted, each read in
  the spread and the ranges order; the same held-out documents (5 %, chosen by a hash of their text,
  in a collection of their own), the same tokenizer and steps, the spread arms under several seeds
  (``BENCH_SHUFFLE_SEEDS``) and compared by their geometric means. Ours: arrival ÷ permuted
  (target <= 1.03);
- the read side on a MongoDB wire server, where one is installed (``secantusd-py``): documents per
  command and index keys examined per document returned, from ``explain``, per order.

``BENCH_SHUFFLE_STEPS`` sets the training steps (default 1,000, the demo's: eight runs of about two
and a half minutes on two cores).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Metric
from dsgpt2.data.table import ChunkTable

STEPS = int(os.environ.get("BENCH_SHUFFLE_STEPS", "1000"))
# Two random orders of the same documents give held-out perplexities a percent or two apart: the spread
# arms are trained under several seeds (model and order) and compared by their geometric means.
SEEDS = tuple(int(x) for x in os.environ.get("BENCH_SHUFFLE_SEEDS", "1234,1,2").split(","))
HELD_OUT = 0.05


@dataclass
class Spread:
    buckets: float  # distinct 1 % buckets of the index per step, mean
    overlap: float  # share of a step's buckets that the step before touched, mean


def reading(kind: str, table: ChunkTable, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """The global indices of the documents one rank reads in ``epoch``, in order."""
    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.order import ReadOrder

    total = sum(table.marks)
    if kind == "global":
        return np.random.default_rng([seed, epoch]).permutation(total)
    streams = [tuple(range(len(table.names)))]
    order = ReadOrder(table, streams, seed, kind)
    offsets = np.concatenate([[0], np.cumsum(table.marks)])
    parts = []
    for c in ChunkOrders(table, streams, seed).rank_chunks(0, epoch, 0, 1):
        colls, idxs = order.documents(epoch, int(c))
        parts.append(offsets[colls] + idxs)
    return np.concatenate(parts)


def spread_of_steps(kind: str, table: ChunkTable, docs_per_step: int, steps: int) -> Spread:
    """How a reading of ``kind`` (global, spread, ranges) spreads ``steps`` steps of ``docs_per_step``
    documents over the corpus."""
    docs = reading(kind, table)[: docs_per_step * steps]
    buckets = docs * 100 // sum(table.marks)
    sets = [set(buckets[i : i + docs_per_step].tolist()) for i in range(0, len(buckets), docs_per_step)]
    overlap = [len(a & b) / len(b) for a, b in itertools.pairwise(sets)]
    return Spread(float(np.mean([len(s) for s in sets])), float(np.mean(overlap)))


def spread_metrics(table: ChunkTable, docs_per_step: int, steps: int = 2000) -> list[Metric]:
    ours, ideal, ranges = (
        spread_of_steps(k, table, docs_per_step, steps) for k in ("spread", "global", "ranges")
    )
    where = f"{sum(table.marks)} documents, chunks of {table.chunk_docs}, {docs_per_step} documents a step"
    return [
        Metric("shuffle: 1% buckets per step (÷ global permutation)", ours.buckets, ideal.buckets, "buckets",
               ">= 0.9", ours.buckets >= 0.9 * ideal.buckets, where),
        Metric("shuffle: 1% buckets per step (÷ ranges order, before)", ours.buckets, ranges.buckets,
               "buckets", "info", True, where),
        Metric("shuffle: buckets shared with the step before (÷ global)", ours.overlap, ideal.overlap,
               "share",
               "<= 1.1", ours.overlap <= 1.1 * ideal.overlap + 0.01, f"ranges order: {ranges.overlap:.2f}"),
    ]  # fmt: skip


def _store(conn: Any, name: str, texts: list[str]) -> None:
    coll = conn.db[name]
    coll.drop()
    coll.insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    coll.create_index("idx", unique=True)
    conn.db["meta_info"].update_one({"collection": name}, {"$set": {"count": len(texts)}}, upsert=True)


def _held_out(text: str) -> bool:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") / 2**64 < HELD_OUT


def _train_and_evaluate(
    store: str, collection: str, order: str, seed: int, tokenizer: Path, run: Path
) -> float:
    """The demo's recipe on ``collection``, read in ``order``; perplexity on the held-out collection."""
    import shutil

    from dsgpt2.cli.pipeline import demo_recipe
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.infer.evaluate import evaluate
    from dsgpt2.infer.loading import load_model
    from dsgpt2.infer.settings import EvalRequest
    from dsgpt2.settings.shipped import shipped_config_named
    from dsgpt2.train.config import (
        CheckpointOptions,
        DataOptions,
        EngineOptions,
        ModelOptions,
        RunOptions,
        ScheduleOptions,  # fmt: skip
        TrainConfig,
    )
    from dsgpt2.train.trainer import build

    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    mongo = config_from_dict({"MONGO_CONNECTION_STRING": store, "MONGO_CONNECTION_DB": "shuffle",
                              "COLLECTIONS": [collection]}, env={})  # fmt: skip
    recipe = demo_recipe()
    cfg = TrainConfig(
        data=DataOptions(config_train=None, vocab_dir=tokenizer, tr_ratio=1.0, read_order=order, seed=seed),
        model=ModelOptions(model_select="tiny"),
        run=RunOptions(train_iters=STEPS, eval_interval=10 * STEPS, workspace=run / "train", wandb="off"),
        ckpt=CheckpointOptions(ckpt_dir=run / "ckpt", save_interval=STEPS, no_resume=True),
        schedule=ScheduleOptions(
            lr_schedule="cosine", lr=recipe.lr, warmup_iters=min(recipe.warmup_iters, STEPS // 4)
        ),
        engine=EngineOptions(deepspeed_config=shipped_config_named(recipe.deepspeed_config)),
    )
    build(cfg, mongo=mongo).train()
    request = EvalRequest(split="all", collections=("heldout",), workers=0)
    report = evaluate(load_model(run / "ckpt"), mongo, request, progress=False)
    return float(report["metrics"]["perplexity"])


def perplexity_metrics(texts: list[str], results: Path) -> list[Metric]:
    from dsgpt2.db import embedded
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab

    work = results / "shuffle"
    work.mkdir(parents=True, exist_ok=True)
    store = f"local://{work / 'db'}"
    conn = Connection(config_from_dict({"MONGO_CONNECTION_STRING": store, "MONGO_CONNECTION_DB": "shuffle",
                                        "COLLECTIONS": ["arrival"]}, env={}))  # fmt: skip
    train = [t for t in texts if not _held_out(t)]
    held = [t for t in texts if _held_out(t)]
    permuted = [train[i] for i in np.random.default_rng(0).permutation(len(train))]
    for name, docs in (("arrival", train), ("permuted", permuted), ("heldout", held)):
        _store(conn, name, docs)
    tokenizer = work / "tok"
    if not (tokenizer / "tokenizer.json").exists():
        train_vocab(train, tokenizer, VocabSettings(vocab_size=8192), "shuffle", progress=False)
    ppl = {}
    for collection in ("arrival", "permuted"):
        for order in ("spread", "ranges"):
            seeds = SEEDS if order == "spread" else SEEDS[:1]
            runs = []
            for seed in seeds:
                runs.append(_train_and_evaluate(store, collection, order, seed, tokenizer,
                                                work / f"{collection}-{order}-{seed}"))  # fmt: skip
                print(f"   held-out perplexity, {collection} order read {order}, seed {seed}: {runs[-1]:.1f}",
                      flush=True)  # fmt: skip
            ppl[collection, order] = float(np.exp(np.mean(np.log(runs))))
    embedded.stop(work / "db")
    where = (f"{len(train)} documents stored module by module, {len(held)} held out; {STEPS} steps of "
             f"16 x 128; geometric mean of seeds {', '.join(map(str, SEEDS))}")  # fmt: skip
    ours = ppl["arrival", "spread"] / ppl["permuted", "spread"]
    before = ppl["arrival", "ranges"] / ppl["permuted", "ranges"]
    return [
        Metric("shuffle: held-out ppl, arrival ÷ permuted corpus (spread)", ppl["arrival", "spread"],
               ppl["permuted", "spread"], "ppl", "<= 1.03", ours <= 1.03, where),
        Metric("shuffle: held-out ppl, arrival ÷ permuted corpus (ranges, before)", ppl["arrival", "ranges"],
               ppl["permuted", "ranges"], "ppl", "info", True, f"ratio {before:.2f}; seed {SEEDS[0]}"),
        Metric("shuffle: held-out ppl on the arrival corpus, spread ÷ ranges", ppl["arrival", "spread"],
               ppl["arrival", "ranges"], "ppl", "< 1", ppl["arrival", "spread"] < ppl["arrival", "ranges"],
               where),
    ]  # fmt: skip


def shuffle(texts: list[str], results: Path) -> list[Metric]:
    from dsgpt2.data.split import DEFAULT_CHUNK_DOCS

    tokens_per_doc = 0.3 * np.mean([len(t) for t in texts])  # about 3.3 characters a token on this text
    docs_per_step = max(1, round(16 * 128 / tokens_per_doc))
    table = ChunkTable.initial(["stdlib"], [len(texts)], DEFAULT_CHUNK_DOCS)
    return spread_metrics(table, docs_per_step) + perplexity_metrics(texts, results)
