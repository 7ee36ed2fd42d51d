"""What the host-work benchmark counts: every aten op dispatched (inside compiled graphs and beneath
other ops too), top-level aten ops outside compiled graphs, and the time a device was busy (the union of
its kernels' intervals); what it compares: the trainer with the plain loop's optimizer; and that no
throughput figure of a run whose loss did not fall passes."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import bench_gpu, bench_host
from bench.bench_host import covered, dispatched, outside_compiled
from bench.common import learnt, loss_column, loss_fell
from training import CONTEXT, training_corpus


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


# Inductor imports torch.utils.mkldnn, which warns of its own torch.jit use: not ours.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_whole_count_takes_in_what_compiled_graphs_and_other_ops_dispatch() -> None:
    """A compiled graph's matmul is the host's work as much as an eager one's: the whole count has it,
    and what ``F.linear`` dispatches beneath itself; the count outside compiled graphs has neither."""
    torch._dynamo.reset()
    x, w = torch.randn(4, 3), torch.randn(2, 3)
    matmul = torch.compile(lambda a, b: (a @ b.t()).relu())
    matmul(x, w)  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        matmul(x, w)
        torch.nn.functional.linear(x, w, torch.zeros(2))
    whole, outside = dispatched(prof.events()), outside_compiled(prof.events())
    assert whole["aten::linear"] == 1 and whole["aten::addmm"] == 1  # beneath linear
    assert whole["aten::mm"] >= 1  # the compiled graph's extern matmul
    assert outside == {"aten::linear": 1, "aten::zeros": 1}
    assert sum(whole.values()) > 3


def test_a_run_whose_loss_did_not_fall_is_marked_fail() -> None:
    assert loss_fell(9.137, 6.80) and not loss_fell(9.137, 9.135) and not loss_fell(6.0, float("nan"))
    assert loss_column({"first_loss": 9.137, "last_loss": 6.8}) == "loss 9.137 → 6.800"
    assert loss_column({"first_loss": 9.137, "last_loss": 9.135}).endswith("FAIL, did not fall")
    assert loss_column({}).endswith("FAIL")
    ours = {"first_loss": 9.137, "last_loss": 9.135}
    assert not learnt(ours) and learnt({"first_loss": 9.1, "last_loss": 6.8})


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
        metrics = Path(argv[argv.index("--workspace") + 1]) / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text('{"event": "train", "loss": 9.1}\n{"event": "train", "loss": 7.2}\n')
        return 0

    monkeypatch.setattr(trainer, "main", fake_main)
    monkeypatch.setattr(bench_host._Window, "result", lambda self: {"ops": 1})
    s = bench_host.host_settings()
    spec: dict[str, Any] = {"settings": asdict(s), "tokenizer": "tok", "store": "c.json",
                            "model_config": "m.json", "work": str(tmp_path)}  # fmt: skip
    if optimizer:
        spec["optimizer"] = optimizer
    monkeypatch.setattr(bench_host, "spec_ds_config", lambda s, work: work / "ds.json")
    result = bench_host._ours(s, spec)
    argv = seen[0]
    assert argv[argv.index("--optimizer") + 1] == (optimizer or "adamw")
    assert argv[argv.index("--model_config") + 1] == "m.json" and "--model_select" not in argv
    assert (result["first_loss"], result["last_loss"]) == (9.1, 7.2)


@pytest.mark.slow  # DeepSpeed and a compile, on the tiny preset
# Inductor and DeepSpeed warn of torch APIs they call: not ours.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_profiled_busy_run_runs_on_a_cpu(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``bench train_gpu``'s ``busy`` run (the trainer profiled in process) on a CPU, as on a GPU: its
    preset and its DeepSpeed config, the loss at its first and last step (no kernels to time here). At the
    micro-batch and context of the other compiled runs (test_compiled_training.py), whose graph it is."""
    corpus = training_corpus(tmp_path_factory)
    ds = json.loads(corpus["ds"].read_text())
    micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    s = replace(bench_gpu.CPU, context=CONTEXT, micro=micro, accum=accum, warmup=1, steps=2)
    result = bench_gpu._busy(s, corpus["tok"], corpus["config"], tmp_path_factory.mktemp("busy"))
    assert result["busy"] is None and result["tokens_per_s"] > 0
    assert loss_fell(result["first_loss"], result["last_loss"]), result


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
