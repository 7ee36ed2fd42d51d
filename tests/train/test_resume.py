"""A run stopped and resumed retraces a straight one, batch for batch and loss for loss (both data modes,
a FILTER, the ranges order, early stopping, a compiled model); a resume refuses a checkpoint of other
data or of another model in one line. Real DeepSpeed runs of the tiny preset on CPU, through
ds_trainer.py as a user starts it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import check_lineage, clone_db, run_cli
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from dsgpt2.train.metrics import read_metrics
from training import steps, train, training_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


CRASH_RUN = ("--train_iters", "8", "--save_interval", "4")


@pytest.fixture(scope="module")
def straight_run(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 steps without a stop, streaming: the line every interrupted run must retrace."""
    run = tmp_path_factory.mktemp("straight")
    train(corpus, run, *CRASH_RUN, "--data_mode", "streaming")
    return run


def _lineage_cli(ckpt: Path, found: Any) -> None:
    """What a user reads: the steps and checkpoints of a trained document, why another never trained,
    one line for a bad --doc; the run's own connection config by default."""
    trained = next(d for d in found.docs if d.status == "trained")
    val = next(d for d in found.docs if d.status == "validation")
    out = run_cli("lineage", "--ckpt_dir", str(ckpt), "--doc", trained.doc, "--doc", val.doc)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert (
        lines[0].startswith(f"{trained.doc}: chunk {trained.chunk}, block")
        and f"at {len(trained.steps)} step(s)" in lines[0]
    )
    assert f"  step {trained.steps[0]}: rank 0, epoch " in lines[1]
    assert f"checkpoints that saw it (step >= {trained.steps[0]}): " in out.stdout
    assert "global_step8" in out.stdout and (trained.steps[0] > 4) == ("global_step4" not in out.stdout)
    assert f"{val.doc} (chunk {val.chunk}): in the validation split: never trained on" in out.stdout
    assert (
        lines[-1]
        == f"replayed 8 step(s) on 1 rank(s) to {ckpt / 'global_step8'}: its saved data position matches"
    )
    as_json = json.loads(run_cli("lineage", "--ckpt_dir", str(ckpt), "--doc", trained.doc, "--json").stdout)
    assert as_json["docs"][0]["steps"] == trained.steps and as_json["step"] == 8
    out = run_cli("lineage", "--ckpt_dir", str(ckpt), "--doc", "news:3")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "'news' is not one of the run's collections (stdlib)" in out.stderr


@pytest.mark.parametrize("mode", ["streaming", "cached"])
def test_crash_and_resume_sees_the_same_batches(
    corpus: dict[str, Path], straight_run: Path, tmp_path: Path, mode: str
) -> None:
    # Both data modes deal the same blocks in the same order: the cached run, crashed and resumed,
    # retraces the streaming run too.
    common = (*CRASH_RUN, "--data_mode", mode)
    crashed = train(corpus, tmp_path / "split", *common, check=False, faults=("--exit_after", "6"))
    assert crashed.returncode == 17
    assert (tmp_path / "split" / "ckpt" / "latest").read_text() == "global_step4"
    train(corpus, tmp_path / "split", *common)
    # The replay of the run's record names the very steps that read each document.
    found = check_lineage(
        tmp_path / "split" / "ckpt", tmp_path / "split" / "ws", corpus["config"], {"stdlib": 2000}
    )
    if mode == "streaming":
        _lineage_cli(tmp_path / "split" / "ckpt", found)
    a, b = steps(straight_run), steps(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        for x, y in zip(a[step]["losses"], b[step]["losses"], strict=True):
            assert abs(x - y) <= 1e-6, (step, x, y)


def test_a_filter_run_skips_what_it_leaves_out_and_resumes_exactly(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A copy of the corpus with every 3rd document marked a duplicate and FILTER leaving them out:
    the run counts them, a crashed and resumed run retraces a straight one, and another FILTER is
    other data for a resume."""
    data = json.loads(corpus["config"].read_text())
    copy = clone_db(corpus["config"].parent / "db.mongo", tmp_path / "db.mongo")
    keep = {"dup_of": {"$exists": False}}
    cfg = tmp_path / "filtered.json"
    cfg.write_text(json.dumps({**data, **copy, "FILTER": keep}))
    conn = Connection(load_config(cfg))
    conn.db["stdlib"].update_many({"idx": {"$in": list(range(0, 2000, 3))}}, {"$set": {"dup_of": "stdlib:1"}})
    filtered = dict(corpus, config=cfg)
    run = ("--train_iters", "6", "--save_interval", "3")
    straight = train(filtered, tmp_path / "straight", *run)
    assert re.search(r"documents read: \d+ skipped \(filtered: \d+", straight.stdout + straight.stderr)
    crashed = train(filtered, tmp_path / "split", *run, check=False, faults=("--exit_after", "4"))
    assert crashed.returncode == 17
    train(filtered, tmp_path / "split", *run)
    a, b = steps(tmp_path / "straight"), steps(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        for x, y in zip(a[step]["losses"], b[step]["losses"], strict=True):
            assert abs(x - y) <= 1e-6, (step, x, y)
    cfg.write_text(json.dumps({**data, **copy, "FILTER": {}}))
    other = train(filtered, tmp_path / "split", "--train_iters", "8", check=False)
    assert other.returncode == 2 and "saved for other data" in other.stderr and "filter" in other.stderr


def test_resume_refuses_other_data(corpus: dict[str, Path], tmp_path: Path) -> None:
    train(corpus, tmp_path, "--train_iters", "2", "--save_interval", "100")
    other_tok = tmp_path / "tok2"
    conn = Connection(load_config(corpus["config"]))
    texts, _ = mongo_texts(conn.config)
    # The same size (the model is the same shape), other tokens: the data fingerprint tells them apart.
    train_vocab(texts, other_tok, VocabSettings(vocab_size=512, lowercase=True), "test", progress=False)
    changed = dict(corpus, tok=other_tok)
    result = train(changed, tmp_path, "--train_iters", "4", check=False)
    assert result.returncode == 2
    assert "saved for other data" in result.stderr and "tokenizer" in result.stderr
    assert "Traceback" not in result.stderr


def test_resume_with_another_model_names_each_setting_and_the_flags_that_match(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint of the tiny model resumed as another size: one line with both values of every
    setting that differs and the flags it was trained with, --ignore_fingerprint or not."""
    train(corpus, tmp_path, "--train_iters", "2", "--save_interval", "100")
    where = tmp_path / "ckpt" / "global_step2"
    wider = train(corpus, tmp_path, "--train_iters", "4", "--model_select", "112m_half", check=False)
    longer = train(corpus, tmp_path, "--train_iters", "4", "--model_select", "112m_half", "--context_length",
                   "128", "--ignore_fingerprint", check=False)  # fmt: skip
    for result in (wider, longer):
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = [x for x in result.stderr.splitlines() if "error" in x.lower()]
        assert line.startswith(f"ds_trainer.py: error: {where} holds another model than this run builds (")
        assert "Traceback" not in result.stderr
        assert "layers 2 there, 6 here; width 64 there, 768 here; heads 2 there, 12 here" in line
        assert line.endswith("or train this model in another --ckpt_dir")
        assert "state_dict" not in line
    assert "context" not in wider.stderr and "resume it with --model_select tiny, or" in wider.stderr
    assert "context 64 there, 128 here" in longer.stderr
    assert "resume it with --model_select tiny --context_length 64, or" in longer.stderr
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"


def test_a_run_in_the_ranges_order_resumes_in_it_and_only_in_it(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint of the ranges order (the fingerprint of every run before spread reading) is
    refused by a resume in the spread order, with one line naming the flag, and resumes exactly in
    its own order: steps 3-4 read the blocks of the straight run, chunks of consecutive documents."""
    from dsgpt2.checkpoints.format import read_client_state

    straight = tmp_path / "straight"
    train(corpus, straight, "--train_iters", "4", "--save_interval", "2", "--read_order", "ranges")
    fp = read_client_state(straight / "ckpt", "global_step2")["fingerprint"]
    assert fp["layout"] == 2 and "order" not in fp
    resumed = tmp_path / "resumed"
    args = ("--train_iters", "4", "--load_dir", str(straight / "ckpt"), "--ckpt_id", "global_step2")
    refused = train(corpus, resumed, *args, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = [x for x in refused.stderr.splitlines() if "--read_order ranges" in x]
    assert "reads in the ranges order; resume it with --read_order ranges" in line
    train(corpus, resumed, *args, "--read_order", "ranges")
    want, got = steps(straight), steps(resumed)
    assert [got[s]["block_ids"] for s in (3, 4)] == [want[s]["block_ids"] for s in (3, 4)]
    assert all(abs(got[s]["loss"] - want[s]["loss"]) < 1e-6 for s in (3, 4))
    chunks = {c for s in (1, 2, 3, 4) for _, c, _ in want[s]["block_ids"]}
    assert len(chunks) <= 2  # 8 micro-batches of 4 blocks from one or two chunks: the ranges order


def test_early_stopping_keeps_the_best_checkpoint_and_survives_a_resume(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """With --min_delta 100 no evaluation after the first improves: evaluating every 2 steps with
    --patience 2, the run stops early at step 6; the best (step 2) is tagged `best`, kept by
    --keep_last 1 and loaded by `--ckpt_id best`. Killed at step 5 and resumed from step 4, the
    count of evaluations without improvement carries over: the same stop at step 6."""
    from dsgpt2.checkpoints.format import complete_tags

    flags = ("--train_iters", "20", "--eval_interval", "2", "--save_interval", "4", "--keep_last", "1",
             "--early_stopping", "--patience", "2", "--min_delta", "100")  # fmt: skip
    straight = train(corpus, tmp_path / "straight", *flags)
    assert "stopped: early at step 6" in straight.stdout
    ckpt = tmp_path / "straight" / "ckpt"
    assert (ckpt / "best").read_text() == "global_step2"
    assert complete_tags(ckpt) == ["global_step2", "global_step6"]  # step 4 pruned, the best kept
    end = [r for r in read_metrics(tmp_path / "straight" / "ws" / "metrics.jsonl") if r["event"] == "end"]
    assert end[-1]["stopped"] == "early" and end[-1]["step"] == 6

    best = ("--ckpt_id", "best")
    exported = run_cli("export", "--ckpt_dir", str(ckpt), *best, "--out", str(tmp_path / "best"))
    assert exported.returncode == 0 and "global_step2" in exported.stdout, exported.stderr
    sampled = run_cli("generate", "--model", str(ckpt), *best, "--max_new_tokens", "4", "Hello")
    assert sampled.returncode == 0, sampled.stderr
    none = run_cli("export", "--ckpt_dir", str(tmp_path / "none"), *best, "--out", str(tmp_path / "x"))
    assert none.returncode == 2 and "no readable `best` file" in none.stderr

    killed = train(corpus, tmp_path / "resumed", *flags, faults=("--exit_after", "5"), check=False)
    assert killed.returncode == 17
    resumed = train(corpus, tmp_path / "resumed", *flags)
    assert "stopped: early at step 6" in resumed.stdout
    assert (tmp_path / "resumed" / "ckpt" / "best").read_text() == "global_step2"
    again = train(corpus, tmp_path / "resumed", *flags)  # the same command once more: nothing to train
    assert "stopped: early at step 6" in again.stdout


def test_a_bos_packed_run_resumes_exactly_and_its_lineage_holds(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """``--packing bos``: a crashed and resumed run retraces a straight one, lineage names the steps that
    read each document, validation reads the blocks an end-to-end run validates on, and a resume
    without the flag is other data, said in one line."""
    bos = (*CRASH_RUN, "--packing", "bos")
    straight = train(corpus, tmp_path / "straight", *bos)
    assert straight.returncode == 0
    crashed = train(corpus, tmp_path / "split", *bos, check=False, faults=("--exit_after", "6"))
    assert crashed.returncode == 17
    train(corpus, tmp_path / "split", *bos)
    a, b = steps(tmp_path / "straight"), steps(tmp_path / "split")
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        assert a[step]["losses"] == pytest.approx(b[step]["losses"], abs=1e-6), step
    check_lineage(tmp_path / "split" / "ckpt", tmp_path / "split" / "ws", corpus["config"], {"stdlib": 2000})
    # Other blocks than end to end: an end-to-end run of the same steps trains on other batches.
    plain = train(corpus, tmp_path / "plain", *CRASH_RUN)
    assert plain.returncode == 0 and steps(tmp_path / "plain")[1]["loss"] != a[1]["loss"]
    evals = [read_metrics(tmp_path / d / "ws" / "metrics.jsonl") for d in ("straight", "plain")]
    tokens = [[r["val_tokens"] for r in m if r.get("event") == "eval"] for m in evals]
    assert tokens[0] == tokens[1] and tokens[0], tokens  # the same validation blocks
    other = train(corpus, tmp_path / "split", *CRASH_RUN, "--train_iters", "9", check=False)
    assert other.returncode == 2
    (line,) = other.stderr.strip().splitlines()
    assert "was saved for other data (packing changed)" in line, line


def test_a_resume_from_an_earlier_checkpoint_replaces_the_later_ones_of_the_run_it_left(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Rewound to step 4 with another --train_iters (another learning-rate schedule), killed after its own
    step 6 and resumed, the run saves its own step 8 rather than adopting the first run's: killed at step
    9 and resumed again, it retraces its own steps."""
    from dsgpt2.checkpoints.format import read_client_state
    from dsgpt2.train.metrics import read_metrics

    run, longer = tmp_path / "run", ("--train_iters", "12", "--save_interval", "2")
    train(corpus, run, *CRASH_RUN)
    killed = train(
        corpus, run, *longer, "--ckpt_id", "global_step4", faults=("--exit_after", "7"), check=False
    )
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert "the later global_step8, of a run that went on from an earlier step" in killed.stderr
    assert (run / "ckpt" / "latest").read_text() == "global_step6"
    assert read_client_state(run / "ckpt", "global_step8")["args"]["train_iters"] == 8  # not reached yet
    killed = train(corpus, run, *longer, faults=("--exit_after", "9"), check=False)
    assert killed.returncode == 17, killed.stderr[-3000:]
    assert (run / "ckpt" / "latest").read_text() == "global_step8"
    assert read_client_state(run / "ckpt", "global_step8")["args"]["train_iters"] == 12
    train(corpus, run, *longer)
    records = [
        r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == "train" and r["step"] == 9
    ]
    assert len(records) == 2, records  # before the kill and after the resume
    assert records[0]["losses"] == pytest.approx(records[1]["losses"], abs=1e-6)
