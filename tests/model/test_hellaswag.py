"""HellaSwag from a user's file: accuracy by summed and by mean ending loss, batched, through
`dsgpt2 evaluate --hellaswag`, recorded in eval_results; a malformed file is one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import db_for, run_cli, store_config, tiny_export
from corpora import examples
from dsgpt2.db.client import Connection
from dsgpt2.model.hellaswag import Example, read_examples, result, score
from pace import deadline


def reference(model, encode, example: Example) -> tuple[int, int]:
    """One ending at a time, no padding, no batching: the choice by summed and by mean loss."""
    sums, means = [], []
    ctx = encode(example.ctx)
    for ending in example.endings:
        end = encode(" " + ending)
        ids = torch.tensor([ctx + end])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[len(ctx) - 1 : -1].double(), ids[0, len(ctx) :],
                                                reduction="sum")  # fmt: skip
        sums.append(float(nll))
        means.append(float(nll) / len(end))
    return min(range(4), key=sums.__getitem__), min(range(4), key=means.__getitem__)


def test_batched_scores_equal_one_ending_at_a_time(tmp_path: Path, sample_texts: list[str]) -> None:
    from transformers import GPT2LMHeadModel

    from dsgpt2.model.hellaswag import encoder

    model_dir = tiny_export(tmp_path, sample_texts[:300], context=128)
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples(sample_texts[300:], 40)))
    data = read_examples(path)
    model = GPT2LMHeadModel.from_pretrained(str(model_dir)).eval()
    encode = encoder(model_dir)
    with torch.no_grad():
        got = result(score(model, encode, data, "cpu", 128, batch_examples=3))
    picks = [reference(model, encode, e) for e in data]
    assert got["hellaswag_examples"] == 40
    assert got["hellaswag_acc"] == sum(p[0] == e.label for p, e in zip(picks, data, strict=True)) / 40
    assert got["hellaswag_acc_norm"] == sum(p[1] == e.label for p, e in zip(picks, data, strict=True)) / 40
    # Sum and mean disagree somewhere (endings of different lengths), so both are measured.
    assert any(a != b for a, b in picks)


def test_dsgpt2_evaluate_hellaswag_reports_and_records(tmp_path: Path, sample_texts: list[str]) -> None:
    model_dir = tiny_export(tmp_path, sample_texts[:300], context=128)
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in examples(sample_texts[300:], 30)))
    cfg, store = store_config(tmp_path)
    report = tmp_path / "h.json"
    result_ = run_cli("evaluate", "--model", str(model_dir), "--config", str(cfg), "--hellaswag", str(path),
                      "--hellaswag_limit", "20", "--report", str(report))  # fmt: skip
    assert result_.returncode == 0, result_.stderr
    assert "on HellaSwag" in result_.stdout and "over 20 examples" in result_.stdout
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics["hellaswag_examples"] == 20 and 0 <= metrics["hellaswag_acc"] <= 1
    from conftest import make_config

    conn = Connection(make_config(["a"], **db_for(store)))
    (recorded,) = list(conn.db["eval_results"].find())
    assert (
        recorded["split"] == "hellaswag" and recorded["metrics"]["hellaswag_acc"] == metrics["hellaswag_acc"]
    )


@pytest.mark.parametrize(
    "line, what",
    [
        ('{"ctx": "a", "endings": ["b", "c", "d"], "label": 0}', "line 2 is not a HellaSwag example"),
        ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', "line 2 is not a HellaSwag example"),
        ("not json", "line 2 is not a HellaSwag example"),
    ],
)
def test_a_malformed_file_is_one_line(tmp_path: Path, sample_texts: list[str], line: str, what: str) -> None:
    path = tmp_path / "h.jsonl"
    good = json.dumps({"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 1})
    path.write_text(good + "\n" + line + "\n")
    cfg, _ = store_config(tmp_path)
    out = run_cli(
        "evaluate", "--model", str(tmp_path / "none"), "--config", str(cfg), "--hellaswag", str(path)
    )
    assert out.returncode == 2 and what in out.stderr and out.stderr.count("\n") == 1


def readme_block(containing: str) -> str:
    """The bash block of the README or the docs (docs/*.md) that holds ``containing``."""
    from conftest import ROOT

    text = "".join(page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if containing in b]
    return block


@pytest.mark.slow
def test_lm_eval_scores_an_export_as_dsgpt2_evaluate_does(tmp_path: Path, sample_texts: list[str]) -> None:
    """The docs' lm-eval commands, run as written in a directory holding the export they name (the
    tour's) and `hellaswag_val.jsonl`: EleutherAI's `lm_eval --model hf` loads the export and runs the local
    task offline. Its acc, the ending of least summed loss, is the acc `dsgpt2 evaluate --hellaswag`
    reports on the same file."""
    import os
    import shutil
    import subprocess
    import sys

    block = readme_block("lm_eval --model hf")
    named = re.search(r"pretrained=([^,\s]+)", block)
    assert named, block
    exported = tmp_path / named.group(1)
    model_dir = tiny_export(tmp_path / "built", sample_texts[:300], context=128)
    shutil.copytree(model_dir, exported)
    data = tmp_path / "hellaswag_val.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in examples(sample_texts[300:], 24)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    harness = subprocess.run(["bash", "-euo", "pipefail", "-c", block],
                             cwd=tmp_path, capture_output=True, text=True, env=env,
                             timeout=deadline(300))  # fmt: skip
    assert harness.returncode == 0, (harness.stdout + harness.stderr)[-3000:]
    (results,) = (tmp_path / "runs" / "lm_eval").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["hellaswag_local"]

    cfg, _ = store_config(tmp_path)
    report = tmp_path / "report.json"
    ours = run_cli("evaluate", "--model", str(exported), "--config", str(cfg),
                   "--hellaswag", str(data), "--report", str(report), "--no_record")  # fmt: skip
    assert ours.returncode == 0, ours.stderr
    metrics = json.loads(report.read_text())["metrics"]
    assert metrics["hellaswag_examples"] == theirs_count(results) == 24
    assert theirs["acc,none"] == pytest.approx(metrics["hellaswag_acc"])


def theirs_count(results: Path) -> int:
    return int(json.loads(results.read_text())["n-samples"]["hellaswag_local"]["effective"])
