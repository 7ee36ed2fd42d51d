"""What a launch, a resume, `info`, `evaluate` and `export` ask MongoDB before their work, counted
with pymongo's command monitoring (bench/audit.py) at two corpus sizes 5x apart on a real server:
the same commands, each bounded by the idx index or by meta_info, never a scan of the collection.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import audit
from corpora import Corpus
from zygote import run_python

pytestmark = [pytest.mark.mongo_live, pytest.mark.slow]
SIZES = (200, 1000)
# What a run's start asks, in order: the marks (meta_info), the quick check (the collection's
# metadata count, its indexes, the two ends of the idx index), the marks again (the wrapper's),
# the trained-prefix sample (18 documents by idx), the run's note in meta_info (read, then written: a
# run that starts keeps the step its checkpoint directory reached).
# The test servers are the embedded engine, which keeps no count (a count walks every record): meta_info's
# count stands for it. On mongod a ("count", "stdlib") of its metadata follows the first find.
RUN_START = [
    ("find", "meta_info"),
    ("listIndexes", "stdlib"),
    # The idx index's two ends: a null or missing idx, the lowest number; a boolean, a string, the
    # highest number: each read bounded by the index.
    *[("find", "stdlib")] * 5,
    ("find", "meta_info"),
    ("find", "stdlib"),
    ("find", "meta_info"),
    ("update", "meta_info"),
]


def _audits(corpus: Corpus, tok: Path, work: Path, full_check: bool) -> dict[str, audit.Audit]:
    env = {**__import__("os").environ, **corpus.env}
    run = [
        "--deepspeed_config", "configs/ds_config_cpu.json", "--config_train", str(corpus.config),
        "--vocab_dir", str(tok), "--model_select", "tiny", "--context_length", "64", "--chunk_docs", "20",
        "--num_workers", "1", "--eval_interval", "1000", "--wandb", "off",
        "--ckpt_dir", str(work / "ckpt"), "--workspace", str(work / "ws"),
    ]  # fmt: skip
    commands = {
        "launch": ["train", *run, "--train_iters", "1"],
        "resume": ["train", *run, "--train_iters", "2"],
        "info": ["dsgpt2", "info", "--config", str(corpus.config)],
        "evaluate": ["dsgpt2", "evaluate", "--model", str(work / "ckpt"), "--config", str(corpus.config),
                     "--max_batches", "2", "--report", str(work / "eval.json"), "--no_progress"],
        "export": ["dsgpt2", "export", "--ckpt_dir", str(work / "ckpt"), "--out", str(work / "export")],
    }  # fmt: skip
    if full_check:
        commands["launch, full check"] = ["train", *run, "--train_iters", "3", "--check_corpus"]
    return {
        name: audit.run(argv, work / f"{name}.jsonl", env=env, runner=run_python)
        for name, argv in commands.items()
    }


def test_startup_asks_the_same_bounded_commands_at_two_corpus_sizes(
    server_uri: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    corpora = {n: Corpus(server_uri, tmp_path_factory.mktemp(f"docs{n}")) for n in SIZES}
    for n, corpus in corpora.items():
        ingested = corpus.cli("ingest", "--config", str(corpus.config), "--sample", "stdlib",
                              "--limit", str(n), "--batch_size", "500", "--no_progress")  # fmt: skip
        assert ingested.returncode == 0, ingested.stderr
    small = corpora[SIZES[0]]
    tok = small.base / "tok"
    trained = small.cli("vocab", "train", "--from_mongo", "--config", str(small.config), "--out", str(tok),
                        "--vocab_size", "512", "--no_progress")  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    audits = {n: _audits(c, tok, c.base / "work", full_check=n == SIZES[1]) for n, c in corpora.items()}

    for name, at_small in audits[SIZES[0]].items():
        at_large = audits[SIZES[1]][name]
        shapes = [[audit.shape(c) for c in a.startup()] for a in (at_small, at_large)]
        assert shapes[0] == shapes[1], name
        unbounded = [c for c in at_large.commands if not audit.bounded(c)]
        assert not unbounded, (name, unbounded)
        assert all(c["returned"] <= 20 for c in at_large.startup() if c["name"] == "find"), name
    listed = audits[SIZES[1]]
    assert [(c["name"], c["collection"]) for c in listed["launch"].startup()] == RUN_START
    # A resume checks the trained prefix's sample first (18 documents by idx): the same again.
    resume = [(c["name"], c["collection"]) for c in listed["resume"].startup()]
    assert resume == [*RUN_START[:-3], ("find", "stdlib"), *RUN_START[-3:]]
    assert [(c["name"], c["collection"]) for c in listed["info"].startup()] == [
        ("listCollections", None), ("find", "meta_info"), ("find", "meta_info"),
        ("find", "checkpoints.files"),  # the runs whose checkpoints are in the database
        ("find", "tokenizers.files"),  # and the tokenizers
    ]  # fmt: skip
    assert not listed["export"].commands
    # Asked for, the full check examines every document: counts and aggregations over the collection,
    # or (the embedded engine) reads of it in windows of idx from 0.
    full = listed["launch, full check"].startup()

    def whole(c: dict) -> bool:
        window = (c["filter"] or {}).get("idx")
        return not audit.bounded(c) or (
            isinstance(window, dict) and window.get("$gte") == 0 and "$lt" in window
        )

    assert any(whole(c) for c in full), [(c["name"], c["filter"]) for c in full]
