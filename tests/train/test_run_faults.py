"""Faults during a run of ds_trainer.py: a stop signal, non-finite losses, a missing, damaged or unnamed
checkpoint, a database that fails for a moment or for good. The run saves a checkpoint or keeps the last
whole one, says what happened in one line, and the same command resumes."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, check_lineage, run_cli, write_config
from dsgpt2.train.metrics import read_metrics
from forks import python_that_forks
from pace import deadline
from training import steps, train, trainer_args, training_corpus, wait_for_steps
from wire_server import fail_point
from zygote import run_python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


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


def test_a_sigterm_after_the_last_step_ends_the_run_as_it_would_have(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A SIGTERM that lands during the last step stops nothing: the run ends done, its final checkpoint
    written, and says the signal changed nothing rather than that it is stopping."""
    result = train(corpus, tmp_path, "--train_iters", "3", "--save_interval", "100000",
                   faults=("--after", "3=kill -TERM $PPID"))  # fmt: skip
    # Sent after the step's work, before the loop looks: said as the last step's, however late the
    # announcement (a second later, or when the loop ends) comes on a loaded machine.
    said = [line for line in result.stderr.splitlines() if "SIGTERM" in line or "checkpoint" in line]
    assert "SIGTERM came with the last step: the run ends as it would have" in result.stderr, said
    assert "saving a checkpoint after the current step" not in result.stderr, said
    end = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "end"][-1]
    assert end["stopped"] == "done" and end["step"] == 3
    assert "stopped: done at step 3" in result.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"


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
    # The corpus's server not answering: one line at once, as every command says it (not a read's retries).
    same = json.loads(corpus["config"].read_text())  # the run's data, on a server that is not there
    same.update(MONGO_CONNECTION_STRING="mongodb://u:s3cret@127.0.0.1:1", SERVER_SELECTION_TIMEOUT_MS=500)
    gone = write_config(tmp_path / "gone.json", **same)
    started = time.monotonic()
    answer = run_cli("lineage", "--ckpt_dir", str(tmp_path / "once" / "ckpt"), "--doc", "stdlib:1",
                     "--config", str(gone))  # fmt: skip
    assert answer.returncode != 0 and answer.stderr.count("\n") == 1, answer.stderr
    assert "127.0.0.1:1" in answer.stderr and "s3cret" not in answer.stderr
    assert time.monotonic() - started < 30

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


def test_a_nonfinite_loss_trains_the_same_model_recomputed_or_guarded(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """ZeRO 0 keeps no hook: the step that met the NaN drops its gradients and recomputes the micro-batches
    before it; ZeRO 1 zeroes the NaN's gradients in its hooks. The same model either way."""
    runs = {}
    for stage in (0, 1):
        ds = json.loads(corpus["ds"].read_text())
        ds["gradient_accumulation_steps"] = 4
        ds["zero_optimization"] = {"stage": stage}
        where = tmp_path / f"zero{stage}"
        where.mkdir()
        (where / "ds.json").write_text(json.dumps(ds))
        # AdamW: its gradient norm is the gradients' at every stage (under Muon, ZeRO 1 reports the norm
        # of the orthogonalised updates DeepSpeed made of them).
        done = train(dict(corpus, ds=where / "ds.json"), where, "--train_iters", "3", "--optimizer", "adamw",
                     "--save_interval", "100", faults=("--nonfinite_at", "3"))  # fmt: skip
        assert "non-finite losses skipped: 1" in done.stdout
        runs[stage] = steps(where)
    assert sorted(runs[0]) == sorted(runs[1]) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = runs[0][step], runs[1][step]
        assert a["block_ids"] == b["block_ids"], step
        for x, y in zip(a["losses"], b["losses"], strict=True):
            assert abs(x - y) <= 1e-5, (step, x, y)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * max(1.0, a["grad_norm"]), step
    # Resumed under the other stage: the optimizer state is laid out for the stage it was saved under.
    for saved, other in ((0, 1), (1, 0)):
        moved = train(dict(corpus, ds=tmp_path / f"zero{other}" / "ds.json"), tmp_path / f"zero{saved}",
                      "--train_iters", "4", "--optimizer", "adamw", check=False)  # fmt: skip
        assert moved.returncode == 2 and "Traceback" not in moved.stderr, moved.stderr[-3000:]
        line = moved.stderr.strip().splitlines()[-1]
        assert f"zero{saved}/ckpt/global_step3 was saved under ZeRO stage {saved}, and this run's" in line
        assert f"has stage {other}" in line and "--init_from" in line, line


@pytest.mark.parametrize("fault", ["--no_gradient", "--detached_loss"])
def test_a_step_with_a_finite_loss_and_no_gradient_stops_the_run(
    corpus: dict[str, Path], tmp_path: Path, fault: str
) -> None:
    """A loss whose backward reaches no weight (what a compiled graph that lost its gradients gives, a
    detached loss) would train nothing at full speed: exit 2 at the first step, one line naming torch's
    version and --no_compile, no checkpoint. (The line under --compile: test_learning.py.)"""
    import torch

    # The first step is not a logged one: the check reads the norm there all the same.
    bad = train(corpus, tmp_path, "--train_iters", "4", "--save_interval", "1", "--log_interval", "10",
                check=False, faults=(fault,))  # fmt: skip
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    (line,) = [x for x in bad.stderr.splitlines() if "error:" in x]
    assert line.startswith("ds_trainer.py: error: step 1 learns nothing: ")
    assert f"under torch {torch.__version__}" in line and "the model is not compiled (--no_compile)" in line
    if fault == "--no_gradient":
        assert "its loss was " in line and " and its gradient norm 0, under torch" in line
    else:
        assert "its loss does not depend on the weights" in line
    assert not list((tmp_path / "ckpt").glob("global_step*"))


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
        [python_that_forks(), str(ROOT / "ds_trainer.py"), *args], cwd=ROOT, stderr=subprocess.PIPE, text=True
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
