"""``make bench``: run every benchmark, print one line per metric, write bench/results/latest.json."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from bench import (
    bench_ckpt,
    bench_decont,
    bench_feed,
    bench_fetch,
    bench_generate,
    bench_gpu,
    bench_host,
    bench_ingest,
    bench_langid,
    bench_neardup,
    bench_pii,
    bench_reads,
    bench_recipe,
    bench_scale,
    bench_serve,
    bench_shuffle,
    bench_startup,
    bench_train,
    bench_vocab,
)
from bench.common import database_uri, write_results
from dsgpt2.corpus.builtin import stdlib_documents
from dsgpt2.corpus.cleaning import clean_text


def _train_data(texts: list[str], results: Path) -> list:
    """Tokenize + pack, cached loader, data stall, memory: on the vocabulary of the vocab benchmark."""
    from dsgpt2.data.cache import prepare_cache
    from dsgpt2.data.sources import make_spec
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict

    tokenizer = results / "vocab_bench_tok"
    if not (tokenizer / "tokenizer.json").exists():
        bench_vocab.run(texts, results, repeats=1)
    metrics = bench_train.tokenize_pack(texts, tokenizer)
    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": database_uri(),
            "MONGO_CONNECTION_DB": "bench_cache",
            "COLLECTIONS": ["s"],
        },
        env={},
    )
    conn = Connection(config)
    conn.db["s"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    conn.db["meta_info"].insert_one({"collection": "s", "count": len(texts)})
    spec = make_spec(tokenizer, context=128, chunk_docs=1000, tr_ratio=0.99, seed=0)
    table = ChunkTable.initial(config.collections, [len(texts)], spec.chunk_docs)
    prepare_cache(config, tokenizer, spec, results / "cache", workers=2, force=True, table=table)
    metrics.append(bench_train.cached_loader(results / "cache", table, context=128))
    metrics.append(bench_train.data_stall(texts, tokenizer))
    metrics.append(bench_train.index_memory())
    return metrics


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    texts = [clean_text(t) for t in stdlib_documents()]
    print(f"corpus: {len(texts)} sample documents, {sum(map(len, texts)) / 1e6:.1f} M characters")
    results = Path(__file__).parent / "results"
    suites = {
        "fetch": lambda: bench_fetch.run(texts),
        "ingest": lambda: bench_ingest.ingest_bench(texts, results),
        "vocab": lambda: bench_vocab.run(texts, results),
        "train_data": lambda: _train_data(texts, results),
        "feed": lambda: bench_feed.feed(texts, results),
        "deepspeed": bench_train.deepspeed_overhead,
        "generate": lambda: bench_generate.generation_speed(texts, results),
        "serve": lambda: bench_serve.serving(texts, results),
        "train_gpu": lambda: bench_gpu.train_gpu(texts, results),
        "host": lambda: bench_host.host(texts, results),
        "ckpt": lambda: bench_ckpt.ckpt(results),
        "startup": lambda: bench_startup.startup(results),
        "neardup": lambda: bench_neardup.neardup(texts),
        "decont": lambda: bench_decont.decont(texts),
        "langid": bench_langid.langid,
        "pii": bench_pii.pii,
        "shuffle": lambda: bench_shuffle.shuffle(texts, results),
        "reads": lambda: bench_reads.read_cost(texts),
        "scale": lambda: bench_scale.scale(results),
        "recipe": lambda: bench_recipe.recipe(texts, results),
    }
    chosen = sys.argv[1:] or list(suites)
    unknown = set(chosen) - set(suites)
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; choose from {list(suites)}", file=sys.stderr)
        return 2
    metrics = []
    for name in chosen:
        bench = suites[name]
        print(f"-- {name}", flush=True)
        for m in bench():
            print(m.line(), flush=True)
            metrics.append(m)
    out = results / "latest.json"
    write_results(metrics, out)
    print(f"written to {out}")
    return 0 if all(m.passed for m in metrics) else 1


if __name__ == "__main__":
    sys.exit(main())
