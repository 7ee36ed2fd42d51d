"""A compiled run trains the eager run's model, step by step: the same blocks, the same losses, and a loss
that falls (AdamW at ZeRO 0, Muon at ZeRO 1, Muon with the speedrun's options at ZeRO 2), and a checkpoint
that exports as an eager one does. Marked
``floor``: ``make test-floor`` runs it on every torch ``pyproject.toml`` admits, where a compiled loss with
no gradient once trained nothing at full speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import steps, train, training_corpus

pytestmark = [pytest.mark.slow, pytest.mark.floor]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


# The speedrun's options (Polar Express, cautious decay, a warmed-up momentum, a batch ramp) at ZeRO 2.
VARIANTS = ("--muon_ns", "polar_express", "--muon_cautious", "--muon_momentum_warmup", "3")
VARIANTS += ("--batch_ramp", "3")


@pytest.mark.parametrize(
    ("optimizer", "stage", "options"), [("adamw", 0, ()), ("muon", 1, ()), ("muon", 2, VARIANTS)]
)
def test_a_compiled_run_falls_as_the_eager_one_step_by_step(
    corpus: dict[str, Path], tmp_path: Path, optimizer: str, stage: int, options: tuple[str, ...]
) -> None:
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    common = ("--deepspeed_config", str(tmp_path / "ds.json"), "--optimizer", optimizer,
              "--train_iters", "6", "--save_interval", "100", *options)  # fmt: skip
    eager_run = train(corpus, tmp_path / "eager", *common, "--no_compile")
    compiled_run = train(corpus, tmp_path / "compiled", *common, "--compile")
    # The first step's compile (tens of seconds on a CPU) is said before it starts, not left silent;
    # without --compile nothing compiles, Muon's Newton–Schulz iteration included.
    compiling = "the first step compiles the model (--compile)" + " and Muon's Newton–Schulz iteration" * (
        optimizer == "muon"
    )
    said = compiled_run.stderr
    assert said.index(compiling + ": it takes longer") < said.index("step 1/"), said[-3000:]
    assert "the first step compiles" not in eager_run.stderr
    if optimizer == "adamw":  # what the run trains with, said once as Muon's is
        said = (
            "optimizer: AdamW (lr 0.003, betas 0.9, 0.999, eps 1e-08, weight decay 0.1 on the matrices and "
        )
        said += "embeddings), gradient clipping at 1; ZeRO stage 0"
        assert eager_run.stderr.count(said) == 1, eager_run.stderr[-3000:]
    eager, compiled = steps(tmp_path / "eager"), steps(tmp_path / "compiled")
    assert sorted(compiled) == sorted(eager) == list(range(1, 7))
    for k in eager:
        assert compiled[k]["block_ids"] == eager[k]["block_ids"]
        assert compiled[k]["loss"] == pytest.approx(eager[k]["loss"], rel=1e-3, abs=1e-4), k
        assert compiled[k]["grad_norm"] == pytest.approx(eager[k]["grad_norm"], rel=1e-2), k
    # It learns: six steps take the tiny model well below where it started (ln 512 = 6.24).
    assert compiled[6]["loss"] < compiled[1]["loss"] - 0.2, [round(compiled[k]["loss"], 3) for k in compiled]
    if stage == 0:
        # The checkpoint holds the plain model's parameter names: it exports like any other.
        from dsgpt2.infer.export import export

        assert export(tmp_path / "compiled" / "ckpt", tmp_path / "model")["step"] == 6
