"""Real DeepSpeed runs of the tiny preset on CPU, through ds_trainer.py as a user starts it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, check_lineage, clone_db, run_cli, sample_corpus, store_config
from dsgpt2.corpus.ingest import builtin_source, ingest
from dsgpt2.db.config import load_config
from dsgpt2.db.mongo import Connection
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from dsgpt2.train.metrics import read_metrics
from pace import deadline, wait_for
from wire_server import fail_point
from zygote import run_python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    base = tmp_path_factory.mktemp("train")
    corpus = sample_corpus(base)
    ds = base / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True},
                },
                "scheduler": {
                    "type": "WarmupDecayLR",
                    "params": {"warmup_num_steps": 2, "warmup_max_lr": 3e-3},
                },
                "zero_optimization": {"stage": 0},
                "steps_per_print": 1000000,
            }
        )
    )
    return {**corpus, "ds": ds, "base": base}


def trainer_args(corpus: dict[str, Path], run: Path, *extra: str) -> list[str]:
    return [
        "--deepspeed_config",
        str(corpus["ds"]),
        "--config_train",
        str(corpus["config"]),
        "--vocab_dir",
        str(corpus["tok"]),
        "--model_select",
        "tiny",
        "--context_length",
        "64",
        "--tr_ratio",
        "0.9",
        "--chunk_docs",
        "100",
        "--num_workers",
        "2",
        "--seed",
        "7",
        "--wandb",
        "off",
        "--eval_interval",
        "1000",
        "--eval_iters",
        "2",
        "--log_interval",
        "1",
        "--log_block_ids",
        "--ckpt_dir",
        str(run / "ckpt"),
        "--workspace",
        str(run / "ws"),
        *extra,
    ]


def train(
    corpus: dict[str, Path], run: Path, *extra: str, check: bool = True, faults: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """``python ds_trainer.py`` as a user runs it (a fork of tests/zygote.py's pre-imported interpreter);
    with ``faults``, through tests/inject.py's hooks."""
    script = [str(ROOT / "tests" / "inject.py"), *faults, "--"] if faults else [str(ROOT / "ds_trainer.py")]
    result = run_python([*script, *trainer_args(corpus, run, *extra)], cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def steps(run: Path) -> dict[int, dict]:
    """The last train record of each step (a resumed run repeats the steps after its checkpoint)."""
    return {r["step"]: r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == "train"}


def wait_for_steps(run: Path, count: int, proc: subprocess.Popen, after: int = 0) -> None:
    """Until ``proc`` (training into ``run``) has logged ``count`` steps past step ``after``."""
    metrics = run / "ws" / "metrics.jsonl"
    done = lambda: metrics.exists() and len([s for s in steps(run) if s > after]) >= count  # noqa: E731
    wait_for(done, 240, f"{count} training step(s)", proc)


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


def test_loss_falls_and_validation_is_reported(corpus: dict[str, Path], tmp_path: Path) -> None:
    result = train(corpus, tmp_path, "--train_iters", "40", "--eval_interval", "20", "--save_interval", "100")
    records = read_metrics(tmp_path / "ws" / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    first = next(r for r in records if r["event"] == "train")
    assert first["loss"] > math.log(512) - 0.5  # a fresh model is near uniform over the vocabulary
    assert evals[-1]["val_loss"] < first["loss"] - 0.5
    assert math.isclose(evals[-1]["val_ppl"], math.exp(evals[-1]["val_loss"]), rel_tol=1e-9)
    assert (tmp_path / "ws" / "loss.png").stat().st_size > 1000
    assert "validation: loss" in result.stdout and "perplexity" in result.stdout
    # Neither DeepSpeed's accelerator guess nor transformers' loss_type notice on every run.
    assert "Setting accelerator" not in result.stderr and "loss_type" not in result.stderr
    # Validation and training blocks never overlap: the split is decided per document.
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step40"


def test_a_run_logging_to_a_file_shows_each_log_step_and_evaluation(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """stderr is a file here (a scheduler, nohup, CI): no bar, a line per log step and per evaluation."""
    result = train(corpus, tmp_path, "--train_iters", "4", "--eval_interval", "2", "--save_interval", "100")
    records = read_metrics(tmp_path / "ws" / "metrics.jsonl")
    logged = [line.split("dsgpt2.train.runlog: ")[1] for line in result.stderr.splitlines()
              if "dsgpt2.train.runlog: " in line]  # fmt: skip
    train_lines = [m for m in logged if "/4: loss " in m]
    expected = [
        f"step {r['step']}/4: loss {r['loss']:.4f}, lr {r['lr']:.2e}, {r['tokens_per_s']:,.0f} tokens/s"
        for r in records
        if r["event"] == "train"
    ]
    assert train_lines == expected and len(expected) == 4, result.stderr[-3000:]
    evals = [r for r in records if r["event"] == "eval"]
    assert [m for m in logged if "validation" in m] == [
        f"step {r['step']}: validation loss {r['val_loss']:.4f}, perplexity {r['val_ppl']:.2f}" for r in evals
    ] and [r["step"] for r in evals] == [2, 4]
    assert "\r" not in result.stderr and "step/s" not in result.stderr  # no bar redrawn into the file


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_saves_and_exits_then_resumes(
    corpus: dict[str, Path], tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGTERM (a scheduler) and Ctrl-C (SIGINT, to the whole foreground group) save and exit."""
    run = trainer_args(corpus, tmp_path, "--train_iters", "100000", "--save_interval", "100000")
    args = [sys.executable, str(ROOT / "ds_trainer.py"), *run]
    # A group of its own, signalled as a whole as a terminal does: DataLoader workers get it too.
    proc = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    metrics = tmp_path / "ws" / "metrics.jsonl"
    wait_for_steps(tmp_path, 3, proc)
    os.killpg(proc.pid, signum)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=deadline(60))
    assert proc.returncode == 0, err[-2000:]
    assert time.monotonic() - sent < 30
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = max(steps(tmp_path))
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{last}"
    end = [r for r in read_metrics(metrics) if r["event"] == "end"][-1]
    assert end["stopped"] == signum.name and end["step"] == last
    assert f"stopped: {signum.name} at step {last}" in out
    if signum == signal.SIGINT:
        return
    resumed = train(corpus, tmp_path, "--train_iters", str(last + 2), "--save_interval", "100000")
    assert max(steps(tmp_path)) == last + 2
    # Another --train_iters reshapes the learning-rate decay: said, not done silently.
    assert f"--train_iters {last + 2} where the checkpoint's run had 100000" in resumed.stderr


def test_nonfinite_loss_is_skipped_then_aborts(corpus: dict[str, Path], tmp_path: Path) -> None:
    result = train(
        corpus,
        tmp_path / "once",
        "--train_iters",
        "4",
        "--save_interval",
        "2",
        faults=("--nonfinite_at", "3"),
    )
    records = read_metrics(tmp_path / "once" / "ws" / "metrics.jsonl")
    (event,) = [r for r in records if r["event"] == "nonfinite"]
    assert event["micro"] == 3 and event["params_before"] == event["params_after"]
    assert all(math.isfinite(r["loss"]) for r in records if r["event"] == "train")
    assert "non-finite losses skipped: 1" in result.stdout
    # The skipped micro-batch was read, never trained on: not in the document's steps.
    check_lineage(tmp_path / "once" / "ckpt", tmp_path / "once" / "ws", corpus["config"], {"stdlib": 2000})

    bad = train(
        corpus,
        tmp_path / "run",
        "--train_iters",
        "10",
        "--save_interval",
        "1",
        "--max_nonfinite",
        "3",
        check=False,
        faults=("--nonfinite_at", "5", "6", "7"),
    )
    assert bad.returncode == 3
    assert "3 non-finite losses in a row" in bad.stderr
    # Step 2 completed (micro-batches 3, 4); micro-batch 5 onwards were all bad: nothing after step 2.
    assert (tmp_path / "run" / "ckpt" / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir() if p.is_dir())[-1] == "global_step2"


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


def test_missing_or_corrupt_checkpoints_are_clear_errors(corpus: dict[str, Path], tmp_path: Path) -> None:
    from conftest import run_cli

    empty = tmp_path / "empty"
    empty.mkdir()
    result = train(corpus, tmp_path / "a", "--train_iters", "2", "--load_dir", str(empty), check=False)
    assert result.returncode == 2 and "no checkpoint to resume from" in result.stderr
    train(corpus, tmp_path / "b", "--train_iters", "2", "--save_interval", "100")
    latest = tmp_path / "b" / "ckpt" / "latest"
    saved = tmp_path / "b" / "ckpt" / "global_step2"
    stamps = {p: p.stat().st_mtime_ns for p in saved.iterdir()}
    # A finished run launched again trains nothing and writes nothing (a kill then cannot hurt).
    again = train(corpus, tmp_path / "b", "--train_iters", "2", "--save_interval", "100")
    assert "nothing trained" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in saved.iterdir()} == stamps
    # A fresh run asked for where checkpoints are: refused, nothing overwritten or pruned.
    fresh = train(corpus, tmp_path / "b", "--train_iters", "2", "--no_resume", check=False)
    assert fresh.returncode == 2 and "--no_resume" in fresh.stderr.strip().splitlines()[-1]
    assert {p: p.stat().st_mtime_ns for p in saved.iterdir()} == stamps
    # 4 KiB of garbage inside the states file: found before anything loads it, by training and export.
    states = saved / "mp_rank_00_model_states.pt"
    good = states.read_bytes()
    states.write_bytes(good[:1000] + b"\xa5" * 4096 + good[5096:])
    for result in (
        train(corpus, tmp_path / "b", "--train_iters", "4", check=False),
        run_cli("export", "--ckpt_dir", str(tmp_path / "b" / "ckpt"), "--out", str(tmp_path / "hf")),
    ):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        line = result.stderr.strip().splitlines()[-1]
        assert "mp_rank_00_model_states.pt is damaged" in line and "no intact checkpoint" in line, line
    assert not (tmp_path / "hf").exists()
    states.write_bytes(good)
    # `latest` deleted: the newest intact checkpoint, with a warning, never a silent fresh start. (A
    # garbled `latest` or one naming a missing tag is the same one-line refusal: test_checkpoint.py.)
    latest.unlink()
    result = train(corpus, tmp_path / "b", "--train_iters", "4")
    assert "no `latest` file" in result.stderr and "at step 2" in result.stderr
    assert sorted(steps(tmp_path / "b")) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--model_select", "huge"], "--model_select"),
        (["--train_iters", "-5"], "--train_iters"),
        (["--tr_ratio", "1.5"], "--tr_ratio"),
        (["--tr_ratio", "0"], "--tr_ratio"),
        (["--config_train", "/nonexistent.json"], "--config_train"),
        (["--vocab_dir", "/nonexistent"], "--vocab_dir"),
        (["--attn_implementation", "flash_attention_2"], "--attn_implementation"),
        (["--lr_schedule", "wsd", "--warmup_iters", "50", "--train_iters", "20"], "--warmup_iters 50"),
        (["--decay_fraction", "1.5"], "--decay_fraction"),
        (["--read_order", "random"], "--read_order"),
    ],
)
def test_bad_flags_are_one_line_errors(
    corpus: dict[str, Path], tmp_path: Path, flags: list[str], needle: str
) -> None:
    result = train(corpus, tmp_path, *flags, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def test_deepspeed_config_problems_are_one_line_errors(corpus: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}')
    malformed = tmp_path / "malformed.json"
    malformed.write_text("{nope")
    for path, needle in ((bad, "train_batch_size 10"), (malformed, "not valid JSON")):
        result = train(dict(corpus, ds=path), tmp_path, check=False)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "--deepspeed_config" in result.stderr
        assert "Traceback" not in result.stderr


EXPORT_CHECK = """
import json, sys, torch
from transformers import GPT2LMHeadModel, pipeline
model = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    logits = model(input_ids=ids).logits[0].tolist()
generate = pipeline("text-generation", model=sys.argv[1])
text = generate("def", max_new_tokens=5, do_sample=False)[0]["generated_text"]
print(json.dumps({"logits": logits, "dsgpt2": "dsgpt2" in sys.modules, "text": text,
                  "tied": model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()}))
"""


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_resumes_and_exports(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import run_cli
    from dsgpt2.checkpoints.weights import checkpoint_state

    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds.json")
    train(staged, tmp_path, "--train_iters", "4", "--save_interval", "100")
    resumed = train(staged, tmp_path, "--train_iters", "6", "--save_interval", "100")
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
    assert sorted(steps(tmp_path)) == list(range(1, 7))
    result = run_cli("export", "--ckpt_dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "step 6" in result.stdout
    assert (tmp_path / "hf" / "model.safetensors").exists()

    weights, client = checkpoint_state(tmp_path / "ckpt", "global_step6")
    reference = GPT2LMHeadModel(GPT2Config.from_dict(client["model_config"]))
    reference.load_state_dict(weights, strict=False)
    reference.tie_weights()
    reference.eval()
    ids = [5, 17, 42, 99, 7, 300]
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids])).logits[0]
    if stage in (1, 2):
        # The export step is the same for every partitioned stage; a fresh interpreter (no dsgpt2
        # import, the text-generation pipeline) checks stages 0 and 3 below.
        exported = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
        with torch.no_grad():
            got_logits = exported(input_ids=torch.tensor([ids])).logits[0]
        assert torch.allclose(got_logits, expected, atol=1e-5)
        return
    check = subprocess.run(
        [sys.executable, "-c", EXPORT_CHECK, str(tmp_path / "hf"), json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=deadline(300),
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    assert got["dsgpt2"] is False and got["tied"] is True
    assert got["text"].startswith("def")
    assert torch.allclose(torch.tensor(got["logits"]), expected, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_chunked_loss_trains_and_validates_as_transformers_loss(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    """--loss_chunk (several chunks per micro-batch here) against --loss_chunk 0 (transformers' loss
    over the whole logits): the same losses, gradient norms and validation, step by step; under ZeRO-3
    the head's tied weight is gathered for the chunks as for the embedding."""
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds.json")
    runs = {}
    for chunk in ("50", "0"):
        run = tmp_path / f"chunk{chunk}"
        train(staged, run, "--train_iters", "5", "--save_interval", "100", "--eval_interval", "5",
              "--loss_chunk", chunk)  # fmt: skip
        records = read_metrics(run / "ws" / "metrics.jsonl")
        runs[chunk] = (steps(run), [r["val_loss"] for r in records if r["event"] == "eval"])
    (chunked, chunked_val), (whole, whole_val) = runs["50"], runs["0"]
    assert sorted(chunked) == sorted(whole) == [1, 2, 3, 4, 5]
    for step in whole:
        assert chunked[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5), step
        assert chunked[step]["grad_norm"] == pytest.approx(whole[step]["grad_norm"], rel=1e-4), step
    assert len(whole_val) == 1 and chunked_val == pytest.approx(whole_val, rel=1e-5)


def test_two_ranks_under_the_deepspeed_launcher_share_one_cache(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two CPU ranks (gloo) started by the `deepspeed` launcher in cached mode: one token cache built
    by rank 0 for both, one verdict on the corpus, disjoint chunks (streaming: the elastic test)."""
    result = _launch(corpus, tmp_path, 2, "--train_iters", "6", "--save_interval", "100",
                     "--num_workers", "1", "--data_mode", "cached")  # fmt: skip
    assert "2 rank(s)" in result.stdout + result.stderr
    chunks = []
    for rank in range(2):
        records = read_metrics(tmp_path / "ws" / f"block_ids_rank{rank}.jsonl")
        assert [r["step"] for r in records] == list(range(1, 7))
        chunks.append({c for r in records for _, c, _ in r["block_ids"]})
    assert chunks[0] and chunks[1] and chunks[0].isdisjoint(chunks[1])
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step6"
    assert (tmp_path / "ws" / "cache" / "cache.json").is_file()


def _launch(corpus: dict[str, Path], run: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(ranks),
        "--master_port",
        str(port),
    ]
    result = subprocess.run([*launcher, str(ROOT / "ds_trainer.py"), *trainer_args(corpus, run, *extra)],
                            cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    # DeepSpeed's CPU allreduce buffers (66 MB a rank) are not left in /dev/shm after the run.
    assert list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*")) == []
    return result


def _ctrl_c(proc: subprocess.Popen) -> None:
    """SIGINT to the launch's process group, as a terminal's Ctrl-C sends it."""
    os.killpg(proc.pid, signal.SIGINT)


def _stop_rank_1(proc: subprocess.Popen) -> None:
    """SIGTERM to rank 1 alone (a scheduler that signals one process)."""
    import psutil

    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "--local_rank=1" in p.cmdline()]
    [rank] = [p for p in ranks if p.parent() not in ranks]  # not its DataLoader workers
    rank.send_signal(signal.SIGTERM)


def _launch_and_stop(
    launcher: list[str], corpus: dict[str, Path], run: Path, after: int = 0, stop: Any = _ctrl_c
) -> tuple[subprocess.Popen, str, list[str]]:
    """``launcher`` (2 CPU ranks) training into ``run``, ``stop``-ped once it has taken 2 steps past step
    ``after``: the launcher, what it printed once every process of its group closed its output, and
    the ranks' stop lines. Both ranks saved the same step, which ``latest`` names."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = trainer_args(
        corpus, run, "--train_iters", "100000", "--save_interval", "100000", "--num_workers", "1"
    )
    command = [*launcher, "--num_gpus", "2", "--master_port", str(port), str(ROOT / "ds_trainer.py"), *args]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    import psutil

    try:
        wait_for_steps(run, 2, proc, after=after)
        stop(proc)
        # Every rank and the launcher hold the pipe: it closes when the last of them ends.
        out = proc.communicate(timeout=deadline(120))[0]
    finally:
        # `dsgpt2 launch` runs the launcher in a process group of its own: the whole tree goes.
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    stops = [line for line in out.splitlines() if "dsgpt2.train.trainer: " in line and "saving" in line]
    last = max(steps(run))
    assert (run / "ckpt" / "latest").read_text() == f"global_step{last}", out[-3000:]
    for rank in range(2):
        assert [r["step"] for r in read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")][-1] == last
    return proc, out, stops


def test_ctrl_c_under_the_launcher_saves_every_rank_names_sigint_and_exits_as_one_process_then_resumes(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Ctrl-C (SIGINT to the launch's process group) with two ranks: `dsgpt2 launch` ends as a single
    process does (both ranks save after the same step, the log says SIGINT, exit 0); under the plain
    `deepspeed` command, whose launcher passes the SIGINT on as a SIGTERM, the ranks still name SIGINT and
    save, and the run resumes from the first stop; a SIGTERM to one rank stops both at one step."""
    proc, out, stops = _launch_and_stop([sys.executable, "-m", "dsgpt2", "launch"], corpus, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    assert len(stops) == 2 and all("trainer: SIGINT: saving a checkpoint" in s for s in stops), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    first = max(steps(tmp_path))
    assert f"stopped: SIGINT at step {first}" in out

    plain = [str(Path(sys.executable).parent / "deepspeed")]
    proc, out, stops = _launch_and_stop(plain, corpus, tmp_path, after=first)
    assert len(stops) == 2 and all("trainer: SIGINT: saving a checkpoint" in s for s in stops), out[-3000:]
    assert f"resumed from {tmp_path / 'ckpt' / f'global_step{first}'}" in out
    second = max(steps(tmp_path))
    assert first + 1 in steps(tmp_path) and second >= first + 2
    # DeepSpeed's runner dies of the SIGINT itself, at once (README: why `dsgpt2 launch`).
    assert proc.returncode == -signal.SIGINT

    launch = [sys.executable, "-m", "dsgpt2", "launch"]
    proc, out, stops = _launch_and_stop(launch, corpus, tmp_path, after=second, stop=_stop_rank_1)
    assert proc.returncode == 0, out[-3000:]
    said = {("[rank 1]" in s, s.split("dsgpt2.train.trainer: ")[1]) for s in stops}
    assert said == {
        (True, "SIGTERM: saving a checkpoint after the current step, then exiting"),
        (False, "stopping with the other ranks (SIGTERM): saving a checkpoint"),
    }, out[-3000:]
    assert f"stopped: SIGTERM at step {max(steps(tmp_path))}" in out


def _launch_nodes(
    corpus: dict[str, Path],
    run: Path,
    per_node: list[list[str]],
    *extra: str,
    faults: list[list[str]] | None = None,
    expect: tuple[int, ...] = (0, 0),
) -> list[tuple[str, float]]:
    """One `deepspeed --no_ssh --node_rank R` launch per simulated node (a hostfile with 1 and 2
    slots: world 3), all at once, each its own process group; ``per_node``: each node's own flags,
    ``faults``: each node's tests/inject.py flags. Returns each node's output and when it ended."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hostfile = run / "hostfile"
    run.mkdir(parents=True, exist_ok=True)
    hostfile.write_text("node0 slots=1\nnode1 slots=2\n")
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
                "--master_addr", "127.0.0.1", "--master_port", str(port)]  # fmt: skip
    nodes, logs = [], []
    for rank, own in enumerate(per_node):
        inject = [str(ROOT / "tests" / "inject.py"), *faults[rank], "--"] if faults and faults[rank] else []
        script = inject or [str(ROOT / "ds_trainer.py")]
        argv = [*launcher, "--node_rank", str(rank), *script, *trainer_args(corpus, run, *extra, *own)]
        logs.append(open(run / f"node{rank}.log", "w+"))  # noqa: SIM115 - closed below
        nodes.append(subprocess.Popen(argv, cwd=ROOT, stdout=logs[-1], stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
    ended = [0.0] * len(nodes)
    end_by = time.monotonic() + deadline(400)
    while not all(ended) and time.monotonic() < end_by:
        for i, node in enumerate(nodes):
            if not ended[i] and node.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.2)
    results = []
    for node, log, end in zip(nodes, logs, ended, strict=True):
        if not end:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        log.seek(0)
        results.append((log.read(), end))
        log.close()
    for (out, end), code, node in zip(results, expect, nodes, strict=True):
        assert end, "a node did not end: " + out[-3000:]
        assert node.returncode == code, out[-3000:]
    return results


@pytest.mark.parametrize("mode", ["streaming", "cached"])
def test_two_nodes_each_with_its_own_disk_read_the_epoch_once(
    corpus: dict[str, Path], tmp_path: Path, mode: str
) -> None:
    """Two nodes (1 + 2 ranks), each with its own cache directory (node-local disks): one cache per
    node, built by the node's first rank; across the 3 ranks, epoch 0's blocks are exactly those of
    a one-rank run's epoch 0, none twice."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--save_interval", "1000", "--num_workers", "1", "--data_mode", mode)
    train(small, tmp_path / "one", "--train_iters", "40", *common[:-2])
    whole = [tuple(b) for r in read_metrics(tmp_path / "one" / "ws" / "block_ids_rank0.jsonl")
             for b in r["block_ids"] if b[0] == 0]  # fmt: skip
    caches = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    out = [o for o, _ in _launch_nodes(small, tmp_path / "two", [["--cache_dir", str(c)] for c in caches],
                                       "--train_iters", "24", *common)]  # fmt: skip
    read = []
    for rank in range(3):
        records = read_metrics(tmp_path / "two" / "ws" / f"block_ids_rank{rank}.jsonl")
        assert records[-1]["block_ids"][-1][0] >= 1, f"rank {rank} did not finish epoch 0"
        read += [tuple(b) for r in records for b in r["block_ids"] if b[0] == 0]
    assert len(read) == len(set(read)), "a block was read twice"
    assert set(read) == set(whole)
    if mode == "cached":
        assert all((c / "cache.json").is_file() for c in caches)
        assert "2 cache directories, built by ranks 0, 1" in out[0]
        assert not list(caches[1].glob(".rank-*"))


# Three two-node launches, two of them waiting out a 60 s --dist_timeout: beside another suite on the
# same cores it needs more than the per-test hang guard.
@pytest.mark.timeout(1200)
def test_a_lost_node_ends_the_other_within_dist_timeout_and_both_resume_exactly(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Node 1 (ranks 1 and 2) is killed at once after step 6 of 12, its checkpoint at step 4:
    node 0 ends within --dist_timeout, one line and exit 3, the checkpoint intact; the same two
    commands resume, to the straight run's blocks and losses. A node that never comes: the one
    launched ends after --dist_timeout with one line."""
    from dsgpt2.checkpoints.format import complete_tags

    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--save_interval", "4", "--num_workers", "1", "--train_iters", "12")
    timeout = ("--dist_timeout", "60")
    _launch_nodes(small, tmp_path / "straight", [[], []], *common, *timeout)

    run = tmp_path / "lost"
    kill = [[], ["--kill_group_after", "6"]]
    nodes = _launch_nodes(small, run, [[], []], *common, *timeout, faults=kill, expect=(3, -9))
    (out, end), (_, killed) = nodes
    assert end - killed < 60
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "rank 0 of 3 stops at step 7: a rank or node of the run died" in errors[0]
    assert f"the last whole checkpoint, {run / 'ckpt'}/global_step4, is kept" in errors[0]
    assert complete_tags(run / "ckpt") == ["global_step4"]
    assert (run / "ckpt" / "latest").read_text().strip() == "global_step4"

    _launch_nodes(small, run, [[], []], *common, *timeout)
    straight, resumed = steps(tmp_path / "straight"), steps(run)
    assert sorted(resumed) == sorted(straight) == list(range(1, 13))
    for step in straight:
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-6, step
    for rank in range(3):
        ids = [{r["step"]: r["block_ids"] for r in read_metrics(d / "ws" / f"block_ids_rank{rank}.jsonl")}
               for d in (tmp_path / "straight", run)]  # fmt: skip
        assert ids[0] == ids[1], f"rank {rank} read other blocks"

    start = time.monotonic()
    alone = tmp_path / "alone"
    [(out, end)] = _launch_nodes(small, alone, [[]], *common, "--dist_timeout", "10", expect=(3,))
    assert end - start < 10 + deadline(60)  # the launch's own start-up, then the timeout
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert "stops at start-up: only 1 of 3 ranks joined the run within --dist_timeout 10 s" in errors[0]


def test_resume_on_another_number_of_ranks_reads_every_block_once(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two ranks stop mid-epoch; one rank resumes: the epoch's blocks, set-wise, are exactly those
    of a one-rank straight run, none twice."""
    cfg, _ = store_config(tmp_path, ["small"])
    ingest(Connection(load_config(cfg)), "small", [builtin_source("stdlib", 150)])
    small = dict(corpus, config=cfg)
    common = ("--chunk_docs", "10", "--save_interval", "1000", "--num_workers", "1")

    def epoch0(run: Path, rank: int = 0, after: int = 0) -> list[tuple[int, int, int]]:
        records = read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")
        return [tuple(b) for r in records if r["step"] > after for b in r["block_ids"] if b[0] == 0]

    train(small, tmp_path / "straight", "--train_iters", "40", *common)
    whole = epoch0(tmp_path / "straight")
    assert len(whole) == len(set(whole))
    last = read_metrics(tmp_path / "straight" / "ws" / "block_ids_rank0.jsonl")[-1]
    assert last["block_ids"][-1][0] == 1  # the straight run got past epoch 0

    _launch(small, tmp_path / "elastic", 2, "--train_iters", "4", *common)
    ranks = [epoch0(tmp_path / "elastic", 0), epoch0(tmp_path / "elastic", 1)]
    assert ranks[0] and ranks[1] and {c for _, c, _ in ranks[0]}.isdisjoint({c for _, c, _ in ranks[1]})
    before = ranks[0] + ranks[1]
    partitioned = tmp_path / "zero1"
    shutil.copytree(tmp_path / "elastic" / "ckpt", partitioned / "ckpt")
    resumed = train(small, tmp_path / "elastic", "--train_iters", "40", *common)
    assert "was saved by 2 rank(s); this run has 1" in resumed.stderr
    both = before + epoch0(tmp_path / "elastic", 0, after=4)
    assert len(both) == len(set(both)), "a block was trained twice"
    assert set(both) == set(whole), "a block was skipped"
    # Two ranks, then one, the leftovers of their epoch dealt anew: replayed as they were read.
    check_lineage(tmp_path / "elastic" / "ckpt", tmp_path / "elastic" / "ws", cfg, {"small": 150}, ranks=2)

    # Where DeepSpeed's optimizer state is partitioned per rank, it cannot follow: one line.
    (partitioned / "ckpt" / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    refused = train(small, partitioned, "--train_iters", "8", *common, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "ds_to_universal" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("fault", [{"errorCode": 91}, {"closeConnection": True}])
def test_transient_database_errors_do_not_stop_training(
    corpus: dict[str, Path], tmp_path: Path, fault: dict[str, Any]
) -> None:
    """failCommand on the reads (twice: pymongo's own retry takes the first): retried, and the run goes on."""
    cfg = json.loads(corpus["config"].read_text())
    fail_point(cfg["MONGO_CONNECTION_STRING"], {"times": 2}, failCommands=["find", "aggregate"], **fault)
    try:
        result = run_python(
            [
                str(ROOT / "ds_trainer.py"),
                *trainer_args(corpus, tmp_path, "--train_iters", "3", "--save_interval", "100"),
            ],
            cwd=ROOT,
        )
    finally:
        fail_point(cfg["MONGO_CONNECTION_STRING"], "off")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "transient MongoDB error" in result.stderr and "retry 1/" in result.stderr


@pytest.mark.parametrize("code", [189, 11600])
def test_lost_database_saves_then_exits_non_zero(corpus: dict[str, Path], tmp_path: Path, code: int) -> None:
    """Every read failing from the middle of a run on (a fail point armed once steps are logged): past the
    retry budget a checkpoint and exit 3; the database back, the same command resumes from it."""
    cfg = json.loads(corpus["config"].read_text())
    flaky = tmp_path / "flaky.json"
    flaky.write_text(json.dumps({**cfg, "RETRIES": 2, "RETRY_BACKOFF_S": 0.01}))
    reads = ("--chunk_docs", "50", "--num_workers", "1")
    args = trainer_args(
        dict(corpus, config=flaky), tmp_path, "--train_iters", "100000", "--save_interval", "100000", *reads
    )
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "ds_trainer.py"), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_steps(tmp_path, 2, proc)
        fail_point(
            cfg["MONGO_CONNECTION_STRING"], "alwaysOn", failCommands=["find", "aggregate"], errorCode=code
        )
        _, stderr = proc.communicate(timeout=deadline(240))
    finally:
        fail_point(cfg["MONGO_CONNECTION_STRING"], "off")
        proc.kill()
    assert proc.returncode == 3, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ds_trainer.py: error:") and "failed 3 times" in last and "re-run to resume" in last
    )
    step = max(steps(tmp_path))
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{step}"
    # The database is back: the same command resumes from that checkpoint.
    args = trainer_args(dict(corpus, config=flaky), tmp_path, "--train_iters", str(step + 2), *reads)
    again = run_python([str(ROOT / "ds_trainer.py"), *args], cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert max(steps(tmp_path)) == step + 2


def test_tokenize_ahead_then_cached_training_reuses_it(corpus: dict[str, Path], tmp_path: Path) -> None:
    from conftest import run_cli

    cache = tmp_path / "cache"
    flags = ["--config_train", str(corpus["config"]), "--vocab_dir", str(corpus["tok"]), "--cache_dir",
             str(cache), "--context_length", "64", "--tr_ratio", "0.9", "--chunk_docs", "100",
             "--seed", "7"]  # fmt: skip
    every = {"DSGPT2_PROGRESS_SECONDS": "0"}  # stderr is a file: a progress line at each chunk
    quiet = run_cli("tokenize", *flags, "--no_progress", env=every)
    assert quiet.returncode == 0 and "dsgpt2.progress" not in quiet.stderr, quiet.stderr
    made = run_cli("tokenize", *flags, "--force", env=every)
    assert made.returncode == 0 and "20 chunk(s) tokenized, 20 in all" in made.stdout, made.stderr
    shown = [line.split("dsgpt2.progress: ")[1] for line in made.stderr.splitlines() if "progress: " in line]
    assert len(shown) == 20 and shown[-1].startswith("tokenize: 20/20 chunk (100.0%), "), made.stderr
    stamp = (cache / "tokens.bin").stat().st_mtime_ns
    result = train(corpus, tmp_path, "--train_iters", "2", "--data_mode", "cached", "--cache_dir", str(cache))
    assert "up to date, reused" in result.stderr
    assert (cache / "tokens.bin").stat().st_mtime_ns == stamp


def test_wandb_offline_gets_no_password(tmp_path: Path) -> None:
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.train.metrics import MetricsLog

    cfg = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": "mongodb://u:hunter2secret@h:1/",
            "MONGO_CONNECTION_DB": "d",
            "COLLECTIONS": ["a"],
        },
        env={},
    )
    log = MetricsLog(tmp_path / "run", "offline", tmp_path / "wandb", {"mongo": cfg.to_dict()})
    log.write({"event": "train", "step": 1, "loss": 3.0})
    log.close()
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert files, "wandb wrote nothing offline"
    for p in files:
        assert b"hunter2secret" not in p.read_bytes(), p
    assert any(b"u:***@h:1" in p.read_bytes() for p in files)


RECIPE = ("--lr_schedule", "wsd", "--lr", "2e-3", "--warmup_iters", "2", "--decay_fraction", "0.5",
          "--doc_mask", "--activation_checkpointing", "--attn_implementation", "eager",
          "--peak_tflops", "0.5")  # fmt: skip


def test_wsd_run_logs_its_recipe_and_an_extended_resume_follows_the_new_curve(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    from conftest import run_cli
    from dsgpt2.model.gpt2 import flops_per_token, gpt2_config
    from dsgpt2.tokenizer.bpe import load_vocab_size
    from dsgpt2.train.schedule import Schedule, lr_at

    flops = flops_per_token(gpt2_config("tiny", load_vocab_size(corpus["tok"]), 64, 0, 1), 64)

    run = train(corpus, tmp_path, "--train_iters", "6", "--save_interval", "3", *RECIPE)
    assert "deprecated" not in run.stderr  # activation checkpointing under transformers' current name
    first = steps(tmp_path)
    curve = Schedule("wsd", 2e-3, total=6, warmup=2, min_ratio=0.1, decay_fraction=0.5)
    for k in range(1, 7):
        r = first[k]
        assert r["lr"] == pytest.approx(lr_at(curve, k - 1)), k  # the rate step k trained at
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["tokens_per_s"] > 0 and r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / 0.5e12)
        assert "peak_memory_gb" not in r  # a GPU's allocator only

    resumed = train(corpus, tmp_path, "--train_iters", "10", *RECIPE)
    assert "--train_iters 10 where the checkpoint's run had 6" in resumed.stderr
    later = steps(tmp_path)
    longer = Schedule("wsd", 2e-3, total=10, warmup=2, min_ratio=0.1, decay_fraction=0.5)
    expected = [lr_at(longer, k - 1) for k in range(7, 11)]
    assert [later[k]["lr"] for k in range(7, 11)] == pytest.approx(expected)

    # Trained within documents, evaluated within documents unless told otherwise.
    exported = run_cli("export", "--ckpt_dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-2000:]
    reports = {}
    for flag in ("--doc_mask", "--no_doc_mask"):
        report = tmp_path / f"eval{flag}.json"
        done = run_cli("evaluate", "--model", str(tmp_path / "hf"), "--config", str(corpus["config"]),
                       "--max_batches", "2", "--no_record", "--no_progress", "--report", str(report),
                       *([flag] if flag == "--no_doc_mask" else []))  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        reports[flag] = json.loads(report.read_text())
    assert reports["--doc_mask"]["doc_mask"] is True and reports["--no_doc_mask"]["doc_mask"] is False
    assert reports["--doc_mask"]["metrics"]["loss"] != reports["--no_doc_mask"]["metrics"]["loss"]


def test_a_compiled_model_trains_as_the_eager_one(
    corpus: dict[str, Path], straight_run: Path, tmp_path: Path
) -> None:
    """--compile (torch.compile of the model inside the engine) changes the speed, not the training."""
    train(corpus, tmp_path, "--train_iters", "3", "--data_mode", "streaming", "--compile")
    compiled, eager = steps(tmp_path), steps(straight_run)
    for k in (1, 2, 3):
        assert compiled[k]["block_ids"] == eager[k]["block_ids"]
        assert compiled[k]["loss"] == pytest.approx(eager[k]["loss"], rel=1e-4)
    # The checkpoint holds the plain model's parameter names: it exports like any other.
    from dsgpt2.infer.export import export

    assert export(tmp_path / "ckpt", tmp_path / "model")["step"] == 3


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


def test_dsgpt2_train_under_the_launcher_reads_an_experiment_file_and_records_the_resolved_one(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """`deepspeed --module dsgpt2 train --config run.toml` on two ranks: the file's flags, the command
    line over them; the resolved configuration in the run directory and the checkpoint runs again."""
    import socket

    import yaml

    from dsgpt2.train.config import parse

    flags = trainer_args(corpus, tmp_path, "--train_iters", "50", "--save_interval", "2")
    lines, i = [], 0
    while i < len(flags):  # `--name value` / `--name` pairs, the TOML a user would write
        name = flags[i][2:]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value = flags[i + 1]
            lines.append(f"{name} = {value if value.isdigit() else json.dumps(value)}")
            i += 2
        else:
            lines.append(f"{name} = true")
            i += 1
    run_file = tmp_path / "run.toml"
    run_file.write_text("\n".join(lines) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port)]
    result = subprocess.run(
        [*launcher, "--module", "dsgpt2", "train", "--config", str(run_file), "--train_iters", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"  # 4 from the command line
    assert [r["step"] for r in read_metrics(tmp_path / "ws" / "block_ids_rank1.jsonl")] == [1, 2, 3, 4]
    resolved = tmp_path / "ws" / "config.yaml"
    values = yaml.safe_load(resolved.read_text())
    assert values["train_iters"] == 4 and values["save_interval"] == 2 and values["context_length"] == 64
    assert values["log_block_ids"] is True and values["config_train"] == str(corpus["config"])
    assert (tmp_path / "ckpt" / "global_step4" / "config.yaml").read_text() == resolved.read_text()
    # The resolved file runs the same configuration again.
    again = parse(["--config", str(resolved)])
    from_file = parse(["--config", str(run_file), "--train_iters", "4"])
    assert again.to_dict() == from_file.to_dict()


def test_hellaswag_at_each_evaluation_on_two_zero3_ranks_equals_evaluating_the_checkpoint(
    corpus: dict[str, Path], tmp_path: Path, sample_texts: list[str]
) -> None:
    """--hellaswag on two gloo ranks under ZeRO-3: nine examples, four scored on each rank (the one
    left over left out, so both ranks run the same forwards), logged at every evaluation; the final
    record's accuracies are those `dsgpt2 evaluate --hellaswag` takes of the final checkpoint."""
    from corpora import examples

    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples(sample_texts, 9)))
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": 3}
    (tmp_path / "ds3.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds3.json")
    result = _launch(staged, tmp_path, 2, "--train_iters", "4", "--eval_interval", "2", "--save_interval",
                     "100", "--num_workers", "1", "--hellaswag", str(path))  # fmt: skip
    assert "HellaSwag: acc" in result.stdout + result.stderr
    evals = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["hellaswag_examples"] == 8 and "val_loss" in r for r in evals)
    end = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "end"][-1]
    assert end["hellaswag_acc"] == evals[-1]["hellaswag_acc"]

    report = tmp_path / "report.json"
    alone = run_cli("evaluate", "--model", str(tmp_path / "ckpt"), "--config", str(corpus["config"]),
                    "--hellaswag", str(path), "--hellaswag_limit", "8", "--report", str(report),
                    "--no_record")  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics["hellaswag_examples"] == 8
    assert metrics["hellaswag_acc"] == evals[-1]["hellaswag_acc"]
    assert metrics["hellaswag_acc_norm"] == evals[-1]["hellaswag_acc_norm"]


def test_a_bad_hellaswag_file_stops_the_run_before_it_starts(corpus: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "hellaswag_val.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    result = train(corpus, tmp_path, "--train_iters", "2", "--hellaswag", str(bad), check=False)
    assert result.returncode == 2
    assert "line 1 is not a HellaSwag example" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "ckpt").exists()


def test_fewer_hellaswag_examples_than_ranks_is_refused_before_training(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    from dsgpt2.errors import ConfigError
    from dsgpt2.train.config import parse
    from dsgpt2.train.validator import Validator

    one = tmp_path / "hellaswag_val.jsonl"
    one.write_text(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}) + "\n")
    cfg = parse(trainer_args(corpus, tmp_path, "--hellaswag", str(one)))
    assert len(Validator(cfg, None, 0, 1, 4, None, 64)._hellaswag) == 1
    with pytest.raises(ConfigError, match="1 example\\(s\\) for 2 ranks"):
        Validator(cfg, None, 1, 2, 4, None, 64)


def test_a_finished_run_leaves_its_process_group(corpus: dict[str, Path], tmp_path: Path) -> None:
    """The group is closed at the end of a run, not left to the interpreter's exit (where NCCL warns
    of it and gloo may abort a process that trained well)."""
    code = (
        "import sys, torch.distributed as dist; from dsgpt2.train import trainer; "
        "rc = trainer.main(sys.argv[1:]); print('group open after the run:', dist.is_initialized()); "
        "sys.exit(rc)"
    )
    args = trainer_args(corpus, tmp_path, "--train_iters", "2")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            timeout=deadline(300), cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "group open after the run: False" in result.stdout
