"""Vocabulary training and raw tokenization baselines.

- vocab training: MB/s and peak memory of ``dsgpt2 vocab train --from_mongo``
  (texts streamed from the database) ÷ ``ByteLevelBPETokenizer.train_from_iterator``
  on the same texts held in a Python list (targets: speed ≥ 0.9, memory ≤ 1.2).
  Ours reads the embedded database (``local://``, a server process of its own)
  or DSGPT2_BENCH_MONGO_URI's server, end to end.
  Each side runs in a fresh process; memory is the peak RSS sampled during
  the run above the RSS before it (the anchor's before it loads its list).
- tokenize baseline: MB/s of HF ``Tokenizer.encode_batch`` on our vocabulary
  ÷ tiktoken built from the same vocab.json/merges.txt (information for the
  tokenize + pack benchmark; no target of its own).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import Metric

VOCAB_SIZE = 8192
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """Samples this process's RSS every few milliseconds while active."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def child(mode: str, store: str, texts_file: str, out: str) -> dict[str, Any]:
    """One measured run, in a process of its own."""
    import tokenizers  # noqa: F401  (both sides import their libraries before the clock starts)

    if mode == "anchor":
        from tokenizers import ByteLevelBPETokenizer

        before = _rss()
        with PeakRss() as peak:
            with open(texts_file, encoding="utf-8") as f:
                texts = [json.loads(line) for line in f]
            start = time.perf_counter()
            bpe = ByteLevelBPETokenizer()
            bpe.train_from_iterator(
                texts,
                vocab_size=VOCAB_SIZE,
                min_frequency=2,
                special_tokens=["<|endoftext|>"],
                show_progress=False,
            )
            seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "bytes": sum(len(t.encode("utf-8")) for t in texts),
            "mem": peak.peak - before,
        }

    from transformers import GPT2TokenizerFast  # noqa: F401  (lazy module: load it before the clock)

    from dsgpt2.db.wrapper import MongoWrapper
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
    from dsgpt2.tokenizer.texts import mongo_texts

    config = _config(store)
    MongoWrapper(config)  # connects: the server's memory is not the trainer's
    before = _rss()

    def timed() -> tuple[float, int]:
        start = time.perf_counter()
        texts_iter, _ = mongo_texts(config)
        report = train_vocab(
            texts_iter,
            Path(out),
            VocabSettings(vocab_size=VOCAB_SIZE),
            "bench",
            progress=False,
            overwrite=True,
        )
        return time.perf_counter() - start, report.bytes

    with PeakRss() as peak:
        seconds, size = timed()
    return {"seconds": seconds, "bytes": size, "mem": peak.peak - before}


def _config(store: str) -> Any:
    from dsgpt2.db.config import config_from_dict

    uri = os.environ.get("DSGPT2_BENCH_MONGO_URI") or f"local://{store}"
    return config_from_dict(
        {"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "dsgpt2_bench_vocab", "COLLECTIONS": ["s"]},
        env={},
    )


def _spawn(mode: str, store: Path, texts_file: Path, out: Path) -> dict[str, Any]:
    args = ", ".join(repr(str(a)) for a in (mode, store, texts_file, out))
    code = f"import json, bench.bench_vocab as b; print(json.dumps(b.child({args})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(texts: list[str], workdir: Path, repeats: int = 3, copies: int = 3) -> list[Metric]:
    """Both sides train on ``copies`` copies of ``texts``: long enough that start-up costs fade."""
    from dsgpt2.db.client import Connection

    texts = texts * copies
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "vocab_bench_db"
    config = _config(str(store))
    conn = Connection(config)
    conn.client.drop_database(config.db)
    conn.db["s"].create_index("idx", unique=True)
    conn.db["s"].insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
    conn.db["meta_info"].insert_one({"collection": "s", "count": len(texts)})
    texts_file = workdir / "vocab_bench_texts.jsonl"
    with open(texts_file, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")

    anchor, e2e = [], []
    for _ in range(repeats):
        e2e.append(_spawn("ours-end-to-end", store, texts_file, workdir / "vocab_bench_tok"))
        anchor.append(_spawn("anchor", store, texts_file, workdir / "vocab_bench_tok"))
    conn.client.drop_database(config.db)
    if config.is_local:
        from dsgpt2.db import embedded

        embedded.stop(embedded.local_dir(config.uri))
    mb = e2e[0]["bytes"] / 1e6
    end_to_end = statistics.median(mb / r["seconds"] for r in e2e)
    base = statistics.median(r["bytes"] / 1e6 / r["seconds"] for r in anchor)
    mem_ours = statistics.median(r["mem"] for r in e2e) / 1e6
    mem_anchor = statistics.median(r["mem"] for r in anchor) / 1e6
    metrics = [
        Metric("vocab training speed", end_to_end, base, "MB/s", ">= 0.9", end_to_end / base >= 0.9,
               f"{'local://' if config.is_local else 'server'}, end to end"),
    ]  # fmt: skip
    metrics.append(
        Metric(
            "vocab training memory",
            mem_ours,
            mem_anchor,
            "MB",
            "<= 1.2",
            mem_ours / mem_anchor <= 1.2,
            "peak RSS above the start of training",
        )
    )
    metrics.append(_tokenize_baseline(texts, workdir / "vocab_bench_tok"))
    return metrics


def _tokenize_baseline(texts: list[str], directory: Path, repeats: int = 5) -> Metric:
    from tokenizers import Tokenizer

    from bench.common import paired_times
    from bench.tiktoken_vocab import encoding_from_vocab

    hf = Tokenizer.from_file(str(directory / "tokenizer.json"))
    enc = encoding_from_vocab(directory)
    size = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    t_hf, t_tk = paired_times(
        lambda: hf.encode_batch(texts, add_special_tokens=False),
        lambda: enc.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1),
        repeats,
    )
    return Metric("tokenize baseline (HF ÷ tiktoken)", size / t_hf, size / t_tk, "MB/s", "baseline", True,
                  "raw encode_batch vs tiktoken on our vocab; packing is measured against HF")  # fmt: skip
