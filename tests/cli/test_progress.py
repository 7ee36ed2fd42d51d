"""Progress wherever stderr goes: a bar on a terminal, a log line every DSGPT2_PROGRESS_SECONDS in a file or
a pipe, nothing with --no_progress; training's line per log step and per evaluation."""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tqdm import tqdm

from conftest import run_cli, store_config
from dsgpt2.errors import ConfigError
from dsgpt2.progress import ENV_SECONDS, LogLines, progress
from dsgpt2.train.runlog import RunLog


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Any:
    """The messages the ``dsgpt2`` loggers log at INFO (caught on ``dsgpt2`` itself: once the CLI has set
    logging up in this process, it no longer propagates to the root logger)."""
    logger = logging.getLogger("dsgpt2")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # each record caught once
    yield lambda name: [r.getMessage() for r in caplog.records if r.name == name]
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)
    logger.propagate = propagate


def test_a_line_at_each_interval_with_count_percent_rate_and_time_left(logged: Any) -> None:
    now = [0.0]
    bar = LogLines("vocab download", "doc", total=100, initial=0, every=10.0, clock=lambda: now[0])
    for t, n in [(4, 10), (10, 10), (15, 10), (20, 20), (22, 50)]:
        now[0] = t
        bar.update(n)
    bar.close()
    bar.update(5)  # after close: nothing
    bar.close()
    assert logged("dsgpt2.progress") == [
        "vocab download: 20/100 doc (20.0%), 2.0 doc/s, 40s left",
        "vocab download: 50/100 doc (50.0%), 2.5 doc/s, 20s left",
        "vocab download: 100/100 doc (100.0%), 4.5 doc/s",  # the last count, at close
    ]


def test_a_resumed_count_without_total_rates_only_the_new_work_and_shows_the_postfix(logged: Any) -> None:
    now = [0.0]
    bar = LogLines("t.jsonl", "doc", total=None, initial=1000, every=0.0, clock=lambda: now[0])
    now[0] = 2.0
    bar.set_postfix(loss="3.1416")
    bar.update(10)
    bar.close()  # nothing moved since the last line: no line
    assert logged("dsgpt2.progress") == ["t.jsonl: 1,010 doc, 5.0 doc/s, loss=3.1416"]


def test_a_short_job_logs_nothing_before_its_interval(logged: Any) -> None:
    bar = LogLines("index a", "doc", total=None, initial=0, every=30.0, clock=lambda: 1.0)
    bar.update(500)
    bar.close()
    assert logged("dsgpt2.progress") == []


def test_lines_without_a_terminal_a_bar_on_one_nothing_when_disabled(
    logged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SECONDS, "0")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress("evaluate", "batch", total=4)
    assert isinstance(bar, LogLines)
    bar.update(1)
    bar.close()
    assert [m.split(",")[0] for m in logged("dsgpt2.progress")] == ["evaluate: 1/4 batch (25.0%)"]
    assert sys.stderr.getvalue() == ""  # the lines go through logging, no bar drawn

    off = progress("evaluate", "batch", total=4, enabled=False)
    off.update(4)
    off.set_postfix(loss="1.0")
    off.close()
    assert len(logged("dsgpt2.progress")) == 1 and sys.stderr.getvalue() == ""

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = progress("evaluate", "batch", total=4)
    assert isinstance(bar, tqdm)
    bar.update(2)
    bar.close()
    assert "evaluate:" in terminal.getvalue() and "2/4" in terminal.getvalue()
    assert len(logged("dsgpt2.progress")) == 1  # no line on a terminal


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_interval_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_SECONDS, value)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with pytest.raises(ConfigError, match=f"{ENV_SECONDS}='{value}': not a number of seconds"):
        progress("ingest", "doc")


def _runlog(tmp_path: Path) -> RunLog:
    run = SimpleNamespace(workspace=tmp_path / "ws", wandb="off", wandb_dir=None, log_interval=1,
                          train_iters=4, log_block_ids=False)  # fmt: skip
    return RunLog(run, {}, resolved="{}\n", rank=0, world=1, flops_per_token=1.0, peak_flops=None,  # type: ignore[arg-type]
                  start=(0, 0))  # fmt: skip


def _two_steps(runlog: RunLog) -> None:
    with runlog.open():
        for step in (1, 2):
            runlog.stepped(step, [])
            runlog.log_train(step, 1000 * step, [torch.tensor(2.5)], [], 3e-4)
        runlog.log_eval({"event": "eval", "step": 2, "val_loss": 2.0, "val_ppl": 7.389056, "val_bpb": 1.25,
                         "val_tokens": 4096, "eval_iters": 8})  # fmt: skip
    assert runlog.metrics is not None
    runlog.metrics.close()


def test_training_without_a_terminal_logs_each_log_step_and_evaluation(
    tmp_path: Path, logged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    _two_steps(_runlog(tmp_path))
    lines = logged("dsgpt2.train.runlog")
    assert [line.split(",")[0] for line in lines] == ["step 1/4: loss 2.5000", "step 2/4: loss 2.5000",
                                                      "step 2: validation loss 2.0000"]  # fmt: skip
    assert ", lr 3.00e-04, " in lines[0] and lines[0].endswith(" tokens/s")
    # What the figure covers: training validates on a sample of the split, `dsgpt2 evaluate` on all of it.
    assert (
        lines[2]
        == "step 2: validation loss 2.0000, perplexity 7.39, bpb 1.250 on 4,096 tokens (--eval_iters 8)"
    )
    assert sys.stderr.getvalue() == ""  # no bar


def test_training_on_a_terminal_keeps_the_bar_and_logs_no_step_line(
    tmp_path: Path, logged: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _two_steps(_runlog(tmp_path))
    assert logged("dsgpt2.train.runlog") == []
    assert (
        "train:" in terminal.getvalue()
        and "2/4" in terminal.getvalue()
        and "loss=2.500" in terminal.getvalue()
    )


def test_ingest_and_curate_into_a_file_log_progress_lines_and_no_progress_none(tmp_path: Path) -> None:
    """stderr of these commands is a file here, as under a scheduler or nohup."""
    cfg, _ = store_config(tmp_path)
    txt = tmp_path / "t.txt"
    txt.write_text("".join(f"document number {i}\n" for i in range(20)))
    every = {ENV_SECONDS: "0"}
    result = run_cli("ingest", "--config", str(cfg), str(txt), env=every)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "dsgpt2.progress: " in line]
    assert len(lines) == 20 and "t.txt" in lines[0], result.stderr
    assert ": 1 doc, " in lines[0] and ": 20 doc, " in lines[-1]
    assert all(line.endswith(" doc/s") for line in lines)
    assert "\r" not in result.stderr  # no bar redrawn into the file

    result = run_cli("curate", "--config", str(cfg), "--batch_size", "8", env=every)
    assert result.returncode == 0, result.stderr
    shown = [
        line.split("dsgpt2.progress: ")[1]
        for line in result.stderr.splitlines()
        if "dsgpt2.progress: " in line
    ]
    assert [m.split(",")[0] for m in shown] == ["curate a: 8 doc", "curate a: 16 doc", "curate a: 20 doc"]

    more = tmp_path / "more.txt"
    more.write_text("".join(f"another document {i}\n" for i in range(20)))
    quiet = run_cli("ingest", "--config", str(cfg), "--no_progress", str(more), env=every)
    assert quiet.returncode == 0 and "20 inserted" in quiet.stdout, quiet.stderr
    assert "dsgpt2.progress" not in quiet.stderr and "doc/s" not in quiet.stderr


def test_a_bad_interval_stops_a_command_with_one_line(tmp_path: Path) -> None:
    cfg, _ = store_config(tmp_path)
    txt = tmp_path / "t.txt"
    txt.write_text("one\n")
    result = run_cli("ingest", "--config", str(cfg), str(txt), env={ENV_SECONDS: "soon"})
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{ENV_SECONDS}='soon'" in line and "unset it for the default 30" in line
    again = run_cli("ingest", "--config", str(cfg), str(txt))  # refused before any work: a fresh start
    assert again.returncode == 0 and "1 inserted" in again.stdout and "resuming" not in again.stderr
