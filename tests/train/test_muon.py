"""``--optimizer muon``: Muon on the blocks' matrices and AdamW on the rest, under ZeRO 0, 1 and 2 (the
same model at each stage), resumed exactly; bad flags, ZeRO 3 and a checkpoint of the other optimizer
refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dsgpt2.errors import ConfigError
from dsgpt2.train.config import OptimizerOptions, ScheduleOptions, TrainConfig
from dsgpt2.train.optim import MUON_LR, MUON_MOMENTUM, muon_param_groups
from dsgpt2.train.schedule import Schedule, ScheduledLR
from training import launch, steps, train, training_corpus

MUON = ("--optimizer", "muon", "--lr_schedule", "wsd", "--muon_lr", "0.03")
RUN = ("--train_iters", "6", "--save_interval", "3")


def tiny_model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    model = tiny_model()
    groups = muon_param_groups(model, {"weight_decay": 0.1, "betas": [0.9, 0.95]}, 1e-3, 0.02, 0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = [sorted(names[id(p)] for p in g["params"]) for g in groups]
    muon = by_group[-1]
    assert muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                          for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))  # fmt: skip
    assert groups[-1]["use_muon"] and groups[-1]["lr"] == 0.02 and groups[-1]["momentum"] == 0.9
    assert groups[-1]["lr_scale"] == pytest.approx(20.0) and groups[-1]["weight_decay"] == 0
    decayed, plain = by_group[:2]
    assert decayed == ["transformer.wpe.weight", "transformer.wte.weight"]  # the head is tied to wte
    assert all(".ln_" in n or n.endswith(".bias") or n.startswith("transformer.ln_f") for n in plain)
    assert [g["weight_decay"] for g in groups[:2]] == [0.1, 0.0]
    assert all(not g["use_muon"] and g["betas"] == (0.9, 0.95) and g["lr"] == 1e-3 for g in groups[:2])
    assert sum(len(g) for g in by_group) == len(list(model.parameters()))  # each weight once
    assert all(p.use_muon == g["use_muon"] for g in groups for p in g["params"])


def test_the_schedule_scales_each_groups_rate() -> None:
    import torch

    w = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [w], "lr": 1.0}, {"params": [], "lr": 1.0, "lr_scale": 20.0}])
    sched = ScheduledLR(opt, Schedule("wsd", 1e-3, 100, 10, 0.1, 0.2))
    sched.step()
    adam, muon = (g["lr"] for g in opt.param_groups)
    assert adam == pytest.approx(2e-4) and muon == pytest.approx(20 * adam)
    assert sched.get_lr() == [adam, muon]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"optimizer": "sgd"}, "--optimizer"),
        ({"muon_lr": 0.01}, "--muon_lr set the Muon optimizer, and this run trains with --optimizer adamw"),
        ({"muon_momentum": 0.9}, "add --optimizer muon, or drop --muon_momentum"),
        ({"optimizer": "muon", "muon_lr": -0.1}, "--muon_lr"),
        ({"optimizer": "muon", "muon_lr": 0.0}, "--muon_lr"),
        ({"optimizer": "muon", "muon_momentum": -0.5}, "--muon_momentum"),
        ({"optimizer": "muon", "muon_momentum": 1.0}, "--muon_momentum 1.0: must be in [0, 1)"),
    ],
)
def test_bad_optimizer_options_are_one_line(options: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        OptimizerOptions(**options)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_muon_needs_its_own_schedule(tmp_path: Path) -> None:
    from dsgpt2.train.config import DataOptions

    with pytest.raises(ConfigError, match="--optimizer muon: add --lr_schedule wsd"):
        TrainConfig(DataOptions(None), optim=OptimizerOptions(optimizer="muon"))
    muon = TrainConfig(
        DataOptions(None),
        schedule=ScheduleOptions(lr_schedule="wsd"),
        optim=OptimizerOptions(optimizer="muon"),
    )
    assert muon.to_dict()["optimizer"] == "muon" and MUON_LR == 0.02 and MUON_MOMENTUM == 0.95


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


def _staged(corpus: dict[str, Path], where: Path, stage: int) -> dict[str, Path]:
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    where.mkdir(parents=True, exist_ok=True)
    (where / "ds.json").write_text(json.dumps(ds))
    return dict(corpus, ds=where / "ds.json")


@pytest.fixture(scope="module")
def straight(corpus: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six Muon steps at ZeRO 0 without a stop."""
    run = tmp_path_factory.mktemp("muon_straight")
    done = train(_staged(corpus, run, 0), run, *MUON, *RUN)
    assert "optimizer: Muon (lr 0.03, momentum 0.95)" in done.stderr
    assert "gradient clipping (1.0 in the DeepSpeed config) is off" in done.stderr
    return run


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_muon_trains_the_same_model_at_each_zero_stage_and_resumes_exactly(
    corpus: dict[str, Path], straight: Path, tmp_path: Path, stage: int
) -> None:
    staged = _staged(corpus, tmp_path, stage)
    crashed = train(staged, tmp_path, *MUON, *RUN, check=False, faults=("--exit_after", "5"))
    assert crashed.returncode == 17
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step3"
    train(staged, tmp_path, *MUON, *RUN)
    a, b = steps(straight), steps(tmp_path)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        for x, y in zip(a[step]["losses"], b[step]["losses"], strict=True):
            assert abs(x - y) <= 1e-5, (stage, step, x, y)
    assert a[6]["loss"] < a[1]["loss"] - 0.5
    assert b[6]["lr"] == pytest.approx(a[6]["lr"])

    if stage == 1:
        return
    # The checkpoint holds Muon's state: AdamW cannot resume it, in one line.
    other = train(staged, tmp_path, "--lr_schedule", "wsd", *RUN, check=False)
    assert other.returncode == 2, other.stderr[-2000:]
    (line,) = other.stderr.strip().splitlines()
    assert "was trained with --optimizer muon and this run asks for --optimizer adamw" in line


@pytest.mark.slow
def test_muon_under_zero_3_or_with_bad_flags_is_refused_before_the_model_is_built(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    staged = _staged(corpus, tmp_path, 3)
    for extra, said in (
        (MUON, "--optimizer muon trains under ZeRO stage 0, 1 or 2"),
        (("--optimizer", "sgd"), "--optimizer"),
        (("--muon_lr", "0.01"), "--muon_lr set the Muon optimizer"),
        (("--optimizer", "muon", "--lr_schedule", "wsd", "--muon_momentum", "-1"), "--muon_momentum"),
    ):
        out = train(staged, tmp_path / "run", *extra, "--train_iters", "2", check=False)
        assert out.returncode == 2, out.stderr[-2000:]
        (line,) = out.stderr.strip().splitlines()
        assert said in line and "model " not in out.stderr


@pytest.mark.slow
def test_a_muon_run_of_two_ranks_resumes_on_one(corpus: dict[str, Path], tmp_path: Path) -> None:
    """ZeRO 0 (every rank holds the whole Muon state): another number of ranks resumes it."""
    staged = _staged(corpus, tmp_path, 0)
    launch(staged, tmp_path, 2, *MUON, "--train_iters", "4", "--save_interval", "4", "--num_workers", "1")
    resumed = train(staged, tmp_path, *MUON, "--train_iters", "6", "--save_interval", "4")
    assert "was saved by 2 rank(s); this run has 1" in resumed.stderr
    assert sorted(steps(tmp_path)) == list(range(1, 7)) and all(
        math.isfinite(r["loss"]) for r in steps(tmp_path).values()
    )


PLAIN = """
import json, sys
from transformers import GPT2LMHeadModel, pipeline
model = GPT2LMHeadModel.from_pretrained(sys.argv[1])
generate = pipeline("text-generation", model=sys.argv[1])
text = generate("def", max_new_tokens=5, do_sample=False)[0]["generated_text"]
print(json.dumps({"dsgpt2": "dsgpt2" in sys.modules, "text": text, "class": type(model).__name__}))
"""


@pytest.mark.slow
def test_the_fast_recipe_exports_a_plain_model_that_evaluates_as_trained(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from dsgpt2.checkpoints.weights import RUN_INFO
    from dsgpt2.db.config import load_config
    from dsgpt2.infer.evaluate import evaluate
    from dsgpt2.infer.loading import load_model
    from dsgpt2.infer.settings import EvalRequest
    from dsgpt2.train.metrics import read_metrics

    recipe = ROOT / "configs" / "recipes" / "fast.yaml"
    done = train(corpus, tmp_path, "--config", str(recipe), "--train_iters", "8", "--eval_interval", "8",
                 "--eval_iters", "4", "--save_interval", "8", "--warmup_iters", "2")  # fmt: skip
    assert "optimizer: Muon (lr 0.02, momentum 0.95)" in done.stderr
    last = [r for r in read_metrics(tmp_path / "ws" / "metrics.jsonl") if r["event"] == "eval"][-1]
    assert last["step"] == 8
    # As a user's shell runs it: no DS_ACCELERATOR (the test process may have set one).
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "MONGO_CONNECTION_STRING")}
    export = [sys.executable, "-m", "dsgpt2", "export", "--ckpt_dir", str(tmp_path / "ckpt"), "--out",
              str(tmp_path / "hf")]  # fmt: skip
    out = subprocess.run(export, capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout.startswith("exported "), out.stderr  # no DeepSpeed warning
    assert json.loads((tmp_path / "hf" / RUN_INFO).read_text())["task"] == "lm"  # chat refuses it
    plain = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / "hf")], capture_output=True,
                           text=True, check=True)  # fmt: skip
    got = json.loads(plain.stdout.strip().splitlines()[-1])
    assert got["class"] == "GPT2LMHeadModel" and not got["dsgpt2"] and got["text"].startswith("def")
    request = EvalRequest(batch_size=4, max_batches=4, workers=0)
    report = evaluate(load_model(tmp_path / "hf"), load_config(corpus["config"]), request, progress=False)
    assert report["metrics"]["perplexity"] == pytest.approx(last["val_ppl"], rel=1e-5)
