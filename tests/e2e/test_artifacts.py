"""Artifacts pinned by content: a tokenizer rewritten under a run, or an export overwritten, is refused
by every command that loads it against the run; writers refuse a target that holds something else."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, sample_corpus
from dsgpt2.cli.main import main
from dsgpt2.data.sources import tokenizer_digest
from pace import deadline
from zygote import run_python

pytestmark = pytest.mark.slow

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 1000000,
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny run of 4 steps (checkpoints at 2 and 4) on 400 sample documents, and its tokenizer."""
    base = tmp_path_factory.mktemp("artifacts")
    corpus = sample_corpus(base, documents=400, vocab_size=300)
    (base / "ds.json").write_text(json.dumps(DS))
    args = [
        str(ROOT / "ds_trainer.py"),
        "--deepspeed_config", str(base / "ds.json"),
        "--config_train", str(corpus["config"]),
        "--vocab_dir", str(corpus["tok"]),
        "--model_select", "tiny",
        "--context_length", "32",
        "--chunk_docs", "100",
        "--num_workers", "0",
        "--wandb", "off",
        "--eval_interval", "1000",
        "--train_iters", "4",
        "--save_interval", "2",
        "--ckpt_dir", str(base / "ckpt"),
        "--workspace", str(base / "ws"),
    ]  # fmt: skip
    result = run_python(args, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return {**corpus, "ckpt": base / "ckpt", "base": base}


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command in process: exit code 2 and one error line, which is returned."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsgpt2: error: "), err
    return err[0]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "dsgpt2", *argv], cwd=ROOT)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".staging-" in p.name)


def test_a_tokenizer_rewritten_under_a_run_is_refused_by_every_command_that_loads_it(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tok, ckpt, config = run["tok"], run["ckpt"], str(run["config"])
    original = tmp_path / "tok-original"
    shutil.copytree(tok, original)
    trained = tokenizer_digest(tok)
    # Training another vocabulary into the run's tokenizer directory: refused, nothing touched.
    line = _fails(capsys, "vocab", "train", "--from_mongo", "--config", config, "--out", str(tok),
                  "--vocab_size", "300", "--lowercase", "--no_progress")  # fmt: skip
    assert "--overwrite" in line and trained in line
    assert tokenizer_digest(tok) == trained
    try:
        # Told to: the new tokenizer replaces the old one whole, nothing left beside it.
        assert main(["vocab", "train", "--from_mongo", "--config", config, "--out", str(tok),
                     "--vocab_size", "300", "--lowercase", "--no_progress", "--overwrite"]) == 0  # fmt: skip
        rewritten = tokenizer_digest(tok)
        assert rewritten != trained and _leftovers(tok.parent) == []
        capsys.readouterr()
        # Every command that loads the run's tokenizer refuses it, naming both hashes and where it was.
        out = tmp_path / "model"
        for argv in (
            ["export", "--ckpt_dir", str(ckpt), "--out", str(out)],
            ["evaluate", "--model", str(ckpt), "--config", config, "--no_record", "--max_batches", "1"],
            ["generate", "--model", str(ckpt), "hello"],
            ["lineage", "--ckpt_dir", str(ckpt), "--doc", "stdlib:0"],
        ):
            line = _fails(capsys, *argv)
            assert trained in line and rewritten in line and str(tok) in line, (argv, line)
        assert not out.exists()
        for command in (["chat", "--model", str(ckpt)], ["serve", "--model", str(ckpt), "--port", "0"]):
            result = _cli(*command)
            assert result.returncode == 2 and trained in result.stderr and rewritten in result.stderr
            assert "Traceback" not in result.stderr
        # The run's tokenizer where it now is (--vocab_dir): accepted by its hash.
        assert main(["export", "--ckpt_dir", str(ckpt), "--out", str(out), "--vocab_dir", str(original)]) == 0
        assert main(["generate", "--model", str(ckpt), "--vocab_dir", str(original), "hello",
                     "--max_new_tokens", "2"]) == 0  # fmt: skip
    finally:
        shutil.rmtree(tok)
        shutil.copytree(original, tok)


def test_a_tokenizer_directory_holding_more_than_a_tokenizer_is_not_replaced(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vocab train --overwrite replaces its whole directory: a run's checkpoints saved beside the
    tokenizer would go with it, so it refuses, by the record's list of files or, in an older record
    without one, by the directories there."""
    tok = tmp_path / "tok"
    shutil.copytree(run["tok"], tok)
    (tok / "global_step2").mkdir()
    (tok / "latest").write_text("global_step2")
    argv = ["vocab", "train", "--from_mongo", "--config", str(run["config"]), "--out", str(tok),
            "--vocab_size", "300", "--no_progress", "--overwrite"]  # fmt: skip
    record = json.loads((tok / "dsgpt2_vocab.json").read_text())
    assert "tokenizer.json" in record["files"]
    line = _fails(capsys, *argv)
    assert "holds a tokenizer and other files (global_step2, latest)" in line, line
    del record["files"]
    (tok / "dsgpt2_vocab.json").write_text(json.dumps(record))
    line = _fails(capsys, *argv)
    assert "holds a tokenizer and other files (global_step2, latest)" in line, line
    assert (tok / "latest").read_text() == "global_step2"


def test_an_export_holds_its_own_tokenizer_by_hash(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model"
    assert main(["export", "--ckpt_dir", str(run["ckpt"]), "--out", str(out)]) == 0
    assert main(["generate", "--model", str(out), "hello", "--max_new_tokens", "2"]) == 0
    shipped = json.loads((out / "dsgpt2_run.json").read_text())["tokenizer_digest"]
    assert shipped == tokenizer_digest(out)
    # Another tokenizer written over the export's (vocab train --out of the export is refused, so by hand).
    other = tmp_path / "other"
    assert main(["vocab", "train", "--from_mongo", "--config", str(run["config"]), "--out", str(other),
                 "--vocab_size", "280", "--no_progress"]) == 0  # fmt: skip
    shutil.copyfile(other / "tokenizer.json", out / "tokenizer.json")
    capsys.readouterr()
    for argv in (
        ["generate", "--model", str(out), "hello"],
        ["evaluate", "--model", str(out), "--config", str(run["config"]), "--no_record"],
    ):
        line = _fails(capsys, *argv)
        assert shipped in line and tokenizer_digest(out) in line and str(out) in line, line
    # Another tokenizer given with --vocab_dir: the message says where the right one ships (the export).
    line = _fails(capsys, "generate", "--model", str(out), "--vocab_dir", str(other), "hello")
    assert f"shipped in {out}" in line, line


def test_export_refuses_to_replace_another_export_unless_told(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, out = str(run["ckpt"]), tmp_path / "model"
    assert main(["export", "--ckpt_dir", ckpt, "--out", str(out), "--ckpt_id", "global_step2"]) == 0
    before = (out / "model.safetensors").read_bytes()
    # The same export again is no overwrite: a pipeline re-run passes.
    assert main(["export", "--ckpt_dir", ckpt, "--out", str(out), "--ckpt_id", "global_step2"]) == 0
    capsys.readouterr()
    line = _fails(capsys, "export", "--ckpt_dir", ckpt, "--out", str(out))
    assert "global_step2" in line and "--overwrite" in line
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["export", "--ckpt_dir", ckpt, "--out", str(out), "--overwrite"]) == 0
    assert json.loads((out / "dsgpt2_run.json").read_text())["step"] == 4
    assert _leftovers(tmp_path) == []
    # An export replaces its whole directory: anything else there (a run's checkpoints saved into it)
    # is refused, --overwrite or not, and kept.
    (out / "global_step9").mkdir()
    (out / "latest").write_text("global_step9")
    line = _fails(capsys, "export", "--ckpt_dir", ckpt, "--out", str(out), "--ckpt_id", "global_step2",
                  "--overwrite")  # fmt: skip
    assert "holds an export and other files (global_step9, latest)" in line, line
    record = json.loads((out / "dsgpt2_run.json").read_text())
    del record["files"]  # an export made before the record listed its files
    (out / "dsgpt2_run.json").write_text(json.dumps(record))
    line = _fails(capsys, "export", "--ckpt_dir", ckpt, "--out", str(out), "--ckpt_id", "global_step2",
                  "--overwrite")  # fmt: skip
    assert "holds an export and other files (global_step9, latest)" in line, line
    assert (out / "latest").read_text() == "global_step9" and (out / "global_step9").is_dir()


def test_writers_refuse_a_directory_of_other_files_even_when_told_to_overwrite(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    config = str(run["config"])
    for argv in (
        ["vocab", "train", "--from_mongo", "--config", config, "--out", str(mine), "--overwrite"],
        ["vocab", "download", "--config", config, "--out", str(mine)],
        ["export", "--ckpt_dir", str(run["ckpt"]), "--out", str(mine), "--overwrite"],
        ["tokenize", "--config_train", config, "--vocab_dir", str(run["tok"]), "--cache_dir", str(mine),
         "--context_length", "32", "--overwrite"],
    ):  # fmt: skip
        line = _fails(capsys, *argv)
        assert str(mine) in line and "not a" in line, line
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert (mine / "notes.txt").read_text() == "keep"


def test_tokenize_refuses_the_cache_of_other_data_unless_told(
    run: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    common = ["tokenize", "--config_train", str(run["config"]), "--vocab_dir", str(run["tok"]),
              "--cache_dir", str(cache), "--num_workers", "0"]  # fmt: skip
    assert main([*common, "--context_length", "32"]) == 0
    meta = (cache / "cache.json").read_text()
    assert main([*common, "--context_length", "32"]) == 0  # the same data: up to date
    capsys.readouterr()
    line = _fails(capsys, *common, "--context_length", "16")
    assert "context" in line and "--overwrite" in line and (cache / "cache.json").read_text() == meta
    assert main([*common, "--context_length", "16", "--overwrite"]) == 0
    assert json.loads((cache / "cache.json").read_text())["fingerprint"]["context"] == 16
    # Its record damaged since (written whole or not at all, so by something else): the cache is built
    # again, with a warning, not a traceback.
    (cache / "cache.json").write_text('{"format": 2, "fingerp')
    logger = logging.getLogger("dsgpt2.data.cache")  # caught here whatever the CLI did to logging before
    logger.addHandler(caplog.handler)
    try:
        assert main([*common, "--context_length", "16"]) == 0
    finally:
        logger.removeHandler(caplog.handler)
    assert f"{cache / 'cache.json'} is damaged: the cache is built again" in caplog.text
    assert json.loads((cache / "cache.json").read_text())["fingerprint"]["context"] == 16


def test_a_writer_killed_mid_write_leaves_the_earlier_artifact_whole(tmp_path: Path) -> None:
    """A crash between the two renames of the swap: the next writer puts the earlier one back."""
    import os

    from dsgpt2.files import staged_dir

    out = tmp_path / "tok"
    with staged_dir(out) as staging:
        (staging / "a").write_text("first")
    # As a writer killed after moving the old artifact aside and before moving its own in leaves it.
    gone = 2**22 + 1  # above Linux's largest pid: no process has it
    aside = tmp_path / f".tok.staging-{gone}-x-old"
    os.replace(out, aside)
    (tmp_path / f".tok.staging-{gone}-y").mkdir()  # its half-written new one
    with pytest.raises(RuntimeError), staged_dir(out) as staging:
        assert (out / "a").read_text() == "first"  # back in place before anything else
        raise RuntimeError("this writer fails too")
    assert (out / "a").read_text() == "first" and _leftovers(tmp_path) == []


def test_two_vocab_trains_into_one_directory_at_once_leave_one_whole_tokenizer(
    run: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "tok"
    argv = ["vocab", "train", "--from_mongo", "--config", str(run["config"]), "--out", str(out),
            "--vocab_size", "300", "--no_progress"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "python"), "-m", "dsgpt2", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(p.communicate(timeout=deadline(300))[1], p.returncode) for p in procs]
    results = [(code, err) for err, code in results]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "holds a tokenizer" in refused and "--overwrite" in refused and "Traceback" not in refused
    from dsgpt2.tokenizer.bpe import load_tokenizer

    assert load_tokenizer(out).get_vocab_size() == 300 and _leftovers(tmp_path) == []
