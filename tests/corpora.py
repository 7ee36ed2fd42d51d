"""Planted corpora that tests of several rooms share, with their reference results: exact copies
(dedup), near copies (neardup), FILTER's planted marks, good and bad prose (quality), HellaSwag examples;
and the sample corpus on a real server (the live-server tests)."""

from __future__ import annotations

import json
import random
import subprocess
import uuid
from itertools import islice
from pathlib import Path
from typing import Any

from bench.bench_neardup import planted_corpus, vocabulary
from conftest import ROOT, run_cli, store_config
from dsgpt2.corpus.builtin import stdlib_documents
from dsgpt2.db.client import Connection
from dsgpt2.db.config import ENV_URI, MongoConfig, load_config, redact_uri
from zygote import run_python

# --- exact copies: `dedup --exact` ----------------------------------------------------------------


def planted(seed: int, n: int, pool: int) -> list[str]:
    """``n`` texts drawn from ``pool`` distinct ones: copies wherever a draw repeats."""
    rng = random.Random(seed)
    return [f"Document {rng.randrange(pool)}: the {rng.choice(['cat', 'dog'])} sat." for _ in range(n)]


def reference(collections: dict[str, list[str]]) -> dict[tuple[str, int], str]:
    """Each copy's mark, by the rule: the first copy in (COLLECTIONS order, idx) is kept."""
    first: dict[str, str] = {}
    marks = {}
    for name, texts in collections.items():
        for idx, text in enumerate(texts):
            if text in first:
                marks[(name, idx)] = first[text]
            else:
                first[text] = f"{name}:{idx}"
    return marks


def marks(conn: Connection, names: list[str]) -> dict[tuple[str, int], str]:
    """Each marked copy of ``names`` in the database, and the document it copies."""
    return {(n, d["idx"]): d["dup_of"] for n in names for d in conn.db[n].find({"dup_of": {"$exists": True}})}


def ingest_files(tmp_path: Path, collections: dict[str, list[str]]) -> tuple[Path, Path]:
    """``dsgpt2 ingest`` of each collection's texts from a JSONL file into a database of its own:
    (config path, the path the database is named for)."""
    cfg, store = store_config(tmp_path, list(collections))
    for name, texts in collections.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        done = run_cli("ingest", "--config", str(cfg), "--collection", name, str(path), "--no_progress")
        assert done.returncode == 0, done.stderr
    return cfg, store


# --- near copies: `dedup --near` ------------------------------------------------------------------

_CORPUS: dict[int, tuple[list[str], list[int]]] = {}


def corpus(originals: int = 60, seed: int = 0) -> tuple[list[str], list[int]]:
    """Planted near copies of ``originals`` texts (bench/bench_neardup.py): (texts, each one's family),
    built once per process and seed."""
    if seed not in _CORPUS or len(set(_CORPUS[seed][1])) != originals:
        _CORPUS[seed] = planted_corpus(
            vocabulary(list(islice(stdlib_documents(), 300))), originals=originals, seed=seed
        )
    return _CORPUS[seed]


def near_marks(conn: Connection, names: list[str]) -> dict[str, str]:
    """Each document of ``names`` marked `near_dup_of`, and the one it copies ("name:idx" both)."""
    held = {n: conn.db[n].find({"near_dup_of": {"$exists": True}}) for n in names}
    return {f"{n}:{d['idx']}": d["near_dup_of"] for n, docs in held.items() for d in docs}


def near_copy(rng: random.Random, words: list[str], changes: int = 4) -> str:
    """``words`` with ``changes`` of them replaced, joined: a near copy of their text."""
    copy = list(words)
    for i in rng.sample(range(len(copy)), changes):
        copy[i] = "changed"
    return " ".join(copy)


# --- FILTER: planted marks ------------------------------------------------------------------------

KEEP = {"dup_of": {"$exists": False}, "passes.gopher": {"$ne": False}}


def texts(n: int) -> list[str]:
    """``n`` short distinct documents."""
    return [f"document {i} tells of the {['cat', 'dog', 'owl'][i % 3]} and the sea." for i in range(n)]


def left_out(i: int) -> bool:
    """Planted marks: every 4th a duplicate, every 7th failing gopher."""
    return i % 4 == 1 or i % 7 == 3


def mark(conn: Connection, name: str, n: int) -> None:
    """Plant :func:`left_out`'s marks on the first ``n`` documents of ``name``."""
    for i in range(n):
        if i % 4 == 1:
            conn.db[name].update_one({"idx": i}, {"$set": {"dup_of": f"{name}:0"}})
        if i % 7 == 3:
            conn.db[name].update_one({"idx": i}, {"$set": {"passes": {"gopher": False}}})


# --- quality: good prose and bad texts (`curate`) -------------------------------------------------

PROSE = (
    "The committee met on Tuesday to review the budget for the coming year. Members agreed that the "
    "library should have longer opening hours, and that the funds for the new reading room be moved "
    "forward.\nThe chair noted that the proposal had strong support from residents of the town. A "
    "vote will be held at the next meeting, after the figures have been checked by the treasurer.\n"
    "Several speakers asked whether the plan could be extended to the schools. The committee said it "
    "would consider the idea once the first phase of the work was complete and paid for."
)


BAD = {
    "bullets": "\n".join(f"- item number {i} of the list" for i in range(60)),
    "repeated": "\n".join(["Click here to read more about our offers today."] * 20),
    "lorem": PROSE + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
    "short": "Too short to be a document.",
}


# --- HellaSwag examples ---------------------------------------------------------------------------


def examples(texts: list[str], n: int) -> list[dict]:
    """llm.c's layout: ctx, four endings, label (and the fields it carries beside them)."""
    out = []
    for i in range(n):
        words = " ".join(texts[i].split()[:10]) or "module"
        endings = [" ".join(texts[i + k + 1].split()[: 3 + 2 * k]) or "x" for k in range(4)]
        out.append({"ind": i, "activity_label": "docs", "ctx_a": words, "ctx_b": "", "ctx": words,
                    "endings": endings, "label": i % 4, "split": "val", "split_type": "indomain",
                    "source_id": f"s{i}"})  # fmt: skip
    return out


# --- the sample corpus on a real server -----------------------------------------------------------


def password_of(uri: str) -> str | None:
    """The password in ``uri``, or None."""
    creds = uri.split("://", 1)[1].split("/", 1)[0]
    if "@" not in creds or ":" not in creds.split("@", 1)[0]:
        return None
    return creds.split("@", 1)[0].split(":", 1)[1]


class Corpus:
    """The sample corpus ingested into a database of its own, and how to run commands on it."""

    def __init__(self, uri: str, base: Path) -> None:
        self.uri = uri
        self.base = base
        self.db = f"dsgpt2_test_{uuid.uuid4().hex[:8]}"
        # The password stays out of the file: the environment carries the connection string.
        self.config = base / "mongo.json"
        self.config.write_text(
            json.dumps(
                {
                    "MONGO_CONNECTION_STRING": redact_uri(uri),
                    "MONGO_CONNECTION_DB": self.db,
                    "COLLECTIONS": ["stdlib"],
                    "SERVER_SELECTION_TIMEOUT_MS": 5000,
                }
            )
        )
        self.env = {ENV_URI: uri}
        self.secret = password_of(uri)

    @property
    def mongo(self) -> MongoConfig:
        return load_config(self.config, env=self.env)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = run_cli(*args, env=self.env)
        self.check_no_secret(result)
        return result

    def check_no_secret(self, result: Any) -> None:
        if self.secret:
            assert self.secret not in result.stdout + result.stderr

    def train(self, run: Path, *extra: str, faults: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        script = ["tests/inject.py", *faults, "--"] if faults else ["ds_trainer.py"]
        args = [
            *script,
            "--deepspeed_config", "configs/ds_config_cpu.json",
            "--config_train", str(self.config),
            "--vocab_dir", str(self.base / "tok"),
            "--model_select", "tiny", "--context_length", "64",
            "--tr_ratio", "0.8", "--chunk_docs", "20", "--num_workers", "2",
            "--eval_interval", "4", "--eval_iters", "2", "--log_interval", "1",
            "--wandb", "off", "--ckpt_dir", str(run / "ckpt"), "--workspace", str(run / "ws"),
            *extra,
        ]  # fmt: skip
        import os

        env = {k: v for k, v in os.environ.items() if k != ENV_URI} | self.env
        result = run_python(args, cwd=ROOT, env=env)  # a fork of the pre-imported interpreter
        self.check_no_secret(result)
        assert result.returncode == 0, result.stderr[-3000:]
        return result
