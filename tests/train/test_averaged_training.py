"""``--ema_tail`` in real runs: the checkpoint a run ends on reads as the average of its last steps' weights
(what export and evaluate load), its last validation measures that average, and a run killed in the tail
resumes to the same average, at ZeRO 0 and 2. The tiny preset on CPU, through ds_trainer.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsgpt2.checkpoints.format import load_states
from dsgpt2.checkpoints.weights import load_weights
from dsgpt2.train.metrics import read_metrics
from training import at_stage, train, training_corpus

pytestmark = pytest.mark.slow

AVERAGED = ("--train_iters", "6", "--ema_tail", "3", "--save_interval", "1", "--keep_last", "0")
NAMES = ("transformer.wte.weight", "transformer.h.0.mlp.c_fc.weight", "transformer.ln_f.bias")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_run_ends_on_the_average_of_its_last_steps_and_resumes_it_exactly(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    staged = at_stage(corpus, tmp_path / "cfg", stage)
    straight = train(staged, tmp_path / "straight", *AVERAGED)
    assert "weight average: from step 4, an EMA of span 3 (--ema_tail)" in straight.stderr
    ckpt = tmp_path / "straight" / "ckpt"
    raw = {s: load_states(ckpt, f"global_step{s}")["module"] for s in (4, 5, 6)}
    _, weights, _, _ = load_weights(ckpt)  # what export and evaluate read
    for name in NAMES:
        want = raw[4][name].float()
        for s in (5, 6):
            want = want + 0.5 * (raw[s][name].float() - want)
        torch.testing.assert_close(weights[name], want, rtol=0, atol=1e-6)
        assert not torch.equal(weights[name], raw[6][name].float()), name
    if "lm_head.weight" in weights:
        assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    evals = [r for r in read_metrics(tmp_path / "straight" / "ws" / "metrics.jsonl") if r["event"] == "eval"]
    assert evals[-1]["step"] == 6 and evals[-1].get("averaged") is True
    assert all("averaged" not in r for r in evals[:-1])

    killed = train(staged, tmp_path / "split", *AVERAGED, check=False, faults=("--exit_after", "5"))
    assert killed.returncode == 17
    train(staged, tmp_path / "split", *AVERAGED)
    _, again, _, _ = load_weights(tmp_path / "split" / "ckpt")
    for name in NAMES:
        torch.testing.assert_close(again[name], weights[name], rtol=0, atol=1e-6)


def test_a_tail_longer_than_the_run_is_refused_before_it_starts(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    out = train(corpus, tmp_path / "run", "--train_iters", "4", "--ema_tail", "5", check=False)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--ema_tail 5: must be at most --train_iters 4" in line
