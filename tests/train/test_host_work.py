"""What the host-work benchmark counts: top-level aten ops outside compiled graphs, and the time a
device was busy (the union of its kernels' intervals); and what it compares: the trainer with the
plain loop's optimizer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import bench_gpu, bench_host
from bench.bench_host import covered, outside_compiled


def test_busy_time_is_the_union_of_the_kernels_intervals() -> None:
    assert covered([]) == 0.0
    assert covered([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # overlap counted once, gaps not at all
    assert covered([(4.0, 5.0), (0.0, 10.0), (2.0, 3.0)]) == 10.0  # nested, in any order


def test_ops_are_counted_once_at_the_top_level() -> None:
    """``F.linear`` dispatches addmm (and a transpose) beneath it: one op for the host, not three."""
    x, w = torch.randn(4, 3), torch.randn(2, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.nn.functional.linear(x, w)
        x.add_(1.0)
    counts = outside_compiled(prof.events())
    assert counts == {"aten::linear": 1, "aten::add_": 1}


@pytest.mark.parametrize("optimizer", [None, "muon"])
def test_the_trainer_is_measured_with_the_plain_loops_optimizer(
    optimizer: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new run trains with Muon by default; the plain loop is AdamW's, so ours runs ``--optimizer adamw``
    unless the spec names Muon (the info line beside it)."""
    import dsgpt2.train.trainer as trainer

    seen: list[list[str]] = []

    def fake_main(argv: list[str], after_step: Any = None) -> int:
        seen.append(argv)
        return 0

    monkeypatch.setattr(trainer, "main", fake_main)
    monkeypatch.setattr(bench_host._Window, "result", lambda self: {"ops": 1})
    s = bench_host.host_settings()
    spec: dict[str, Any] = {"settings": asdict(s), "tokenizer": "tok", "store": "c.json",
                            "model_config": "m.json", "work": str(tmp_path)}  # fmt: skip
    if optimizer:
        spec["optimizer"] = optimizer
    monkeypatch.setattr(bench_host, "spec_ds_config", lambda s, work: work / "ds.json")
    bench_host._ours(s, spec)
    argv = seen[0]
    assert argv[argv.index("--optimizer") + 1] == (optimizer or "adamw")


def test_the_throughput_runs_name_their_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench train_gpu``'s ours: AdamW against the plain loop, Muon only where a run asks for it."""
    import subprocess

    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> Any:
        calls.append(cmd)
        raise RuntimeError("stop here")

    monkeypatch.setattr(subprocess, "run", fake_run)
    for optimizer in ("adamw", "muon"):
        with pytest.raises(RuntimeError, match="stop here"):
            bench_gpu._ours(bench_gpu.CPU, tmp_path, tmp_path / "c.json", tmp_path / optimizer, 0, True,
                            optimizer=optimizer)  # fmt: skip
    assert [c[c.index("--optimizer") + 1] for c in calls] == ["adamw", "muon"]
