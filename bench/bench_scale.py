"""The embedded database at scale: every command a corpus goes through, on ``local://``, at 2,000, 20,000
and 200,000 documents (``BENCH_SCALE_SIZES`` to choose others).

Synthetic documents of about 1.7 KB (words drawn from a 2,000-word list, 2 % exact copies and 2 %
near copies of earlier documents, so that both dedup passes have work). Each size gets a database
directory of its own; each command runs as a user types it, in a process of its own, timed from
start to exit:

- ``ingest`` (a JSONL file), ``validate``, ``dedup --exact``, ``dedup --near``, ``curate``, ``langid``,
  ``redact``, ``decontaminate`` (against 50 of the documents) and one epoch of the training feed (streaming,
  2 DataLoader workers, no model): seconds per document at 10x the documents ÷ at the size before (target
  ≤ 1.5: close to linear);
- launch to the first training step (``ds_trainer.py --train_iters 1``, tiny preset) and ``info``: seconds
  and MongoDB commands before the first step at the largest size ÷ the smallest (target ≤ 1.3, the same
  commands), which read what indexes and meta_info answer, never the corpus;
- the server's resident memory, sampled while every command runs: its peak at the largest size (target
  ≤ 1.5 GB at 200,000 documents), and over ``BENCH_SCALE_REPEATS`` (10) identical ``curate`` passes and as
  many feed epochs at the second size, the last ÷ the first (target ≤ 1.1: flat);
- its files on disk after a checkpoint, per document, and after ``dsgpt2 db compact`` (information).

``BENCH_SCALE_SIZES=1000000`` runs the million (hours on two cores); ``BENCH_SCALE_STAGES`` names the
stages to run, in their order (``ingest,validate,feed``); ``BENCH_SCALE_REPEATS=0`` leaves out the
repeated passes.
``BENCH_SCALE_KEEP=DIR`` keeps the documents, the databases and each stage's time in ``DIR``
(``seconds.json``): run again, it runs only the stages not timed yet, on the databases as the last run
left them, and reports every size timed there, so that the million runs a few stages at a time.

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
import threading
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
    "langid": ["langid"],
    "redact": ["redact"],
    "decontaminate": ["decontaminate", "--name", "planted"],
    "feed": [],  # one epoch of streaming reads: _feed_epoch
}
REPEATS = int(os.environ.get("BENCH_SCALE_REPEATS", "10"))
# BENCH_SCALE_STAGES=ingest,validate,feed: only these, in that order (ingest always runs, first); launch
# and info always do.
STAGES = [s for s in os.environ.get("BENCH_SCALE_STAGES", ",".join(PASSES)).split(",") if s in PASSES]
STAGES = ["ingest", *(s for s in dict.fromkeys(STAGES) if s != "ingest")]
KEEP = os.environ.get("BENCH_SCALE_KEEP")
PEAK_TARGET = 1.5e9  # bytes of server memory at 200,000 documents
WORDS_PER_DOC = 280  # about 1.7 KB


def _documents(n: int, path: Path) -> None:
    if path.exists():  # kept from an earlier run (written under another name, then renamed)
        return
    partial = path.with_suffix(".partial")
    _write_documents(n, partial)
    partial.rename(path)


def _write_documents(n: int, path: Path) -> None:
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


class _Sampler:
    """The embedded server's resident memory, read every 0.2 s in a thread while a command runs."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.peak, self._stop = directory, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from dsgpt2.db import embedded, processes

        while not self._stop.wait(0.2):
            state = embedded.running(self.directory)
            if state is not None:
                self.peak = max(self.peak, processes.rss_bytes(state.pid) or 0)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rss(directory: Path) -> int:
    from dsgpt2.db import embedded, processes

    state = embedded.running(directory)
    return (processes.rss_bytes(state.pid) or 0) if state else 0


def _feed_epoch(config: Path, tokenizer: Path, epochs: int = 1) -> None:
    """Read ``epochs`` epochs of the training split as the trainer's feed does (streaming, 2 DataLoader
    workers, micro-batches of 32 × 256 tokens), no model; after each epoch a line: the server's memory."""
    from dsgpt2.data.dealing import ChunkOrders
    from dsgpt2.data.loader import BlockStream
    from dsgpt2.data.sources import StreamingChunks, make_spec
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.db import embedded
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import load_config
    from dsgpt2.db.wrapper import MongoWrapper

    config, tokenizer = Path(config), Path(tokenizer)
    mongo = load_config(config)
    counts = list(MongoWrapper(mongo, connection=Connection(mongo)).counts)
    spec = make_spec(tokenizer, context=256, chunk_docs=250, tr_ratio=0.99, seed=0)
    table = ChunkTable.initial(mongo.collections, counts, spec.chunk_docs)
    source = StreamingChunks(mongo, table, tokenizer, spec, "train")
    stream = BlockStream(
        source, ChunkOrders(table, [(0,)], seed=0), rank=0, world=1, micro_batch=32, workers=2
    )
    directory = embedded.local_dir(mongo.uri)
    epoch = 0
    try:
        for batch in stream:
            if batch.block_ids[-1][0] != epoch:
                print(f"epoch {epoch} server {_rss(directory)}", flush=True)
                epoch = batch.block_ids[-1][0]
                if epoch == epochs:
                    break
    finally:
        stream.close()


def _run(argv: list[str]) -> float:
    return _run_out(argv)[0]


def _run_out(argv: list[str]) -> tuple[float, str]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=6 * 3600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {(done.stdout + done.stderr)[-2000:]}")
    return time.monotonic() - start, done.stdout


def _stage(name: str, config: Path, data: Path, against: Path, tok: Path) -> list[str]:
    """The command line of one stage."""
    if name == "feed":
        code = f"from bench.bench_scale import _feed_epoch; _feed_epoch({str(config)!r}, {str(tok)!r})"
        return ["-c", code]
    extra = {"ingest": [str(data)], "decontaminate": ["--against", str(against)]}.get(name, [])
    quiet = [] if name == "validate" else ["--no_progress"]
    return ["-m", "dsgpt2", *PASSES[name], "--config", str(config), *extra, *quiet]


def _against(data: Path, path: Path) -> None:
    """50 of the documents as an evaluation set: the documents holding one of them are contaminated."""
    lines = data.read_text(encoding="utf-8").splitlines()
    path.write_text("".join(lines[i] + "\n" for i in range(0, len(lines), max(1, len(lines) // 50))))


def _repeats(config: Path, directory: Path, tok: Path) -> dict[str, list[int]]:
    """The server's memory after each of ``REPEATS`` identical passes (``curate`` rewriting every mark:
    its settings alternate) and after each of as many feed epochs."""
    passes = []
    for k in range(REPEATS):
        _run(["-m", "dsgpt2", "curate", "--config", str(config), "--no_progress",
              "--threshold", f"min_words={40 + k % 2}"])  # fmt: skip
        passes.append(_rss(directory))
    code = f"from bench.bench_scale import _feed_epoch; _feed_epoch({str(config)!r}, {str(tok)!r}, {REPEATS})"
    out = _run_out(["-c", code])[1]
    epochs = [int(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch ")]
    return {"passes": passes, "epochs": epochs}


def _vocabulary(config: Path, tok: Path) -> None:
    """The small vocabulary the feed and the launches read, trained once from the first corpus."""
    if not (tok / "tokenizer.json").exists():
        _run(["-m", "dsgpt2", "vocab", "train", "--from_mongo", "--config", str(config),
              "--out", str(tok), "--vocab_size", "512", "--no_progress"])  # fmt: skip


def _launches(config: Path, tok: Path, runs: Path) -> list[audit.Audit]:
    """Launch to the first step, three times (a few seconds of imports and DeepSpeed: the median)."""
    out = []
    for repeat in range(3):
        run = runs / str(repeat)
        out.append(audit.run(
            ["train", "--deepspeed_config", "configs/ds_config_cpu.json", "--config_train", str(config),
             "--vocab_dir", str(tok), "--model_select", "tiny", "--context_length", "64",
             "--chunk_docs", "20", "--num_workers", "1", "--eval_interval", "1000", "--wandb", "off",
             "--train_iters", "1", "--ckpt_dir", str(run / "ckpt"), "--workspace", str(run / "ws")],
            run / "audit.jsonl",
        ))  # fmt: skip
    return out


class _Record:
    """Each stage's seconds and each size's memory peak, kept in ``seconds.json`` of a kept directory."""

    def __init__(self, work: Path | None) -> None:
        self.path = None if work is None else work / "seconds.json"
        kept = json.loads(self.path.read_text()) if self.path and self.path.exists() else {}
        self.seconds = {
            (k.rsplit("@", 1)[0], int(k.rsplit("@", 1)[1])): v for k, v in kept.get("seconds", {}).items()
        }
        self.peaks = {int(n): v for n, v in kept.get("peaks", {}).items()}

    def save(self) -> None:
        if self.path is not None:
            seconds = {f"{name}@{n}": v for (name, n), v in self.seconds.items()}
            peaks = {str(n): v for n, v in self.peaks.items()}
            self.path.write_text(json.dumps({"seconds": seconds, "peaks": peaks}, indent=1))


def scale(results: Path) -> list[Metric]:
    from dsgpt2.db import embedded

    if KEEP:
        work = Path(KEEP).resolve()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="dsgpt2-scale-", dir=results if results.exists() else None))
    record = _Record(work if KEEP else None)
    seconds, peaks = record.seconds, record.peaks
    launches: dict[int, list[audit.Audit]] = {}
    server: dict[int, tuple[int, int, int]] = {}  # RSS, disk after a checkpoint, disk after compact
    repeated: dict[str, list[int]] = {}
    tok = work / "tok"
    try:
        for n in SIZES:
            data, against = work / f"docs-{n}.jsonl", work / f"against-{n}.jsonl"
            _documents(n, data)
            _against(data, against)
            config = work / f"c-{n}.json"
            directory = work / f"db-{n}"
            uri = f"local://{directory}"
            config.write_text(json.dumps({"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "scale",
                                          "COLLECTIONS": ["docs"]}))  # fmt: skip
            with _Sampler(directory) as sampler:
                for name in STAGES:
                    if (name, n) in seconds:
                        print(f"   {n:>7} documents: {name} {seconds[name, n]:.1f} s (kept)", flush=True)
                        continue
                    if name == "feed":
                        _vocabulary(config, tok)
                    seconds[name, n] = _run(_stage(name, config, data, against, tok))
                    peaks[n] = max(peaks.get(n, 0), sampler.peak)
                    record.save()
                    mb = _rss(directory) / 1e6
                    print(f"   {n:>7} documents: {name} {seconds[name, n]:.1f} s, server {mb:.0f} MB "
                          f"(peak {sampler.peak / 1e6:.0f})", flush=True)  # fmt: skip
                _vocabulary(config, tok)  # launch needs one, whatever stages ran
                launches[n] = _launches(config, tok, work / f"run-{n}")
                seconds["info", n] = statistics.median(
                    _run(["-m", "dsgpt2", "info", "--config", str(config)]) for _ in range(3)
                )
                print(f"   {n:>7} documents: launch to the first step "
                      f"{[round(a.seconds, 2) for a in launches[n]]} s, info {seconds['info', n]:.2f} s "
                      "(median of 3)", flush=True)  # fmt: skip
                if n == SIZES[min(1, len(SIZES) - 1)] and REPEATS > 1:
                    repeated = _repeats(config, directory, tok)
                    print(f"   {n:>7} documents: server MB after each curate pass "
                          f"{[round(r / 1e6) for r in repeated['passes']]}, after each feed epoch "
                          f"{[round(r / 1e6) for r in repeated['epochs']]}", flush=True)  # fmt: skip
            peaks[n] = max(peaks.get(n, 0), sampler.peak)
            record.save()
            busy = embedded.disk_bytes(directory)
            # WiredTiger drops its log files at a checkpoint (the server takes one a minute): the disk a
            # database keeps is measured after one, forced here with `fsync`.
            checkpoint = "from dsgpt2.db.config import load_config\nfrom dsgpt2.db.client import connect\n"
            _run(["-c", f"{checkpoint}connect(load_config({str(config)!r})).client.admin.command('fsync')"])
            rss, disk = _rss(directory), embedded.disk_bytes(directory)
            compacting = _run(["-m", "dsgpt2", "db", "compact", f"local://{directory}"])
            server[n] = (rss, disk, embedded.disk_bytes(directory))
            print(f"   {n:>7} documents: server {rss / 1e6:.0f} MB resident (peak {peaks[n] / 1e6:.0f}), "
                  f"{disk / 1e6:.0f} MB on disk after a checkpoint ({busy / 1e6:.0f} MB before), "
                  f"{server[n][2] / 1e6:.0f} MB after `db compact` ({compacting:.1f} s)",
                  flush=True)  # fmt: skip
            embedded.stop(directory)
            if not KEEP:
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        for n in SIZES:
            embedded.stop(work / f"db-{n}")
        if not KEEP:
            shutil.rmtree(work, ignore_errors=True)
    return _metrics(seconds, launches, server, peaks, repeated)


def _metrics(
    seconds: dict[tuple[str, int], float],
    launches: dict[int, audit.Audit],
    server: dict[int, tuple[int, int, int]],
    peaks: dict[int, int],
    repeated: dict[str, list[int]],
) -> list[Metric]:
    metrics = []
    for name in STAGES:
        timed = sorted(n for stage, n in seconds if stage == name)  # this run's sizes and those kept
        for small, large in itertools.pairwise(timed):
            per_large, per_small = seconds[name, large] / large, seconds[name, small] / small
            note = f"{seconds[name, large]:.1f} s and {seconds[name, small]:.1f} s; local://"
            metrics.append(Metric(f"scale {name}: s/doc at {large} ÷ {small}", per_large, per_small, "s/doc",
                                  "<= 1.5", per_large <= 1.5 * per_small, note))  # fmt: skip
    small, large = SIZES[0], SIZES[-1]
    if small == large:  # one size: its memory and disk, nothing to compare start-up with
        return [*metrics, *_server_metrics(large, large, server, peaks, repeated)]
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
    return [*metrics, *_server_metrics(small, large, server, peaks, repeated)]


def _server_metrics(
    small: int,
    large: int,
    server: dict[int, tuple[int, int, int]],
    peaks: dict[int, int],
    repeated: dict[str, list[int]],
) -> list[Metric]:
    metrics = []
    (_, disk, compacted), (_, disk_small, compacted_small) = server[large], server[small]
    at_200k = large >= 200_000
    metrics.append(Metric(f"scale server memory peak at {large}", peaks[large], peaks[small], "B",
                          f"<= {PEAK_TARGET / 1e9:.1f} GB" if at_200k else "info",
                          peaks[large] <= PEAK_TARGET or not at_200k,
                          f"{peaks[large] / 1e6:.0f} MB; sampled while every command ran"))  # fmt: skip
    for what, values in repeated.items():
        metrics.append(Metric(f"scale server memory over {len(values)} {what}: last ÷ first", values[-1],
                              values[0], "B", "<= 1.1", values[-1] <= 1.1 * values[0],
                              f"MB: {[round(v / 1e6) for v in values]}"))  # fmt: skip
    metrics.append(Metric(f"scale disk per document at {large}", disk / large, disk_small / small, "B/doc",
                          "info", True, f"{disk / 1e6:.0f} MB after a checkpoint"))  # fmt: skip
    metrics.append(Metric(f"scale disk per document at {large} after db compact", compacted / large,
                          compacted_small / small, "B/doc", "info", True,
                          f"{compacted / 1e6:.0f} MB; {disk / 1e6:.0f} MB before"))  # fmt: skip
    return metrics
