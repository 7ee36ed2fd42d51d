"""Every ZeRO stage trains, resumes and exports a model that transformers loads as it was trained; the
chunked loss trains and validates as transformers' own, under ZeRO-3 too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsgpt2.train.metrics import read_metrics
from pace import deadline
from training import steps, train, training_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """2,000 sample documents in a file-backed store, and a 512-token vocabulary."""
    return training_corpus(tmp_path_factory)


EXPORT_CHECK = """
import json, sys, torch
from transformers import GPT2LMHeadModel, pipeline
model = GPT2LMHeadModel.from_pretrained(sys.argv[1]).eval()
ids = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    logits = model(input_ids=ids).logits[0].tolist()
generate = pipeline("text-generation", model=sys.argv[1])
text = generate("def", max_new_tokens=5, do_sample=False)[0]["generated_text"]
print(json.dumps({"logits": logits, "dsgpt2": "dsgpt2" in sys.modules, "text": text,
                  "tied": model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()}))
"""


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_resumes_and_exports(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from conftest import run_cli
    from dsgpt2.checkpoints.weights import checkpoint_state

    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds.json")
    train(staged, tmp_path, "--train_iters", "4", "--save_interval", "100")
    resumed = train(staged, tmp_path, "--train_iters", "6", "--save_interval", "100")
    assert "resumed from" in resumed.stderr and "at step 4" in resumed.stderr
    assert sorted(steps(tmp_path)) == list(range(1, 7))
    result = run_cli("export", "--ckpt_dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert "step 6" in result.stdout
    assert (tmp_path / "hf" / "model.safetensors").exists()

    weights, client = checkpoint_state(tmp_path / "ckpt", "global_step6")
    reference = GPT2LMHeadModel(GPT2Config.from_dict(client["model_config"]))
    reference.load_state_dict(weights, strict=False)
    reference.tie_weights()
    reference.eval()
    ids = [5, 17, 42, 99, 7, 300]
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids])).logits[0]
    if stage in (1, 2):
        # The export step is the same for every partitioned stage; a fresh interpreter (no dsgpt2
        # import, the text-generation pipeline) checks stages 0 and 3 below.
        exported = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
        with torch.no_grad():
            got_logits = exported(input_ids=torch.tensor([ids])).logits[0]
        assert torch.allclose(got_logits, expected, atol=1e-5)
        return
    check = subprocess.run(
        [sys.executable, "-c", EXPORT_CHECK, str(tmp_path / "hf"), json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=deadline(300),
        cwd=tmp_path,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    assert got["dsgpt2"] is False and got["tied"] is True
    assert got["text"].startswith("def")
    assert torch.allclose(torch.tensor(got["logits"]), expected, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_the_chunked_loss_trains_and_validates_as_transformers_loss(
    corpus: dict[str, Path], tmp_path: Path, stage: int
) -> None:
    """--loss_chunk (several chunks per micro-batch here) against --loss_chunk 0 (transformers' loss
    over the whole logits): the same losses, gradient norms and validation, step by step; under ZeRO-3
    the head's tied weight is gathered for the chunks as for the embedding."""
    ds = json.loads(corpus["ds"].read_text())
    ds["zero_optimization"] = {"stage": stage}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    staged = dict(corpus, ds=tmp_path / "ds.json")
    runs = {}
    for chunk in ("50", "0"):
        run = tmp_path / f"chunk{chunk}"
        train(staged, run, "--train_iters", "5", "--save_interval", "100", "--eval_interval", "5",
              "--loss_chunk", chunk)  # fmt: skip
        records = read_metrics(run / "ws" / "metrics.jsonl")
        runs[chunk] = (steps(run), [r["val_loss"] for r in records if r["event"] == "eval"])
    (chunked, chunked_val), (whole, whole_val) = runs["50"], runs["0"]
    assert sorted(chunked) == sorted(whole) == [1, 2, 3, 4, 5]
    for step in whole:
        assert chunked[step]["loss"] == pytest.approx(whole[step]["loss"], rel=1e-5), step
        assert chunked[step]["grad_norm"] == pytest.approx(whole[step]["grad_norm"], rel=1e-4), step
    assert len(whole_val) == 1 and chunked_val == pytest.approx(whole_val, rel=1e-5)
