"""Evaluation, generation, conversation finetuning and chat on models trained here with DeepSpeed."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import ROOT, built_once, db_for, run_cli, seed, tiny_export, write_config
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.data.loader import iter_eval_batches
from dsgpt2.data.packing import IGNORE
from dsgpt2.data.sources import StreamingChunks, tokenizer_digest
from dsgpt2.db.client import EVAL_RESULTS, Connection
from dsgpt2.db.config import load_config
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.infer.evaluate import EvalRequest, eval_spec, evaluate, report_lines
from dsgpt2.infer.generate import Generator, SamplingParams
from dsgpt2.infer.loading import load_model
from dsgpt2.tokenizer.bpe import VocabSettings, load_tokenizer, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from pace import deadline
from zygote import run_python

pytestmark = pytest.mark.slow

DS = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 3e-3}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000000,
}


def _train(base: Path, name: str, config: Path, *extra: str) -> Path:
    """Train with ds_trainer.py as a user would, export the result; return the export."""
    args = [
        sys.executable, str(ROOT / "ds_trainer.py"),
        "--deepspeed_config", str(base / "ds.json"),
        "--config_train", str(config),
        "--context_length", "64",
        "--tr_ratio", "0.9",
        "--chunk_docs", "200",
        "--num_workers", "1",
        "--seed", "3",
        "--wandb", "off",
        "--eval_interval", "1000",
        "--ckpt_dir", str(base / name / "ckpt"),
        "--workspace", str(base / name / "ws"),
        *extra,
    ]  # fmt: skip
    result = run_python(args[1:], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out = run_cli("export", "--ckpt_dir", str(base / name / "ckpt"), "--out", str(base / name / "model"))
    assert out.returncode == 0, out.stderr
    return base / name / "model"


def _stores(base: Path, where: Path) -> tuple[Path, Path]:
    """The two configurations in ``where``, on this process's server, and their collections filled:
    2,000 sample documents (``stdlib``) and 800 sample conversations (``chat``)."""
    store = db_for(base / "db.mongo")
    lm = write_config(where / "lm.json", **store, COLLECTIONS=["stdlib"])
    chat = write_config(where / "chat.json", **store, COLLECTIONS=["chat"])
    conn = Connection(load_config(lm))
    ingest(conn, "stdlib", [builtin_source("stdlib", 2000)])
    ingest(conn, "chat", [builtin_source("stdlib-chat", 800)])
    return lm, chat


def _build(base: Path) -> None:
    lm, chat = _stores(base, base)
    texts, _ = mongo_texts(load_config(lm))
    train_vocab(texts, base / "tok", VocabSettings(vocab_size=512), "test", progress=False)
    (base / "ds.json").write_text(json.dumps(DS))
    pre = _train(base, "lm", lm, "--vocab_dir", str(base / "tok"), "--model_select", "tiny",
                 "--train_iters", "100", "--save_interval", "1000")  # fmt: skip
    _train(base, "chat", chat, "--init_from", str(pre), "--task", "conversation",
           "--train_iters", "80", "--save_interval", "1000")  # fmt: skip
    fresh = base / "fresh"
    model = load_model(pre).model
    torch.manual_seed(0)
    model.apply(model._init_weights)  # the same architecture, untrained
    model.save_pretrained(str(fresh))
    for f in pre.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special")):
            (fresh / f.name).write_bytes(f.read_bytes())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A pretrained tiny model and its conversation finetune, both exported, trained once per test run
    (the test processes share them); the corpus in this process's own database."""
    base, built = built_once(tmp_path_factory, "inference", _build)
    if built:
        lm, chat = base / "lm.json", base / "chat.json"
    else:
        lm, chat = _stores(base, tmp_path_factory.mktemp("inference-db"))
    return {"lm": base / "lm" / "model", "chat": base / "chat" / "model", "fresh": base / "fresh",
            "lm_config": lm, "chat_config": chat, "base": base}  # fmt: skip


def _evaluate(model: Path, config: Path, **request: object) -> dict:
    return evaluate(load_model(model), load_config(config), EvalRequest(**request), progress=False)


def test_perplexity_is_exp_of_the_mean_token_loss_of_transformers(models: dict[str, Path]) -> None:
    from transformers import GPT2LMHeadModel

    report = _evaluate(models["lm"], models["lm_config"], batch_size=4, max_batches=5, workers=0)
    # Independently: the same blocks through transformers' own loss, weighted by predicted tokens.
    loaded = load_model(models["lm"])
    config = load_config(models["lm_config"])
    spec = eval_spec(loaded, EvalRequest())
    dataset = StreamingChunks(config, MongoWrapper(config).counts, loaded.tokenizer_dir, spec, "val")
    hf = GPT2LMHeadModel.from_pretrained(str(models["lm"])).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i, batch in enumerate(iter_eval_batches(dataset, 0, 1, 4)):
            if i == 5:
                break
            out = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
            n = int((batch.labels[:, 1:] != IGNORE).sum())
            total += float(out.loss) * n
            count += n
    m = report["metrics"]
    assert m["tokens"] == count and m["blocks"] == 20
    assert m["loss"] == pytest.approx(total / count, rel=1e-5)
    assert m["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert report["split"] == "val" and report["data_fingerprint"]["tr_ratio"] == 0.9


def test_training_validation_and_evaluate_measure_alike(models: dict[str, Path]) -> None:
    """The run's last validation (10 batches of 4 blocks at step 100) is what ``evaluate`` reports
    for the exported step-100 model on the same batches."""
    from dsgpt2.train.metrics import read_metrics

    records = read_metrics(models["base"] / "lm" / "ws" / "metrics.jsonl")
    last = [r for r in records if r["event"] == "eval"][-1]
    assert last["step"] == 100
    report = _evaluate(models["lm"], models["lm_config"], batch_size=4, max_batches=10, workers=0)
    assert report["step"] == 100 and report["metrics"]["blocks"] == 40
    assert report["metrics"]["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert report["metrics"]["perplexity"] == pytest.approx(last["val_ppl"], rel=1e-5)
    m = report["metrics"]
    assert m["bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)
    assert m["bpb"] == pytest.approx(m["loss"] * m["tokens"] / math.log(2) / m["bytes"], rel=1e-9)


def test_untrained_model_is_near_uniform_and_training_lowers_perplexity(models: dict[str, Path]) -> None:
    fresh = _evaluate(models["fresh"], models["lm_config"], max_batches=10, tr_ratio=0.9, context=64)
    trained = _evaluate(models["lm"], models["lm_config"], max_batches=10)
    vocab = 512
    assert 0.7 * vocab < fresh["metrics"]["perplexity"] < 1.5 * vocab
    assert trained["metrics"]["perplexity"] < 0.65 * fresh["metrics"]["perplexity"]
    # Deterministic: the same model and data give the same figures.
    again = _evaluate(models["lm"], models["lm_config"], max_batches=10)
    assert again["metrics"]["loss"] == trained["metrics"]["loss"]


def test_evaluate_cli_writes_a_report_and_records_it(models: dict[str, Path], tmp_path: Path) -> None:
    report_path = tmp_path / "r.json"
    out = run_cli("evaluate", "--model", str(models["lm"]), "--config", str(models["lm_config"]),
                  "--max_batches", "3", "--report", str(report_path), "--no_progress")  # fmt: skip
    assert out.returncode == 0, out.stderr
    db = json.loads(models["lm_config"].read_text())["MONGO_CONNECTION_DB"]
    assert "perplexity" in out.stdout and f"recorded in {db}.{EVAL_RESULTS}" in out.stdout
    report = json.loads(report_path.read_text())
    assert f"bpb {report['metrics']['bpb']:.3f}" in out.stdout and report["metrics"]["bytes"] > 0
    # The figure says what it covers (training's validation reads --eval_iters batches of the split).
    assert f"over {report['metrics']['tokens']:,} tokens, its first 3 batches (--max_batches)" in out.stdout
    whole = report_lines({**report, "max_batches": None})[1]
    assert f"over {report['metrics']['tokens']:,} tokens, all of it (" in whole
    conn = Connection(load_config(models["lm_config"]))
    stored = list(conn.db[EVAL_RESULTS].find({"model": report["model"], "time": report["time"]}))
    assert len(stored) == 1
    assert stored[0]["metrics"] == report["metrics"]
    assert stored[0]["data_fingerprint"] == report["data_fingerprint"]
    assert stored[0]["step"] == 100
    # --json: the report alone on stdout, for a machine.
    out = run_cli("evaluate", "--model", str(models["lm"]), "--config", str(models["lm_config"]),
                  "--max_batches", "3", "--report", str(tmp_path / "j.json"), "--no_progress", "--no_record",
                  "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["metrics"] == json.loads((tmp_path / "j.json").read_text())["metrics"]


def _error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the dsgpt2 command in process; it must fail with exit code 2 and one line."""
    from dsgpt2.cli.main import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsgpt2: error: "), err
    return err[0]


def test_evaluate_bad_input_is_one_line(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = str(models["lm_config"])
    assert "not found" in _error_line(
        capsys, "evaluate", "--model", str(tmp_path / "nope"), "--config", config
    )
    assert "neither an exported model" in _error_line(
        capsys, "evaluate", "--model", str(tmp_path), "--config", config
    )
    line = _error_line(
        capsys, "evaluate", "--model", str(models["lm"]), "--config", config, "--start", "1000000000"
    )
    assert "--start" in line
    line = _error_line(
        capsys, "evaluate", "--model", str(models["lm"]), "--config", config, "--report", str(tmp_path)
    )
    assert "is a directory" in line


@pytest.fixture(scope="module")
def plain_export(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Path:
    return tiny_export(tmp_path_factory.mktemp("plain"), sample_texts[:200])


@pytest.mark.parametrize(
    ("name", "damage", "said"),
    [
        ("model.safetensors", lambda b: b[:1000], "Error while deserializing header"),
        ("model.safetensors", lambda b: b"", "Error while deserializing header"),
        ("config.json", lambda b: b'{"n_embd": ', "is not a valid JSON file"),
        ("config.json", lambda b: b'{"n_embd": "wide"}', "Field 'n_embd' expected int"),
        ("dsgpt2_run.json", lambda b: b"[1", "Expecting"),
    ],
    ids=["weights cut short", "weights empty", "config not JSON", "config wrong type", "run record garbled"],
)
def test_a_damaged_export_is_one_line_naming_its_file_and_the_way_out(
    plain_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, damage: Any, said: str
) -> None:
    """A file of an export cut short, garbled or holding a value of the wrong type: whichever command
    loads it says which file and how to get a whole export back, not the parser's traceback."""
    model = tmp_path / "model"
    shutil.copytree(plain_export, model)
    path = model / name
    path.write_bytes(damage(path.read_bytes() if path.exists() else b""))
    line = _error_line(capsys, "generate", "--model", str(model), "def")
    assert f"model {model}: {name} cannot be read (" in line and said in line, line
    assert line.endswith("the export is damaged; export it again from its checkpoint "
                         "(`dsgpt2 export --ckpt_dir DIR --out DIR`)"), line  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "kind", "said"),
    [
        ("model.safetensors", "pipe", "a named pipe, not a regular file"),
        ("dsgpt2_run.json", "pipe", "a named pipe, not a regular file"),
        ("dsgpt2_run.json", "folder", "a directory, not a file"),
    ],
    ids=["weights a pipe", "run record a pipe", "run record a folder"],
)
def test_a_pipe_or_folder_in_an_export_is_one_line_not_a_wait_nor_no_record(
    plain_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, kind: str, said: str
) -> None:
    """Weights that are a named pipe waited forever for a writer; a run record that is not a file was
    taken for none, and the weights were loaded unchecked."""
    model = tmp_path / "model"
    shutil.copytree(plain_export, model)
    (model / name).unlink(missing_ok=True)  # this export's record is written by dsgpt2's export only
    os.mkfifo(model / name) if kind == "pipe" else (model / name).mkdir()
    line = _error_line(capsys, "generate", "--model", str(model), "def")
    assert f"model {model}: {name} cannot be read ({said}): the export is damaged;" in line, line


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("nope{", "not valid JSON: Expecting value"),
        ("[1, 2]", 'an array, not a JSON object such as {"eos_token_id": 0}'),
        ('{"max_length": "x"}', "max_length is 'x', not a whole number"),
        ('{"eos_token_id": [0, "end"]}', "eos_token_id is [0, 'end'], not a token id or a list of them"),
        ('{"do_sample": "yes"}', "do_sample is 'yes', not true or false"),
    ],
    ids=["not JSON", "a list", "a length of text", "a token of text", "a flag of text"],
)
@pytest.mark.parametrize("command", ["generate", "chat", "evaluate"])
def test_a_junk_generation_config_is_one_line_naming_it_and_the_way_out(
    plain_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, text: str, said: str
) -> None:
    """dsgpt2 never read an export's generation_config.json: junk there was ignored (exit 0), while
    transformers loads the model without its settings, or fails on a list with a traceback."""
    model = tmp_path / "model"
    shutil.copytree(plain_export, model)
    (model / "generation_config.json").write_text(text)
    db = write_config(tmp_path / "c.json", **db_for(tmp_path / "db"), COLLECTIONS=["a"])
    if command == "evaluate":  # it checks its corpus before the model
        seed(Connection(load_config(db)), "a", ["def f(): pass"])
    extra = {
        "generate": ["def"],
        "chat": [],
        "evaluate": ["--config", str(db)],
    }
    line = _error_line(capsys, command, "--model", str(model), *extra[command])
    assert f"model {model}: generation_config.json cannot be read ({said}" in line, line
    assert line.endswith("; delete it (the model's config.json holds its token ids) or export the model "
                         "again (`dsgpt2 export --ckpt_dir DIR --out DIR`)"), line  # fmt: skip


@pytest.mark.parametrize(("change", "said"), [
    ({"n_layer": 2}, "does not match its model config: weights 12 missing (transformer.h.1.ln_1.weight, "),
    ({"n_embd": 128}, "does not match its model config: 16 weight(s) of another shape (size mismatch for"),
    ({"n_head": 3}, "its model config does not make a GPT-2 (`embed_dim` must be divisible by num_heads"),
    ({"n_head": 0}, "its model config does not make a GPT-2 ("),
], ids=["a layer more", "wider", "heads not dividing the width", "no head"])  # fmt: skip
def test_a_config_edited_away_from_its_weights_is_one_short_line(
    plain_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, said: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(plain_export, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    line = _error_line(capsys, "generate", "--model", str(model), "def")
    assert said in line and len(line) < 500, line


def test_an_exports_files_are_readable_as_open_makes_them(models: dict[str, Path]) -> None:
    """transformers writes the weights through a private temporary file: an export served by another
    user (a container's) could read every file but model.safetensors."""
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in models["lm"].iterdir() if f.is_file()}
    assert modes["model.safetensors"] == 0o666 & ~mask and set(modes.values()) == {0o666 & ~mask}, modes


def test_weights_changed_in_place_or_not_finite_are_refused_not_used(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes overwritten inside model.safetensors keep its format: the weights loaded, generate printed
    nothing (greedy) or failed in sampling, evaluate reported loss nan, exit 0. An export records its
    weights' SHA-256; weights that are NaN all the same (exported elsewhere) are said, not used."""
    from safetensors.torch import load_file, save_file

    from dsgpt2.cli.main import main

    model = tmp_path / "model"
    shutil.copytree(models["lm"], model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    weights.write_bytes(bytes(data))
    line = _error_line(capsys, "generate", "--model", str(model), "def")
    assert "model.safetensors cannot be read (its size or SHA-256 differs from the export's record, " in line
    # No record to check against: the scores are found not finite before a token is picked.
    (model / "dsgpt2_run.json").unlink()
    tensors = load_file(str(models["lm"] / "model.safetensors"))
    tensors = {k: torch.full_like(v, float("nan")) if "wte" in k else v for k, v in tensors.items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    for temperature in ("0", "1"):
        assert (
            main(
                [
                    "generate",
                    "--model",
                    str(model),
                    "--temperature",
                    temperature,
                    "--max_new_tokens",
                    "4",
                    "x",
                ]
            )
            == 1
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["dsgpt2: error: the model's next-token scores are not finite (NaN or infinity): its "
                       "weights are damaged or its training diverged; export it again from a checkpoint "
                       "whose loss was finite"], err  # fmt: skip
    (model / "dsgpt2_run.json").write_text((models["lm"] / "dsgpt2_run.json").read_text().replace(
        '"weights"', '"weights_not"'))  # fmt: skip
    line = _error_line(capsys, "evaluate", "--model", str(model), "--config", str(models["lm_config"]))
    assert "the model's loss is not finite (nan)" in line, line


def test_generation_is_deterministic_per_seed_and_bounded(models: dict[str, Path]) -> None:
    gen = Generator(load_model(models["lm"]))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    torch.manual_seed(123)
    before = torch.rand(1)
    a = gen.generate("Return the", params)
    b = gen.generate("Return the", params)
    assert a == b
    torch.manual_seed(123)
    assert torch.rand(1) == before  # the global random state is not consumed
    others = {gen.generate("Return the", SamplingParams(max_new_tokens=12, temperature=1.0, seed=s))[0].text
              for s in range(6, 10)}  # fmt: skip
    assert len(others | {a[0].text}) > 1
    many = gen.generate("The", SamplingParams(max_new_tokens=7, num_samples=3, seed=1))
    assert len(many) == 3
    for c in many:
        assert c.tokens <= 7
        assert c.finish_reason == "stop" or c.tokens == 7


def test_generation_stops_at_end_of_text(models: dict[str, Path]) -> None:
    loaded = load_model(models["lm"])
    model = loaded.model
    eot = load_tokenizer(loaded.tokenizer_dir).token_to_id("<|endoftext|>")
    with torch.no_grad():
        # Make every position's final hidden state a fixed vector that only the end-of-text
        # embedding matches: the model then always predicts end-of-text.
        v = torch.zeros(model.config.n_embd)
        v[0] = 1.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(v)
        model.transformer.wte.weight[:, 0] = 0.0
        model.transformer.wte.weight[eot, 0] = 50.0
    gen = Generator(loaded)
    (c,) = gen.generate("Some text", SamplingParams(max_new_tokens=20, seed=0))
    assert c == type(c)("", 1, "stop")


def test_generate_cli(models: dict[str, Path], tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("Return a\n\nThe module\n")
    args = ("generate", "--model", str(models["lm"]), "--max_new_tokens", "5", "--seed", "3", "--json")
    out = run_cli(*args, "--prompts_file", str(prompts), "A third")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["A third", "Return a", "The module"]
    assert all(r["tokens"] <= 5 for r in rows)
    # The same seed gives the same text, printed whole or piece by piece as it is generated.
    streamed = run_cli(*args[:-1], "--stream", "--prompts_file", str(prompts), "A third")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "".join(f"{r['prompt']}{r['text']}\n" for r in rows)


def test_generate_bad_input_is_one_line(models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    model = ("generate", "--model", str(models["lm"]))
    assert "temperature must be a number in [0.0" in _error_line(capsys, *model, "--temperature", "-1", "x")
    assert "num_samples > 1" in _error_line(capsys, *model, "--temperature", "0", "--num_samples", "2", "x")
    assert "context of 64 tokens" in _error_line(capsys, *model, "--max_new_tokens", "64", "x")
    assert "PROMPT" in _error_line(capsys, *model)
    assert "top_p" in _error_line(capsys, *model, "--top_p", "0", "x")
    assert "--stream prints one text" in _error_line(capsys, *model, "--stream", "--json", "x")


def test_generate_unreadable_prompts_file(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    line = _error_line(capsys, "generate", "--model", str(models["lm"]), "--prompts_file", str(bad))
    assert "cannot read it as UTF-8" in line
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    for given, said in (
        (tmp_path, ": a directory, not a file; give a file"),
        (blank, " holds no prompt (every line is blank)"),
    ):
        line = _error_line(capsys, "generate", "--model", str(models["lm"]), "--prompts_file", str(given))
        assert f"--prompts_file {given}{said}" in line, line


def test_finetuning_lowers_the_reply_loss(models: dict[str, Path]) -> None:
    request = {"task": "conversation", "max_batches": 20}
    before = _evaluate(models["lm"], models["chat_config"], **request)
    after = _evaluate(models["chat"], models["chat_config"], **request)
    assert before["data_fingerprint"]["task"] == after["data_fingerprint"]["task"] == "conversation"
    assert before["metrics"]["tokens"] == after["metrics"]["tokens"]  # the same reply tokens
    assert after["metrics"]["loss"] < before["metrics"]["loss"] - 0.1
    # The finetune's own run info carries the task: evaluate picks it without being told.
    default = _evaluate(models["chat"], models["chat_config"], max_batches=20)
    assert default["task"] == "conversation"
    assert default["metrics"]["loss"] == after["metrics"]["loss"]


def test_conversation_chunks_mask_everything_but_replies(models: dict[str, Path]) -> None:
    loaded = load_model(models["chat"])
    config = load_config(models["chat_config"])
    tok = load_tokenizer(loaded.tokenizer_dir)
    spec = eval_spec(loaded, EvalRequest())
    dataset = StreamingChunks(config, MongoWrapper(config).counts, loaded.tokenizer_dir, spec, "train")
    chunk = dataset[0]
    assert chunk.loss is not None and chunk.documents > 50
    ids, loss = chunk.blocks.reshape(-1), chunk.loss.reshape(-1)
    user, bot, eot = (tok.token_to_id(t) for t in ("<|user|>", "<|bot|>", "<|endoftext|>"))
    speaker = None
    end = (len(chunk.blocks) - 1) * spec.context + chunk.last
    for t in range(end):
        expected = speaker == bot
        if ids[t] in (user, bot, eot):
            speaker = int(ids[t]) if ids[t] != eot else None
        assert bool(loss[t]) == expected, t
    assert not loss[end:].any()


def test_chat_through_a_pipe(models: dict[str, Path]) -> None:
    script = (
        "What does `json.dumps` do?\nTell me more.\n/reset\nWhat is `os.path.join` for?\n/quit\nignored\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "dsgpt2", "chat", "--model", str(models["chat"]), "--max_new_tokens", "16"],
        input=script, capture_output=True, text=True, timeout=deadline(120), cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("bot: ") and lines[1].startswith("bot: ") and lines[3].startswith("bot: ")
    assert lines[2] == "(conversation reset)"
    # A line of bytes that are not UTF-8 (a pipe from a latin-1 file): one line and exit 2 once the
    # lines before it are answered, not a traceback from the tokenizer.
    out = subprocess.run(
        [sys.executable, "-m", "dsgpt2", "chat", "--model", str(models["chat"]), "--max_new_tokens", "4"],
        input=b"Hello\ncaf\xe9 au lait\n", capture_output=True, timeout=deadline(120), cwd=ROOT,
    )  # fmt: skip
    err = out.stderr.decode()
    assert out.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("dsgpt2: error: the input holds a line that is not UTF-8")
    assert out.stdout.decode().startswith("bot: ")


def test_a_chat_whose_user_and_bot_share_a_name_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _error_line(capsys, "chat", "--model", str(tmp_path / "none"), "--user", "bot", "--bot", "bot")
    assert line == "dsgpt2: error: --user and --bot are both 'bot'; give the two speakers two names"


def test_an_interactive_chat_asks_again_for_a_line_that_is_not_utf8() -> None:
    from types import SimpleNamespace

    from dsgpt2.infer.chat import run_chat

    replies: list[str] = []
    session = SimpleNamespace(generator=SimpleNamespace(loaded=SimpleNamespace(name="m")), bot="bot",
                              reply=lambda text, on_text: replies.append(text))  # fmt: skip
    said: list[str] = []
    run_chat(session, ["caf\udce9\n", "café\n", "/quit\n"], True, said.append)  # type: ignore[arg-type]
    assert "(that line is not UTF-8 text; type it again)\n" in said and replies == ["café"]


def test_chat_session_keeps_history_within_the_context(models: dict[str, Path]) -> None:
    from dsgpt2.data.conversation import prompt_ids, speaker_ids
    from dsgpt2.infer.chat import ChatSession

    gen = Generator(load_model(models["chat"]))
    session = ChatSession(gen, SamplingParams(max_new_tokens=16, seed=1))
    session.reply("What does `json.dumps` do?")
    assert [t["speaker"] for t in session.history] == ["user", "bot"]
    session.reset()
    session.reply("Hello")
    turn = [{"speaker": "user", "text": "Hello"}]
    assert session.last_prompt_tokens == len(
        prompt_ids(turn, [gen.encode("Hello")], speaker_ids(gen.tokenizer), "bot")
    )
    for i in range(6):
        session.reply(f"Tell me more about item number {i} of the standard library, please.")
    assert session.last_prompt_tokens <= gen.context - 16
    assert session.last_dropped_turns > 0
    assert len(session.history) == 14
    # Instructions (the API's system messages) stay before the first user turn kept, whatever is dropped.
    kept = gen.tokenizer.decode(session.prompt([*session.history, turn[0]], "Answer in one word."))
    assert session.last_dropped_turns > 0 and "Answer in one word.\n\n" in kept, kept


class _CountingTokenizer:
    """A tokenizer that counts the texts it is given (the rest passed through)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls, self.texts = tokenizer, 0, 0

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.calls, self.texts = self.calls + 1, self.texts + len(texts)
        return self.tokenizer.encode_batch(texts, **kwargs)

    def encode(self, text: str, **kwargs: Any) -> Any:
        self.calls, self.texts = self.calls + 1, self.texts + 1
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def test_a_long_conversation_is_fitted_with_each_text_tokenized_once(models: dict[str, Path]) -> None:
    from dsgpt2.infer.chat import ChatSession

    gen = Generator(load_model(models["chat"]))
    session = ChatSession(gen, SamplingParams(max_new_tokens=16, seed=1))
    gen.tokenizer = counting = _CountingTokenizer(gen.tokenizer)
    turns = [{"speaker": ("user", "bot")[i % 2], "text": f"turn {i} of many"} for i in range(3001)]
    ids = session.prompt(turns, "Answer in one word.")
    # Once per text (3,001 turns and the system text), not once per turn dropped: a request of
    # thousands of turns would otherwise hold the server for minutes.
    assert (counting.calls, counting.texts) == (1, 3002)
    text = counting.decode(ids)
    assert len(ids) <= gen.context - 16 and session.last_dropped_turns > 2900
    assert "Answer in one word." in text and text.rstrip().endswith("turn 3000 of many"), text


def test_one_turn_too_long_keeps_its_speaker_the_system_text_and_its_end(models: dict[str, Path]) -> None:
    from dsgpt2.data.conversation import speaker_ids
    from dsgpt2.errors import ConfigError
    from dsgpt2.infer.chat import ChatSession

    gen = Generator(load_model(models["chat"]))
    session = ChatSession(gen, SamplingParams(max_new_tokens=16, seed=1))
    speakers = speaker_ids(gen.tokenizer)
    system = "Answer in one word."
    question = " ".join(f"word{i}" for i in range(gen.context * 2)) + " the question?"
    ids = session.prompt([{"speaker": "user", "text": question}], system)
    assert len(ids) == gen.context - 16
    assert ids[0] == speakers["user"] and ids[-1] == speakers["bot"]
    assert gen.tokenizer.decode(ids, skip_special_tokens=True).startswith(system + "\n\n")
    assert gen.tokenizer.decode(ids[-12:-1]).endswith("the question?")
    with pytest.raises(ConfigError, match=r"the system text takes .* no room"):
        session.prompt([{"speaker": "user", "text": "hi"}], "instructions " * gen.context)


def test_conversation_finetune_needs_speaker_tokens(models: dict[str, Path], tmp_path: Path) -> None:
    from dsgpt2.data.sources import make_spec
    from dsgpt2.errors import CorpusError

    with pytest.raises(CorpusError, match="no <\\|speaker\\|> token"):
        make_spec(
            models["lm"],
            context=64,
            chunk_docs=100,
            tr_ratio=0.9,
            seed=1,
            task="conversation",
            reply_speakers="assistant",
        )
    assert np.array_equal(np.arange(3), np.arange(3))


def test_a_checkpoint_directory_serves_like_its_export(models: dict[str, Path]) -> None:
    ckpt = models["base"] / "lm" / "ckpt"
    from_ckpt, from_export = load_model(ckpt), load_model(models["lm"])
    assert from_ckpt.name.endswith("global_step100") and from_ckpt.run["step"] == 100
    ids = torch.tensor([[5, 17, 42, 99, 3]])
    with torch.no_grad():
        a, b = from_ckpt.model(ids).logits, from_export.model(ids).logits
    assert torch.allclose(a, b, atol=1e-5)
    by_tag = load_model(ckpt / "global_step100")
    assert by_tag.name == from_ckpt.name
    report = _evaluate(ckpt, models["lm_config"], max_batches=3)
    assert report["metrics"]["loss"] == pytest.approx(
        _evaluate(models["lm"], models["lm_config"], max_batches=3)["metrics"]["loss"], rel=1e-5
    )


def test_export_refuses_what_would_ship_a_wrong_model_or_overwrite(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = models["base"]
    ckpt = str(base / "lm" / "ckpt")
    readme = tmp_path / "README.md"
    readme.write_text("mine\n")
    line = _error_line(capsys, "export", "--ckpt_dir", ckpt, "--out", str(readme))
    assert "is a file" in line and readme.read_text() == "mine\n"
    # Into the tokenizer or the checkpoints: refused before a byte is written there.
    before = sorted(p.name for p in (base / "tok").iterdir())
    line = _error_line(capsys, "export", "--ckpt_dir", ckpt, "--out", str(base / "tok"))
    assert "the tokenizer" in line and sorted(p.name for p in (base / "tok").iterdir()) == before
    line = _error_line(capsys, "export", "--ckpt_dir", ckpt, "--out", str(base / "lm" / "ckpt" / "model"))
    assert "--ckpt_dir" in line
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    line = _error_line(capsys, "export", "--ckpt_dir", ckpt, "--out", str(other))
    assert "not a dsgpt2 export" in line and (other / "notes.txt").read_text() == "keep"
    # Another tokenizer (here of another size): not the run's by its hash, so refused.
    small = tmp_path / "tok300"
    conn = Connection(load_config(models["lm_config"]))
    texts, _ = mongo_texts(conn.config)
    train_vocab(texts, small, VocabSettings(vocab_size=300), "test", progress=False)
    out = tmp_path / "model"
    line = _error_line(capsys, "export", "--ckpt_dir", ckpt, "--out", str(out), "--vocab_dir", str(small))
    assert f"hash {tokenizer_digest(small)}" in line and not out.exists()
    # An earlier export is replaced whole; nothing is left beside it.
    from dsgpt2.cli.main import main

    assert main(["export", "--ckpt_dir", ckpt, "--out", str(out)]) == 0
    assert main(["export", "--ckpt_dir", ckpt, "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert "Writing model shards" not in capsys.readouterr().err


def test_conversation_finetuning_stops_early_on_the_reply_loss_and_keeps_its_best(
    models: dict[str, Path],
) -> None:
    """Early stopping where it matters most: a conversation finetune from the pretrained export,
    watching the validation loss over the replies. With --min_delta 100 only the first evaluation
    (step 4) improves; --patience 2 ends the run at step 12, the best kept by --keep_last 1 and
    exported by --ckpt_id best."""
    from dsgpt2.checkpoints.format import complete_tags
    from dsgpt2.train.metrics import read_metrics

    base = models["base"]
    _train(base, "chat_early", models["chat_config"], "--init_from", str(models["lm"]), "--task",
           "conversation", "--train_iters", "200", "--eval_interval", "4", "--eval_iters", "2",
           "--save_interval", "1000", "--keep_last", "1", "--early_stopping", "--patience", "2",
           "--min_delta", "100")  # fmt: skip
    records = read_metrics(base / "chat_early" / "ws" / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "eval"] == [4, 8, 12]
    end = [r for r in records if r["event"] == "end"][-1]
    assert end["stopped"] == "early" and end["step"] == 12
    ckpt = base / "chat_early" / "ckpt"
    assert (ckpt / "best").read_text() == "global_step4"
    assert complete_tags(ckpt) == ["global_step4", "global_step12"]
    best = run_cli("export", "--ckpt_dir", str(ckpt), "--ckpt_id", "best", "--out", str(base / "chat_best"))
    assert best.returncode == 0 and "global_step4" in best.stdout, best.stderr
    assert load_model(base / "chat_best").run["step"] == 4
    # Its checkpoint resumed with another --init_from: refused, not a resume that ignores it.
    other = base / "chat_best"
    again = run_python(
        [str(ROOT / "ds_trainer.py"), "--deepspeed_config", str(base / "ds.json"), "--config_train",
         str(models["chat_config"]), "--context_length", "64", "--tr_ratio", "0.9", "--chunk_docs", "200",
         "--num_workers", "1", "--seed", "3", "--wandb", "off", "--task", "conversation",
         "--train_iters", "200",
         "--init_from", str(other), "--load_dir", str(ckpt), "--ckpt_dir", str(base / "chat_other"),
         "--workspace", str(base / "chat_other_ws")],
        cwd=ROOT,
    )  # fmt: skip
    assert again.returncode == 2, again.stderr[-3000:]
    assert f"--init_from {other}: this run resumes {ckpt}" in again.stderr, again.stderr[-3000:]


def test_a_model_without_its_run_record_is_evaluated_with_a_warning_on_its_split(
    plain_export: Path, models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """An export whose dsgpt2_run.json is gone (or a model from elsewhere) cannot say which documents were
    held out: the default split was used without a word."""
    with caplog.at_level("WARNING", logger="dsgpt2.infer.evaluate"):
        eval_spec(load_model(plain_export), EvalRequest())
    assert "records no training run (no dsgpt2_run.json): its val split is cut by --tr_ratio" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsgpt2.infer.evaluate"):
        eval_spec(load_model(models["lm"]), EvalRequest())  # the run's own split: nothing to say
        eval_spec(load_model(plain_export), EvalRequest(tr_ratio=0.9, seed=3))
    assert "records no training run" not in caplog.text
