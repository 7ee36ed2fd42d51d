"""What ds_trainer.py refuses before it trains, in one line: bad flags, a bad DeepSpeed config, a
malformed HellaSwag file, fewer HellaSwag examples than ranks, a model too large for the machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import train, trainer_args, training_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--model_select", "huge"], "--model_select"),
        (["--train_iters", "-5"], "--train_iters"),
        (["--tr_ratio", "1.5"], "--tr_ratio"),
        (["--tr_ratio", "0"], "--tr_ratio"),
        (["--config_train", "/nonexistent.json"], "--config_train"),
        (["--vocab_dir", "/nonexistent"], "--vocab_dir"),
        (["--attn_implementation", "flash_attention_2"], "--attn_implementation"),
        (["--lr_schedule", "wsd", "--warmup_iters", "50", "--train_iters", "20"], "--warmup_iters 50"),
        (["--decay_fraction", "1.5"], "--decay_fraction"),
        (["--read_order", "random"], "--read_order"),
    ],
)
def test_bad_flags_are_one_line_errors(
    corpus: dict[str, Path], tmp_path: Path, flags: list[str], needle: str
) -> None:
    result = train(corpus, tmp_path, *flags, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr


def test_deepspeed_config_problems_are_one_line_errors(corpus: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}')
    malformed = tmp_path / "malformed.json"
    malformed.write_text("{nope")
    stage = tmp_path / "stage.json"
    stage.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 5}}')
    cases = ((bad, "train_batch_size 10"), (malformed, "not valid JSON"), (stage, "stage must be"))
    for path, needle in cases:
        result = train(dict(corpus, ds=path), tmp_path, check=False)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "--deepspeed_config" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_bad_hellaswag_file_stops_the_run_before_it_starts(corpus: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "hellaswag_val.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n')
    result = train(corpus, tmp_path, "--train_iters", "2", "--hellaswag", str(bad), check=False)
    assert result.returncode == 2
    assert "line 1 is not a HellaSwag example" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "ckpt").exists()


def test_fewer_hellaswag_examples_than_ranks_is_refused_before_training(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    from dsgpt2.errors import ConfigError
    from dsgpt2.train.config import parse
    from dsgpt2.train.validator import Validator

    one = tmp_path / "hellaswag_val.jsonl"
    one.write_text(json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}) + "\n")
    cfg = parse(trainer_args(corpus, tmp_path, "--hellaswag", str(one)))
    assert (
        len(
            Validator(
                cfg.run,
                None,
                vocab_dir=cfg.data.vocab_dir,
                rank=0,
                world=1,
                micro_batch=4,
                doc_mask_eot=None,
                context=64,
            )._hellaswag
        )
        == 1
    )
    with pytest.raises(ConfigError, match="1 example\\(s\\) for 2 ranks"):
        Validator(
            cfg.run,
            None,
            vocab_dir=cfg.data.vocab_dir,
            rank=1,
            world=2,
            micro_batch=4,
            doc_mask_eot=None,
            context=64,
        )


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    """A position table of 2^40 rows: the run used to start, then end in out of memory (exit 1)."""
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 2**40}))
    result = train(corpus, tmp_path, "--model_config", str(model), check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "the model cannot fit this machine" in line and "n_positions in --model_config" in line
    assert "Traceback" not in result.stderr and not (tmp_path / "ckpt").exists()
