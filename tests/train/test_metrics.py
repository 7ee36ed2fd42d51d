"""The run's metrics file and its loss plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dsgpt2.train.metrics import plot_losses


def _legend(monkeypatch: pytest.MonkeyPatch, metrics: Path, out: Path) -> list[str]:
    """The legend of the plot drawn from ``metrics``, read as the figure is saved."""
    from matplotlib.figure import Figure

    seen: list[str] = []
    save = Figure.savefig

    def savefig(fig: Figure, *args: Any, **kwargs: Any) -> None:
        seen.extend(t.get_text() for t in fig.axes[0].get_legend().get_texts())
        save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    assert plot_losses(metrics, out) == out and out.stat().st_size > 1000
    return seen


def test_the_validation_curve_is_labelled_with_its_last_bits_per_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = [
        {"event": "train", "step": 1, "loss": 6.0},
        {"event": "eval", "step": 1, "val_loss": 5.5, "val_ppl": 244.7, "val_bpb": 2.5},
        {"event": "train", "step": 2, "loss": 5.0},
        {"event": "eval", "step": 2, "val_loss": 4.5, "val_ppl": 90.0, "val_bpb": 2.0468},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _legend(monkeypatch, metrics, tmp_path / "loss.png") == [
        "train loss",
        "validation loss (step 2: 2.047 bits per byte)",
    ]
    # A run recorded before bits per byte was: the label alone.
    older = [{k: v for k, v in r.items() if k != "val_bpb"} for r in records]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in older))
    assert _legend(monkeypatch, metrics, tmp_path / "old.png")[1] == "validation loss"


def test_a_record_cut_short_by_a_killed_run_is_kept_apart_and_skipped_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed while writing a record leaves a line with no end; the resumed run's records start on
    a line of their own, and reading the file (its loss plot, the demo's summary) skips the torn line
    with a warning instead of ending the finished run in a traceback."""
    from dsgpt2.train.metrics import MetricsLog, read_metrics

    caplog.set_level("WARNING")
    metrics = tmp_path / "metrics.jsonl"
    whole = json.dumps({"event": "train", "step": 1, "loss": 6.0})
    metrics.write_text(whole + "\n" + whole.replace("1", "2")[:25])
    log = MetricsLog(tmp_path, "off", None, {})
    log.write({"event": "train", "step": 2, "loss": 5.0})
    log.close()
    assert "ends mid-record" in caplog.text
    lines = metrics.read_text().splitlines()
    assert lines[1] == whole.replace("1", "2")[:25] and json.loads(lines[2])["step"] == 2
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2]
    assert f"{metrics}: 1 line(s) that are no whole record skipped (line 2)" in caplog.text
    assert _legend(monkeypatch, metrics, tmp_path / "loss.png") == ["train loss"]
    caplog.clear()
    MetricsLog(tmp_path, "off", None, {}).close()  # a whole file: nothing said, nothing added
    assert caplog.text == "" and len(metrics.read_text().splitlines()) == 3
