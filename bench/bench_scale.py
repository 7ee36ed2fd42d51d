"""The embedded database at scale: every command a corpus goes through, on ``local://``, at 2,000, 20,000
and 200,000 documents (``BENCH_SCALE_SIZES`` to choose others).

Synthetic documents of about 1.7 KB (words drawn from a 2,000-word list, 2 % exact copies and 2 %
near copies of earlier documents, so that both dedup passes have work). Each size gets a database
directory of its own; each command runs as a user types it, in a process of its own, timed from
start to exit:

- ``ingest`` (a JSONL file), ``validate``, ``dedup --exact``, ``dedup --near``, ``curate``: seconds per
  document at 10x the documents ÷ at the size before (target ≤ 1.5: close to linear);
- launch to the first training step (``ds_trainer.py --train_iters 1``, tiny preset) and ``info``: seconds
  and MongoDB commands before the first step at the largest size ÷ the smallest (target ≤ 1.3, the same
  commands), which read what indexes and meta_info answer, never the corpus;
- the server's resident memory and its files on disk after the passes, per document (information; the
  README extrapolates them to 10⁸ documents).

A server on this machine is not a MongoDB deployment: the figures are ratios and growth, not MongoDB's.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import audit
from bench.common import Metric

ROOT = Path(__file__).resolve().parents[1]
SIZES = tuple(int(n) for n in os.environ.get("BENCH_SCALE_SIZES", "2000,20000,200000").split(","))
PASSES = {
    "ingest": ["ingest", "--collection", "docs", "--batch_size", "1000"],
    "validate": ["validate"],
    "dedup --exact": ["dedup", "--exact"],
    "dedup --near": ["dedup", "--near"],
    "curate": ["curate"],
}
WORDS_PER_DOC = 280  # about 1.7 KB


def _documents(n: int, path: Path) -> None:
    rng = random.Random(n)
    vocabulary = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(2000)
    ]
    weights = [1 / (rank + 1) for rank in range(len(vocabulary))]  # a Zipf-like spread, as in text
    texts: list[str] = []
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            draw = rng.random()
            if i > 10 and draw < 0.02:
                text = texts[rng.randrange(len(texts))]
            elif i > 10 and draw < 0.04:
                words = texts[rng.randrange(len(texts))].split(" ")
                words[rng.randrange(len(words))] = "changed"
                text = " ".join(words)
            else:
                words = rng.choices(vocabulary, weights, k=WORDS_PER_DOC)
                # Sentences, so that C4's line rules see prose.
                text = " ".join(w + ("." if k % 14 == 13 else "") for k, w in enumerate(words))
            if len(texts) < 5000:
                texts.append(text)
            f.write(json.dumps({"text": text}) + "\n")


def _run(argv: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {(done.stdout + done.stderr)[-2000:]}")
    return time.monotonic() - start


def scale(results: Path) -> list[Metric]:
    from dsgpt2.db import embedded

    work = Path(tempfile.mkdtemp(prefix="dsgpt2-scale-", dir=results if results.exists() else None))
    seconds: dict[tuple[str, int], float] = {}
    launches: dict[int, list[audit.Audit]] = {}
    server: dict[int, tuple[int, int]] = {}
    tok = work / "tok"
    try:
        for n in SIZES:
            data = work / f"docs-{n}.jsonl"
            _documents(n, data)
            config = work / f"c-{n}.json"
            uri = f"local://{work / f'db-{n}'}"
            config.write_text(json.dumps({"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "scale",
                                          "COLLECTIONS": ["docs"]}))  # fmt: skip
            for name, argv in PASSES.items():
                extra = [str(data)] if name == "ingest" else []
                seconds[name, n] = _run(["-m", "dsgpt2", *argv, "--config", str(config), *extra,
                                         *(["--no_progress"] if name != "validate" else [])])  # fmt: skip
                print(f"   {n:>7} documents: {name} {seconds[name, n]:.1f} s", flush=True)
            if not (tok / "tokenizer.json").exists():
                _run(["-m", "dsgpt2", "vocab", "train", "--from_mongo", "--config", str(config),
                      "--out", str(tok), "--vocab_size", "512", "--no_progress"])  # fmt: skip
            launches[n] = []
            for repeat in range(3):  # a launch is a few seconds of imports and DeepSpeed: the median of 3
                run = work / f"run-{n}-{repeat}"
                launches[n].append(audit.run(
                    ["train", "--deepspeed_config", "configs/ds_config_cpu.json",
                     "--config_train", str(config), "--vocab_dir", str(tok), "--model_select", "tiny",
                     "--context_length", "64",
                     "--chunk_docs", "20", "--num_workers", "1", "--eval_interval", "1000", "--wandb", "off",
                     "--train_iters", "1", "--ckpt_dir", str(run / "ckpt"), "--workspace", str(run / "ws")],
                    run / "audit.jsonl",
                ))  # fmt: skip
            seconds["info", n] = statistics.median(
                _run(["-m", "dsgpt2", "info", "--config", str(config)]) for _ in range(3)
            )
            directory = work / f"db-{n}"
            state = embedded.running(directory)
            rss = (embedded.rss_bytes(state.pid) or 0) if state else 0
            busy = embedded.disk_bytes(directory)
            # WiredTiger drops its log files at a checkpoint (the server takes one a minute): the disk a
            # database keeps is measured after one, forced here with `fsync`.
            checkpoint = "from dsgpt2.db.config import load_config\nfrom dsgpt2.db.client import connect\n"
            _run(["-c", f"{checkpoint}connect(load_config({str(config)!r})).client.admin.command('fsync')"])
            server[n] = (rss, embedded.disk_bytes(directory))
            print(f"   {n:>7} documents: server {rss / 1e6:.0f} MB resident, {server[n][1] / 1e6:.0f} MB "
                  f"on disk after a checkpoint ({busy / 1e6:.0f} MB before it)", flush=True)  # fmt: skip
            embedded.stop(directory)
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        for n in SIZES:
            embedded.stop(work / f"db-{n}")
        shutil.rmtree(work, ignore_errors=True)
    return _metrics(seconds, launches, server)


def _metrics(
    seconds: dict[tuple[str, int], float],
    launches: dict[int, audit.Audit],
    server: dict[int, tuple[int, int]],
) -> list[Metric]:
    metrics = []
    for name in PASSES:
        for small, large in itertools.pairwise(SIZES):
            per_large, per_small = seconds[name, large] / large, seconds[name, small] / small
            note = f"{seconds[name, large]:.1f} s and {seconds[name, small]:.1f} s; local://"
            metrics.append(Metric(f"scale {name}: s/doc at {large} ÷ {small}", per_large, per_small, "s/doc",
                                  "<= 1.5", per_large <= 1.5 * per_small, note))  # fmt: skip
    small, large = SIZES[0], SIZES[-1]
    at = {n: launches[n][0] for n in (small, large)}
    same = [audit.shape(c) for c in at[small].startup()] == [audit.shape(c) for c in at[large].startup()]
    counts = [len(at[n].startup()) for n in (large, small)]
    metrics.append(Metric(f"scale launch: commands at {large} ÷ {small}", *counts, "commands", "same", same,
                          "MongoDB commands before the first step"))  # fmt: skip
    t = {n: statistics.median(a.seconds for a in launches[n]) for n in (small, large)}
    metrics.append(Metric(f"scale launch to first step: s at {large} ÷ {small}", t[large], t[small], "s",
                          "<= 1.3", t[large] <= 1.3 * t[small], "ds_trainer.py; median of 3"))  # fmt: skip
    info = seconds["info", large], seconds["info", small]
    metrics.append(Metric(f"scale info: s at {large} ÷ {small}", *info, "s", "<= 1.3",
                          info[0] <= 1.3 * info[1], "median of 3"))  # fmt: skip
    (rss, disk), (rss_small, disk_small) = server[large], server[small]
    metrics.append(
        Metric(
            f"scale server memory per document at {large}",
            rss / large,
            rss_small / small,
            "B/doc",
            "info",
            True,
            f"{rss / 1e6:.0f} MB resident after the passes",
        )
    )
    metrics.append(Metric(f"scale disk per document at {large}", disk / large, disk_small / small, "B/doc",
                          "info", True, f"{disk / 1e6:.0f} MB after a checkpoint"))  # fmt: skip
    return metrics
