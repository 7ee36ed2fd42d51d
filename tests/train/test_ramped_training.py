"""``--batch_ramp``: the early steps take fewer micro-batches, each step's tokens say so, a run resumed
mid-ramp retraces a straight one and its lineage holds, and a ramp step trains as a run of that batch
does (the loss scaled by its own micro-batches, not the config's) at ZeRO 0, 1 and 2. Real DeepSpeed
runs of the tiny preset on CPU, through ds_trainer.py as a user starts it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import check_lineage
from dsgpt2.train.metrics import read_metrics
from training import at_stage, launch, steps, train, training_corpus

pytestmark = pytest.mark.slow

# The test corpus's config: micro-batch 4, 2 micro-batches a step. Ramped over 6 steps: steps 1-6 take 1,
# steps 7 and 8 take 2; the crashed run resumes from step 4, mid-ramp.
RAMP = ("--train_iters", "8", "--save_interval", "4", "--batch_ramp", "6")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


def test_a_ramped_run_takes_fewer_micro_batches_first_and_resumes_mid_ramp_exactly(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Steps 1-6 read 4 blocks, 7 and 8 read 8, their tokens in proportion; killed after step 6 and
    resumed from step 4 without the flag, the run retraces the straight one and lineage replays it."""
    straight = train(corpus, tmp_path / "straight", *RAMP)
    assert "batch ramp: 4 sequences a step at first, 1 stage(s) below the full 8, which step 7 on take" in (
        straight.stderr
    )
    a = steps(tmp_path / "straight")
    assert [len(a[s]["block_ids"]) for s in range(1, 9)] == [4] * 6 + [8] * 2
    tokens = [a[s]["tokens"] - (a[s - 1]["tokens"] if s > 1 else 0) for s in range(1, 9)]
    assert tokens[:6] == [tokens[0]] * 6 and tokens[6:] == [2 * tokens[0]] * 2, tokens

    crashed = train(corpus, tmp_path / "split", *RAMP, check=False, faults=("--exit_after", "6"))
    assert crashed.returncode == 17
    # Resumed without the flag: the checkpoint's ramp goes on, said in one line.
    resumed = train(corpus, tmp_path / "split", *RAMP[:-2])
    assert re.search(r"the checkpoint to resume was trained with .*--batch_ramp 6: this run", resumed.stderr)
    b = steps(tmp_path / "split")
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        assert a[step]["loss"] == pytest.approx(b[step]["loss"], abs=1e-6), step
    check_lineage(tmp_path / "split" / "ckpt", tmp_path / "split" / "ws", corpus["config"], {"stdlib": 2000})


def test_two_ranks_ramp_together_at_zero_2_and_the_lineage_names_each_rank(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """Two gloo ranks under the launcher, ZeRO 2: each rank's steps 1 and 2 take one micro-batch (4
    blocks), steps 3 and 4 two; the run's tokens a step double with them; lineage replays both ranks."""
    staged = at_stage(corpus, tmp_path / "cfg", 2)
    run = tmp_path / "run"
    launch(staged, run, 2, "--train_iters", "4", "--batch_ramp", "2")
    for rank in (0, 1):
        ids = {r["step"]: r["block_ids"] for r in read_metrics(run / "ws" / f"block_ids_rank{rank}.jsonl")}
        assert [len(ids[s]) for s in (1, 2, 3, 4)] == [4, 4, 8, 8], rank
    tokens = [r["tokens"] for _, r in sorted(steps(run).items())]
    assert tokens[3] - tokens[2] == 2 * tokens[0] == 2 * (tokens[1] - tokens[0]), tokens
    check_lineage(run / "ckpt", run / "ws", corpus["config"], {"stdlib": 2000}, ranks=2)


def _one_micro_batch_a_step(corpus: dict[str, Path], where: Path) -> dict[str, Path]:
    ds = json.loads(corpus["ds"].read_text())
    where.mkdir(parents=True, exist_ok=True)
    (where / "ds.json").write_text(json.dumps({**ds, "gradient_accumulation_steps": 1}))
    return dict(corpus, ds=where / "ds.json")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_ramp_step_trains_as_a_run_of_its_batch(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    """The ramp's first three steps (one micro-batch each) against a run whose config takes one micro-batch
    a step: the same blocks, losses and gradient norms (a loss still divided by the config's 2
    accumulation steps would halve the norm); the fourth step takes both micro-batches."""
    ramped = at_stage(corpus, tmp_path / "ramped", stage)
    single = _one_micro_batch_a_step(ramped, tmp_path / "single")
    train(ramped, tmp_path / "r", "--train_iters", "4", "--batch_ramp", "3")
    train(single, tmp_path / "s", "--train_iters", "3")
    r, s = steps(tmp_path / "r"), steps(tmp_path / "s")
    for step in (1, 2, 3):
        assert r[step]["block_ids"] == s[step]["block_ids"], step
        assert r[step]["loss"] == pytest.approx(s[step]["loss"], abs=1e-5), step
        assert r[step]["grad_norm"] == pytest.approx(s[step]["grad_norm"], rel=1e-4), step
    assert len(r[4]["block_ids"]) == 8


def test_a_ramp_over_a_config_that_takes_one_micro_batch_is_refused(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    single = _one_micro_batch_a_step(corpus, tmp_path / "single")
    out = train(single, tmp_path / "run", "--train_iters", "4", "--batch_ramp", "3", check=False)
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--batch_ramp 3: the ramp rises to the DeepSpeed config's gradient_accumulation_steps" in line
    assert not (tmp_path / "run" / "ckpt").exists()
