"""One run of the tiny preset on one rank, from start to end: the loss falls and validation is reported,
a line per log step on a file, the recipe flags and an extended resume's learning-rate curve, wandb
offline without the password, a token cache made ahead and reused, the process group closed at the end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from dsgpt2.train.metrics import read_metrics
from pace import deadline
from training import steps, train, trainer_args, training_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


def test_loss_falls_and_validation_is_reported(corpus: dict[str, Path], tmp_path: Path) -> None:
    result = train(corpus, tmp_path, "--train_iters", "40", "--eval_interval", "20", "--save_interval", "100")
    records = read_metrics(tmp_path / "ws" / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    first = next(r for r in records if r["event"] == "train")
    assert first["loss"] > math.log(512) - 0.5  # a fresh model is near uniform over the vocabulary
    assert evals[-1]["val_loss"] < first["loss"] - 0.5
    assert math.isclose(evals[-1]["val_ppl"], math.exp(evals[-1]["val_loss"]), rel_tol=1e-9)
    # Bits per byte: the same summed loss in bits over the held-out bytes (a 512-token vocabulary's
    # tokens hold between one and a few bytes, so it lies between loss / ln 2 and a fraction of it).
    bits_per_token = evals[-1]["val_loss"] / math.log(2)
    assert bits_per_token / 6 < evals[-1]["val_bpb"] < bits_per_token
    assert (tmp_path / "ws" / "loss.png").stat().st_size > 1000
    assert "validation: loss" in result.stdout and "perplexity" in result.stdout
    # The figure says what it covers, and why `dsgpt2 evaluate` differs from it.
    covered = (
        f"on {evals[-1]['val_tokens']:,} tokens, the first {evals[-1]['eval_iters']} batches of the split"
    )
    assert covered in result.stdout and "`dsgpt2 evaluate` reads all of it" in result.stdout
    micro = json.loads(corpus["ds"].read_text())["train_micro_batch_size_per_gpu"]
    assert 0 < evals[-1]["val_tokens"] <= evals[-1]["eval_iters"] * micro * 64  # batches x rows x context
    assert f"bpb {evals[-1]['val_bpb']:.3f}" in result.stdout
    # Neither DeepSpeed's accelerator guess nor transformers' loss_type notice on every run.
    assert "Setting accelerator" not in result.stderr and "loss_type" not in result.stderr
    # The communication op loaded from the cache (the suite built it first) is no news: no "built" line.
    assert "built successfully" not in result.stdout + result.stderr
    assert "communication op compiled" not in result.stderr
    # Muon, the default, without --compile (a CPU's default): its Newton–Schulz iteration runs eagerly.
    assert "the first step compiles" not in result.stderr
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
        f"step {r['step']}: validation loss {r['val_loss']:.4f}, perplexity {r['val_ppl']:.2f}, "
        f"bpb {r['val_bpb']:.3f} on {r['val_tokens']:,} tokens (--eval_iters {r['eval_iters']})"
        for r in evals
    ] and [r["step"] for r in evals] == [2, 4]
    assert "\r" not in result.stderr and "step/s" not in result.stderr  # no bar redrawn into the file


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
    # A cache with nothing to train on (a conversation task on text documents): said, exit 2.
    empty = run_cli("tokenize", *flags[:5], str(tmp_path / "chats"), *flags[6:], "--task", "conversation",
                    "--no_progress")  # fmt: skip
    assert empty.returncode == 2, empty.stderr
    assert (
        "no training tokens" in empty.stderr
        and "--task conversation on documents without turns?" in empty.stderr
    )


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
    from dsgpt2.optim.schedule import Schedule, lr_at
    from dsgpt2.tokenizer.bpe import load_vocab_size

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


def _trainer_main_in_a_fresh_process(
    code: str, corpus: dict[str, Path], tmp_path: Path
) -> subprocess.CompletedProcess:
    """``code`` (which calls ``trainer.main(sys.argv[1:])``) in a new interpreter, not a zygote fork, on
    a two-step run of ``corpus``; its exit checked."""
    args = trainer_args(corpus, tmp_path, "--train_iters", "2")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                            timeout=deadline(300), cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_finished_run_leaves_its_process_group(corpus: dict[str, Path], tmp_path: Path) -> None:
    """The group is closed at the end of a run, not left to the interpreter's exit (where NCCL warns
    of it and gloo may abort a process that trained well)."""
    code = (
        "import sys, torch.distributed as dist; from dsgpt2.train import trainer; "
        "rc = trainer.main(sys.argv[1:]); print('group open after the run:', dist.is_initialized()); "
        "sys.exit(rc)"
    )
    result = _trainer_main_in_a_fresh_process(code, corpus, tmp_path)
    assert "group open after the run: False" in result.stdout


def test_a_run_builds_without_the_collectors_full_passes_and_trains_with_its_start_up_frozen(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Between the start of a run (DeepSpeed, transformers and the model imported, the engine built)
    and its first step the cyclic collector makes one full pass, not one per few hundred thousand new
    objects; what the start-up made is frozen, and the collector is on for the training loop."""
    code = (
        "import gc, sys; from dsgpt2.train import trainer; full = []; seen = []\n"
        "gc.callbacks.append(lambda phase, info: full.append(1) if phase == 'start' and "
        "info['generation'] == 2 else None)\n"
        "frozen = gc.get_freeze_count()\n"
        "def after_step(step):\n"
        "    if step == 1: seen.extend([len(full), gc.get_freeze_count() - frozen, gc.isenabled()])\n"
        "rc = trainer.main(sys.argv[1:], after_step=after_step); print('seen:', *seen); sys.exit(rc)"
    )
    result = _trainer_main_in_a_fresh_process(code, corpus, tmp_path)
    [line] = [line for line in result.stdout.splitlines() if line.startswith("seen:")]
    passes, frozen, enabled = line.split()[1:]
    assert int(passes) == 1, line
    assert int(frozen) > 500_000, line
    assert enabled == "True", line
