"""A living corpus through ds_trainer.py: documents ingested (by another process) while a run trains,
resume across growth, refusals for a shrunken or edited prefix, the token cache appended to, and
mixture weights with stages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, check_lineage, clone_db, run_cli, store_config, write_config
from dsgpt2.checkpoints.format import read_client_state
from dsgpt2.corpus.builtin import stdlib_documents
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.errors import ConfigError
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from dsgpt2.train.metrics import read_metrics
from forks import python_that_forks
from pace import deadline
from training import deepspeed_command
from zygote import run_python

pytestmark = pytest.mark.slow

FIRST = 200  # chunks of 100 documents: "a" starts with 2, "b" with 1, and grows by 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("growth")
    cfg, store = store_config(base, ["a", "b"])
    conn = Connection(load_config(cfg))
    ingest(conn, "a", [builtin_source("stdlib", FIRST)])
    ingest(conn, "b", [builtin_source("stdlib", 100)])
    texts, _ = mongo_texts(conn.config)
    train_vocab(texts, base / "tok", VocabSettings(vocab_size=512), "test", progress=False)
    new = base / "new.jsonl"
    docs = list(stdlib_documents(FIRST + 300))[FIRST:]
    new.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    ds = base / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "zero_optimization": {"stage": 0},
                "steps_per_print": 1000000,
            }
        )
    )
    return {"store": store, "tok": base / "tok", "ds": ds, "new": new}


def own_store(corpus: dict[str, Path], run: Path, **keys: object) -> Path:
    """A copy of the corpus for one run (it will grow), and its config file."""
    run.mkdir(parents=True, exist_ok=True)
    return write_config(
        run / "c.json",
        **clone_db(corpus["store"], run / "db.mongo"),
        COLLECTIONS=keys.pop("COLLECTIONS", ["a", "b"]),
        **keys,
    )


def ingest_command(cfg: Path, corpus: dict[str, Path]) -> str:
    return (
        f"{sys.executable} -m dsgpt2 ingest --config {cfg} --collection a --format jsonl "
        f"--no_progress {corpus['new']}"
    )


def train(
    corpus: dict[str, Path], cfg: Path, run: Path, *extra: str, faults: tuple[str, ...] = (), code: int = 0
) -> subprocess.CompletedProcess:
    script = [str(ROOT / "tests" / "inject.py"), *faults, "--"] if faults else [str(ROOT / "ds_trainer.py")]
    args = [
        "--deepspeed_config", str(corpus["ds"]), "--config_train", str(cfg),
        "--vocab_dir", str(corpus["tok"]), "--model_select", "tiny", "--context_length", "64",
        "--tr_ratio", "0.9", "--chunk_docs", "100", "--num_workers", "1", "--seed", "3", "--wandb", "off",
        "--eval_interval", "1000", "--eval_iters", "1", "--log_interval", "1", "--log_block_ids",
        "--ckpt_dir", str(run / "ckpt"), "--workspace", str(run / "ws"), *extra,
    ]  # fmt: skip
    result = run_python([*script, *args], cwd=ROOT)
    assert result.returncode == code, result.stderr[-3000:]
    return result


def records(run: Path, event: str = "train") -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == event}


GROW_RUN = ("--train_iters", "8", "--save_interval", "4", "--follow", "2")


@pytest.fixture(scope="module")
def followed(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps; 300 documents ingested by another process after step 3; --follow 2 sees them at 4."""
    run = tmp_path_factory.mktemp("followed")
    cfg = own_store(corpus, run)
    train(corpus, cfg, run, *GROW_RUN, faults=("--after", f"3={ingest_command(cfg, corpus)}"))
    return run


def test_follow_trains_on_documents_ingested_meanwhile(followed: Path) -> None:
    growth = records(followed, "growth")
    assert list(growth) == [4] and growth[4]["added"] == {"a": 300}
    steps = records(followed)
    # The table started with 3 chunks (0, 1: "a"; 2: "b"); the 300 new documents are chunks 3-5.
    before = {c for s in range(1, 5) for _, c, _ in steps[s]["block_ids"]}
    after = {c for s in range(5, 9) for _, c, _ in steps[s]["block_ids"]}
    assert before <= {0, 1, 2}
    assert after & {3, 4, 5}, after  # dealt at once: read in the very next steps
    ids = [tuple(i) for s in steps.values() for i in s["block_ids"]]
    assert len(ids) == len(set(ids))
    found = check_lineage(followed / "ckpt", followed / "ws", followed / "c.json", {"a": 500, "b": 100})
    assert any(d.status == "trained" and d.chunk in (3, 4, 5) for d in found.docs)  # growth, dealt at once
    # `info` knows the run: its directory, last checkpoint's step, when, and what it read of each.
    assert last_runs(followed / "c.json") == {"a": (str(followed / "ckpt"), 8, 500, 0),
                                              "b": (str(followed / "ckpt"), 8, 100, 0)}  # fmt: skip


def last_runs(cfg: Path) -> dict[str, tuple]:
    """Per collection, ``dsgpt2 info --json``'s last run: (directory, step, mark, documents since)."""
    done = run_cli("info", "--config", str(cfg), "--json")
    assert done.returncode == 0, done.stderr
    out = {}
    for c in json.loads(done.stdout)["collections"]:
        run = c["last_run"]
        assert run is not None and run["when"].endswith("UTC") and abs(run["at"] - time.time()) < 3600
        out[c["name"]] = (run["run"], run["step"], run["mark"], c["growth_since_last_run"])
    return out


def test_resume_after_growth_retraces_the_run_that_saw_it_and_appends_the_cache(
    corpus: dict[str, Path], followed: Path, tmp_path: Path
) -> None:
    """Killed right after step 4 (checkpoint 4 saved) while the same documents arrive, resumed in
    cached mode: the batches and losses of the streaming run that took them in at step 4, and only
    the new chunks tokenized, appended to the cache."""
    cfg = own_store(corpus, tmp_path)
    cache = tmp_path / "cache"
    cached = ("--data_mode", "cached", "--cache_dir", str(cache))
    train(corpus, cfg, tmp_path, *GROW_RUN, *cached, faults=("--exit_after", "4"), code=17)
    assert json.loads((cache / "cache.json").read_text())["chunks"] == 3
    head = (cache / "tokens.bin").read_bytes()
    subprocess.run(ingest_command(cfg, corpus), shell=True, check=True, cwd=ROOT)
    ckpt = str(tmp_path / "ckpt")
    assert last_runs(cfg)["a"] == (ckpt, 4, 200, 300)  # the documents added since the run read
    out = train(corpus, cfg, tmp_path, *GROW_RUN, *cached)
    assert "taking in new documents (a 200..500) now" in out.stderr
    assert "3 chunk(s) tokenized and added" in out.stderr
    assert json.loads((cache / "cache.json").read_text())["chunks"] == 6
    assert (cache / "tokens.bin").read_bytes()[: len(head)] == head  # appended, not rebuilt
    straight, resumed = records(followed), records(tmp_path)
    for step in range(5, 9):
        assert resumed[step]["block_ids"] == straight[step]["block_ids"], step
        assert resumed[step]["loss"] == pytest.approx(straight[step]["loss"], abs=1e-6)
    # The run's record: the growth taken in at resume, as the followed run has the one it took in.
    growth = records(tmp_path, "growth")
    assert list(growth) == [4] and growth[4]["added"] == records(followed, "growth")[4]["added"] == {"a": 300}
    assert growth[4]["at"] == "resume" and records(followed, "growth")[4]["at"] == "follow"
    saved = read_client_state(tmp_path / "ckpt", "global_step8")
    assert saved["data"]["growth"] == [{"step": 4, "added": {"a": 300}, "at": "resume"}]
    assert [launch["step"] for launch in saved["data"]["launches"]] == [0, 4]
    check_lineage(tmp_path / "ckpt", tmp_path / "ws", cfg, {"a": 500, "b": 100})
    assert last_runs(cfg) == {"a": (ckpt, 8, 500, 0), "b": (ckpt, 8, 100, 0)}  # took the growth in


def test_growth_waits_for_the_next_epoch_and_a_changed_prefix_is_refused(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    cfg = own_store(corpus, tmp_path)
    train(corpus, cfg, tmp_path, "--train_iters", "2")
    subprocess.run(ingest_command(cfg, corpus), shell=True, check=True, cwd=ROOT)
    out = train(corpus, cfg, tmp_path, "--train_iters", "6")
    assert "taking in new documents (a 200..500) from the next epoch" in out.stderr
    # The epoch under way keeps its order (see test_packing for the next one's).
    assert {c for s in records(tmp_path).values() for e, c, _ in s["block_ids"]} <= {0, 1, 2}

    conn = Connection(load_config(cfg))
    original = conn.db["a"].find_one({"idx": 0})["filt_text"]
    conn.db["a"].update_one({"idx": 0}, {"$set": {"filt_text": "edited in place"}})
    out = train(corpus, cfg, tmp_path, "--train_iters", "8", code=2)
    assert "a: documents below idx 500 (trained on) were changed or removed" in out.stderr
    # Nor is the run's reading replayed over an edited corpus: one line, not a wrong answer.
    astray = run_cli("lineage", "--ckpt_dir", str(tmp_path / "ckpt"), "--doc", "a:7")
    assert astray.returncode == 2 and len(astray.stderr.strip().splitlines()) == 1
    assert (
        "a: documents below idx 500 (trained on) were changed or removed): its reading cannot be replayed"
        in astray.stderr
    )
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 3
    conn.db["a"].update_one({"idx": 0}, {"$set": {"filt_text": original}})
    conn.db["a"].delete_many({"idx": {"$gte": 450}})
    conn.db["meta_info"].update_one({"collection": "a"}, {"$set": {"count": 450}})
    out = train(corpus, cfg, tmp_path, "--train_iters", "8", code=2)
    assert "a holds 450 documents, fewer than the 500 trained on" in out.stderr


# Stage 0 from the config's weights, the stage at step 6 from the flag.
WEIGHTED = {"COLLECTIONS": [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]}
MIX = ("--train_iters", "12", "--save_interval", "4", "--mixture", "6: a=0.2,b=0.8")


def shares(run: Path, lo: int, hi: int) -> dict[str, float]:
    steps = records(run)
    got = {k: steps[hi]["collection_tokens"][k] - steps[lo]["collection_tokens"][k] for k in ("a", "b")}
    total = sum(got.values())
    return {k: v / total for k, v in got.items()}


def test_mixture_weights_and_stages_hold_across_two_resumes(corpus: dict[str, Path], tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    train(corpus, own_store(corpus, straight, **WEIGHTED), straight, *MIX)
    # "b" holds a third of the documents, and gives half the tokens, then 80%.
    assert shares(straight, 1, 6)["b"] == pytest.approx(0.5, abs=0.05)
    assert shares(straight, 6, 12)["b"] == pytest.approx(0.8, abs=0.05)
    resumed = tmp_path / "resumed"
    cfg = own_store(corpus, resumed, **WEIGHTED)
    train(corpus, cfg, resumed, *MIX, faults=("--exit_after", "4"), code=17)
    train(corpus, cfg, resumed, *MIX, faults=("--exit_after", "8"), code=17)  # across the stage change
    train(corpus, cfg, resumed, *MIX)
    a, b = records(straight), records(resumed)
    assert [a[s]["block_ids"] for s in range(1, 13)] == [b[s]["block_ids"] for s in range(1, 13)]
    assert b[12]["collection_tokens"] == a[12]["collection_tokens"]
    check_lineage(resumed / "ckpt", resumed / "ws", cfg, {"a": 200, "b": 100})


def test_mixture_flag_errors_are_one_line(corpus: dict[str, Path], tmp_path: Path) -> None:
    cfg = own_store(corpus, tmp_path)
    out = train(corpus, cfg, tmp_path, "--mixture", "a=0.5,news=0.5", code=2)
    assert "--mixture: news not in COLLECTIONS (a, b)" in out.stderr and "Traceback" not in out.stderr


def test_mixture_weights_that_are_not_finite_are_refused_naming_them() -> None:
    from dsgpt2.data.mixture import parse_mixture

    for text, said in (
        ("a=inf,b=1", "'a=inf,b=1': a=inf is not a finite weight"),
        ("a=1,b=nan", "'a=1,b=nan': b=nan is not a finite weight"),
        ("a=1e400,b=1", "'a=1e400,b=1': a=1e400 is not a finite weight"),  # read as inf
        ("a=1,b=1; 5: a=-inf", "'5: a=-inf': a=-inf is not a finite weight"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"--mixture {said}")):
            parse_mixture(text, ["a", "b"])


def test_shares_track_weights_over_long_windows() -> None:
    """Block-level choice: over any window of 1,000 batches after the first 100, every share is
    within 2 points of its weight, for weights far from the collections' sizes."""
    from dsgpt2.data.mixture import Stage, pick, stage_at

    rng = np.random.default_rng(0)
    weights = (0.7, 0.2, 0.1)
    taken, history = [0, 0, 0], []
    for _ in range(1100 * 8):
        s = pick(taken, weights, 64)
        n = int(rng.integers(20, 65))  # the last block of a chunk is short
        taken[s] += n
        history.append((s, n))
    batches = (
        np.array([[n if s == c else 0 for c in range(3)] for s, n in history]).reshape(1100, 8, 3).sum(1)
    )
    window = batches[100:1100].sum(0)
    assert np.abs(window / window.sum() - weights).max() < 0.02
    assert (
        stage_at([Stage(0, (1.0,)), Stage(5, (1.0,))], 4) == 0
        and stage_at([Stage(0, (1,)), Stage(5, (1,))], 5) == 1
    )


def test_two_ranks_follow_growth_with_a_mixture_from_one_cache(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two gloo ranks under the deepspeed launcher, cached mode, mixture weights: rank 0 reads the marks
    and appends the cache, both ranks take the new chunks in at the same step, no block twice."""
    import socket

    cfg = own_store(corpus, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [*deepspeed_command(), "--num_gpus", "2", "--master_port", str(port)]
    inject = [str(ROOT / "tests" / "inject.py"), "--after", f"3={ingest_command(cfg, corpus)}", "--"]
    args = [
        "--deepspeed_config", str(corpus["ds"]), "--config_train", str(cfg),
        "--vocab_dir", str(corpus["tok"]), "--model_select", "tiny", "--context_length", "64",
        "--num_workers", "1", "--wandb", "off", "--eval_interval", "1000", "--log_interval", "1",
        "--log_block_ids",
        "--ckpt_dir", str(tmp_path / "ckpt"), "--workspace", str(tmp_path / "ws"), "--train_iters", "8",
        "--follow", "2", "--mixture", "a=0.6,b=0.4", "--data_mode", "cached",
    ]  # fmt: skip

    def launch(chunk_docs: str) -> subprocess.CompletedProcess:
        cmd = [*launcher, *inject, *args, "--chunk_docs", chunk_docs]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))

    # With weights each collection is dealt to the ranks on its own: "b" must make a chunk per rank.
    refused = launch("100")
    assert refused.returncode != 0
    assert "b: 100 documents make 1 chunk(s) of --chunk_docs 100, fewer than the 2 ranks" in refused.stderr
    assert "lower --chunk_docs (at most 50) or drop the collection's weight" in refused.stderr
    out = launch("50")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert [(s, g["added"]) for s, g in records(tmp_path, "growth").items()] == [(4, {"a": 300})]
    ids = []
    for rank in range(2):
        steps = read_metrics(tmp_path / "ws" / f"block_ids_rank{rank}.jsonl")
        assert [r["step"] for r in steps] == list(range(1, 9))
        ids.append([tuple(b) for r in steps for b in r["block_ids"]])
    assert not set(ids[0]) & set(ids[1]) and len(ids[0]) == len(set(ids[0]))
    # Chunks of 50: "a" 0-3, "b" 4-5, then the 300 new documents of "a" 6-11.
    assert {c for _, c, _ in ids[0] + ids[1]} & set(range(6, 12))
    assert json.loads((tmp_path / "ws" / "cache" / "cache.json").read_text())["chunks"] == 12
    assert shares(tmp_path, 1, 8)["a"] == pytest.approx(0.6, abs=0.05)
    check_lineage(tmp_path / "ckpt", tmp_path / "ws", cfg, {"a": 500, "b": 100}, ranks=2)


def test_an_ingest_and_a_curate_pass_beside_follow_training_all_land(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Three writers on one database at once: a --follow run, an ingest of 300 documents into the
    collection it trains on, and a curate pass over both collections. Each exits 0, every document is
    there once with idx contiguous, every document is judged, and whatever growth the run took in is
    in its metrics."""
    cfg = own_store(corpus, tmp_path)
    trainer = subprocess.Popen(
        [python_that_forks(), str(ROOT / "ds_trainer.py"), "--deepspeed_config", str(corpus["ds"]),
         "--config_train", str(cfg), "--vocab_dir", str(corpus["tok"]), "--model_select", "tiny",
         "--context_length", "64", "--tr_ratio", "0.9", "--chunk_docs", "100", "--num_workers", "1",
         "--seed", "3", "--wandb", "off", "--eval_interval", "1000", "--eval_iters", "1",
         "--log_interval", "1", "--train_iters", "12", "--follow", "2", "--ckpt_dir", str(tmp_path / "ckpt"),
         "--workspace", str(tmp_path / "ws")],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    others = [
        subprocess.Popen(ingest_command(cfg, corpus), shell=True, cwd=ROOT, stderr=subprocess.PIPE,
                         text=True),
        subprocess.Popen([sys.executable, "-m", "dsgpt2", "curate", "--config", str(cfg), "--no_progress"],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True),
    ]  # fmt: skip
    for proc in [*others, trainer]:
        _, err = proc.communicate(timeout=deadline(400))
        assert proc.returncode == 0, err[-3000:]
    conn = Connection(load_config(cfg))
    assert sorted(d["idx"] for d in conn.db["a"].find({}, {"idx": 1})) == list(range(FIRST + 300))
    assert conn.db["a"].count_documents({"passes": {"$exists": True}}) >= FIRST
    assert conn.db["b"].count_documents({"passes": {"$exists": True}}) == 100
    assert run_cli("validate", "--config", str(cfg)).returncode == 0
    added = sum(r["added"].get("a", 0) for r in records(tmp_path, "growth").values())
    assert added in (0, 300)  # taken in whole, at a poll after the ingest's last batch, or not yet
    assert sorted(records(tmp_path)) == list(range(1, 13))
