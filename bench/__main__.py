"""``make bench``: run every benchmark, print one line per metric, write bench/results/latest.json."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from bench import bench_fetch, bench_vocab
from bench.common import write_results
from dsgpt2.cleaning import clean_text
from dsgpt2.sample import stdlib_documents


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    texts = [clean_text(t) for t in stdlib_documents()]
    print(f"corpus: {len(texts)} sample documents, {sum(map(len, texts)) / 1e6:.1f} M characters")
    results = Path(__file__).parent / "results"
    metrics = []
    for name, bench in (
        ("fetch", lambda: bench_fetch.run(texts)),
        ("vocab", lambda: bench_vocab.run(texts, results)),
    ):
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
