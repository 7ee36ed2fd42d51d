"""Every location a command writes is checked before its work starts: a directory that cannot be made or
written there (under a file, on a file system that takes none) is one line, exit 2, and nothing is left
behind; a stored location that holds nothing lists what is stored."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, store_config, write_config
from dsgpt2.errors import ConfigError
from dsgpt2.files import check_writable_dir, unwritable_dir

BEFORE_STORES = ROOT / "tests" / "fixtures" / "before-stores"


def test_a_directory_that_cannot_be_written_is_found_without_leaving_anything(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert unwritable_dir(tmp_path / "new" / "deeper") is None
    assert unwritable_dir(tmp_path) is None
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the probe is gone, nothing was made
    assert unwritable_dir(tmp_path / "file" / "out") == f"{tmp_path / 'file'} is a file, not a directory"
    assert unwritable_dir(tmp_path / "file") == f"{tmp_path / 'file'} is a file, not a directory"
    if Path("/proc").is_dir():
        said = unwritable_dir("/proc/dsgpt2-out")
        assert said == "nothing can be written in /proc (its file system takes no new files)", said
    with pytest.raises(
        ConfigError, match=r"^--out .*/file/out: .* is a file, not a directory; give a directory"
    ):
        check_writable_dir(tmp_path / "file" / "out", "--out")
    # A name of bytes that are not UTF-8 (os.fsdecode's surrogates): the tokenizer could not save there.
    assert "the path is not UTF-8 text" in (unwritable_dir(tmp_path / "model\udcff") or "")


def test_an_output_path_that_is_not_utf8_is_one_line_before_the_export(tmp_path: Path) -> None:
    out = tmp_path / "model\udcff"
    exported = run_cli("export", "--ckpt_dir", str(BEFORE_STORES / "ckpt"), "--vocab_dir",
                       str(BEFORE_STORES / "tok"), "--out", str(out))  # fmt: skip
    assert exported.returncode == 2 and "Traceback" not in exported.stderr, exported.stderr[-2000:]
    line = exported.stderr.strip().splitlines()[-1]
    assert line.startswith("dsgpt2: error: --out ") and "the path is not UTF-8 text" in line, line
    assert os.listdir(tmp_path) == []


@pytest.fixture
def blocked(tmp_path: Path) -> Path:
    """A file where a command's output directory would go."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file"


def _one_line(result, flag: str) -> str:
    assert result.returncode == 2, (result.stdout[-1000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert f"{flag} " in line and "is a file, not a directory; give a directory that can be written" in line
    return line


def test_export_and_vocab_refuse_an_output_under_a_file(blocked: Path, tmp_path: Path) -> None:
    exported = run_cli("export", "--ckpt_dir", str(BEFORE_STORES / "ckpt"), "--vocab_dir",
                       str(BEFORE_STORES / "tok"), "--out", str(blocked / "model"))  # fmt: skip
    _one_line(exported, "--out")
    cfg, _ = store_config(tmp_path, ["a"])
    shards = run_cli("vocab", "download", "--config", str(cfg), "--out", str(blocked / "shards"))
    _one_line(shards, "--out")
    vocab = run_cli("vocab", "train", "--input", str(BEFORE_STORES), "--out", str(blocked / "tok"))
    _one_line(vocab, "--out")
    demo = run_cli("demo", "--out", str(blocked / "demo"))
    _one_line(demo, "--out")
    cache = run_cli("tokenize", "--config_train", str(cfg), "--vocab_dir", str(BEFORE_STORES / "tok"),
                    "--cache_dir", str(blocked / "cache"))  # fmt: skip
    _one_line(cache, "--cache_dir")


def test_a_training_whose_checkpoints_or_workspace_cannot_be_written_stops_before_its_first_step(
    blocked: Path, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="mongodb://127.0.0.1:9",
                       MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])  # fmt: skip
    flags = ["--config_train", str(cfg), "--vocab_dir", str(BEFORE_STORES / "tok"), "--deepspeed_config",
             str(ROOT / "configs" / "ds_config_cpu.json"), "--model_select", "tiny"]  # fmt: skip
    ckpt = run_cli("train", *flags, "--ckpt_dir", str(blocked / "ckpt"), "--workspace", str(tmp_path / "ws"))
    _one_line(ckpt, "--ckpt_dir")
    ws = run_cli("train", *flags, "--ckpt_dir", str(tmp_path / "ckpt"), "--workspace", str(blocked / "ws"))
    _one_line(ws, "--workspace")
    places = ("--ckpt_dir", str(tmp_path / "ckpt"), "--workspace", str(tmp_path / "ws"))
    cached = run_cli("train", *flags, *places, "--data_mode", "cached", "--cache_dir", str(blocked / "cache"))
    _one_line(cached, "--cache_dir")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ws").exists()
    # Another artifact's directory as --ckpt_dir (an export or a tokenizer: an export --overwrite or a
    # tokenizer written again there would take the checkpoints with it); a checkpoint as --workspace.
    tok, tag = BEFORE_STORES / "tok", BEFORE_STORES / "ckpt" / "global_step8"
    for flag, place, said in (("--ckpt_dir", tok, "holds a tokenizer (tokenizer.json), not checkpoints"),
                              ("--workspace", tag, f"is the checkpoint {tag}: its logs and config.yaml"),
                              ("--workspace", tag / "w", f"is inside the checkpoint {tag}")):  # fmt: skip
        others = dict(zip(places[::2], places[1::2], strict=True))
        refused = run_cli("train", *flags, *[x for kv in {**others, flag: str(place)}.items() for x in kv])
        assert refused.returncode == 2 and said in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ws").exists()
    # A stored run is no model to start from: the refusal says how to bring one here.
    stored = run_cli("train", *flags, "--init_from", "gridfs:run1", "--ckpt_dir", str(tmp_path / "ckpt"))
    assert stored.returncode == 2 and "dsgpt2 export --ckpt_dir gridfs:run1" in stored.stderr, stored.stderr


def test_a_wandb_directory_that_cannot_be_written_stops_the_training_before_it_starts(
    blocked: Path, tmp_path: Path
) -> None:
    """wandb's own failure there only warned, and the run trained on without the logging it was asked for;
    with --wandb off the directory is not used, and not checked."""
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="mongodb://127.0.0.1:9",
                       MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])  # fmt: skip
    flags = ["--config_train", str(cfg), "--vocab_dir", str(BEFORE_STORES / "tok"), "--deepspeed_config",
             str(ROOT / "configs" / "ds_config_cpu.json"), "--model_select", "tiny", "--ckpt_dir",
             str(tmp_path / "ckpt"), "--workspace", str(tmp_path / "ws")]  # fmt: skip
    _one_line(
        run_cli("train", *flags, "--wandb", "offline", "--wandb_dir", str(blocked / "wandb")), "--wandb_dir"
    )
    if Path("/proc").is_dir():
        proc = run_cli("train", *flags, "--wandb_dir", "/proc/dsgpt2-wandb")  # the default mode: offline
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            "dsgpt2 train: error: --wandb_dir /proc/dsgpt2-wandb: nothing can be written in /proc (its file "
            "system takes no new files); give a directory that can be written"
        )
    # The check after it says the directory passed.
    off = run_cli("train", *flags, "--wandb", "off", "--wandb_dir", str(blocked / "wandb"), "--hellaswag",
                  str(tmp_path / "h.jsonl"))  # fmt: skip
    assert off.returncode == 2 and "--hellaswag" in off.stderr and "--wandb_dir" not in off.stderr, off.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "ws").exists()


def test_a_stored_model_without_a_connection_names_the_commands_own_flag() -> None:
    for command in (["generate", "--model", "gridfs:run1", "hello"], ["chat", "--model", "gridfs:run1"]):
        done = run_cli(*command)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert "add --db_config c.json" in done.stderr and "--config" not in done.stderr.replace(
            "--db_config", ""
        )
