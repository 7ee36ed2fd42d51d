"""Start-up against corpus size: launch-to-first-loss time and the MongoDB commands of a launch, a
resume, `info`, `evaluate` and `export`, on a SecantusDB server (the engine of ``local://``, started
by the suite with a password) at two corpus sizes 8x apart (bench/audit.py counts the commands); and,
for reference, a resume with the full corpus check (`--check_corpus`), whose unbounded commands grow
with the corpus. The two corpora are built once and kept in bench/results/startup/ for later runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench import audit
from bench.common import Metric

SIZES = (500, 4000)
REPEATS = 3


def _corpus(base: Path, uri: str, n: int) -> tuple[Path, dict[str, str]]:
    """The ``n``-document sample corpus on the server (ingested unless it already holds it)."""
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import ENV_URI, load_config, redact_uri
    from dsgpt2.db.meta import read_meta

    config = base / f"mongo-{n}.json"
    settings = {"MONGO_CONNECTION_STRING": redact_uri(uri), "MONGO_CONNECTION_DB": f"startup{n}"}
    config.write_text(json.dumps({**settings, "COLLECTIONS": ["stdlib"]}))
    env = {**os.environ, ENV_URI: uri}
    conn = Connection(load_config(config, env=env))
    have = read_meta(conn, ["stdlib"]).get("stdlib", {}).get("count")
    if have != n:
        print(f"   building the {n}-document corpus (once; kept in {base})", flush=True)
        from dsgpt2.corpus.ingest import ingest
        from dsgpt2.corpus.readers import builtin_source

        ingest(conn, "stdlib", [builtin_source("stdlib", n)], batch_size=100)
    conn.close()
    return config, env


def _commands(config: Path, tok: Path, work: Path) -> dict[str, list[str]]:
    run = [
        "--deepspeed_config", "configs/ds_config_cpu.json", "--config_train", str(config),
        "--vocab_dir", str(tok), "--model_select", "tiny", "--context_length", "64", "--chunk_docs", "20",
        "--num_workers", "1", "--eval_interval", "1000", "--wandb", "off", "--ckpt_dir", str(work / "ckpt"),
        "--workspace", str(work / "ws"),
    ]  # fmt: skip
    return {
        "launch": ["train", *run, "--train_iters", "1"],
        "resume": ["train", *run, "--train_iters", "2"],
        "info": ["dsgpt2", "info", "--config", str(config)],
        "evaluate": ["dsgpt2", "evaluate", "--model", str(work / "ckpt"), "--config", str(config),
                     "--no_record", "--max_batches", "2", "--report", str(work / "e.json"), "--no_progress"],
        "export": ["dsgpt2", "export", "--ckpt_dir", str(work / "ckpt"), "--out", str(work / "export")],
        # The check every start ran before: each document examined (counts and aggregations).
        "resume --check_corpus": ["train", *run, "--train_iters", "3", "--check_corpus"],
    }  # fmt: skip


def startup(results: Path) -> list[Metric]:
    import shutil

    from tests.wire_server import WireServer, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"   (no start-up lines: {reason})")
        return []
    base = results / "startup"
    base.mkdir(parents=True, exist_ok=True)
    server = WireServer(base / "corpora-db").start()
    try:
        corpora = {n: _corpus(base, server.uri(), n) for n in SIZES}
        tok = base / "tok"
        if not (tok / "tokenizer.json").is_file():
            config, env = corpora[SIZES[0]]
            vocab = ["vocab", "train", "--from_mongo", "--config", str(config), "--out", str(tok)]
            subprocess.run([sys.executable, "-m", "dsgpt2", *vocab, "--vocab_size", "512", "--no_progress"],
                           env=env, check=True, capture_output=True)  # fmt: skip
        seconds: dict[tuple[str, int], list[float]] = {}
        audits: dict[tuple[str, int], audit.Audit] = {}
        for _ in range(REPEATS):
            for n, (config, env) in corpora.items():
                work = base / f"work-{n}"
                shutil.rmtree(work, ignore_errors=True)
                for name, argv in _commands(config, tok, work).items():
                    done = audit.run(argv, work / f"{name}.jsonl", env=env)
                    seconds.setdefault((name, n), []).append(done.seconds)
                    audits[name, n] = done
    finally:
        server.kill()
    small, large = SIZES
    metrics = []
    for name in _commands(Path(), Path(), Path()):
        at = {n: audits[name, n] for n in SIZES}
        same = [audit.shape(c) for c in at[small].startup()] == [audit.shape(c) for c in at[large].startup()]
        unbounded = [c["name"] for c in at[large].commands if not audit.bounded(c)]
        docs = sum(c["returned"] or 0 for c in at[large].startup() if c["name"] == "find")
        t = {n: statistics.median(seconds[name, n]) for n in SIZES}
        counts = [len(at[n].startup()) for n in (large, small)]
        full = name.endswith("--check_corpus")  # the anchor: how the start grew with the corpus
        metrics.append(Metric(f"start-up {name}: commands at {large} ÷ {small} docs", *counts, "commands",
                              "info" if full else "same, bounded", full or (same and not unbounded),
                              f"{docs} documents read; unbounded: {unbounded or 'none'}"))  # fmt: skip
        metrics.append(Metric(f"start-up {name}: seconds at {large} ÷ {small} docs", t[large], t[small], "s",
                              "info" if full else "<= 1.3", full or t[large] <= 1.3 * t[small],
                              "SecantusDB on this machine, not MongoDB"))  # fmt: skip
    return metrics
