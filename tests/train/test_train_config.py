"""The training configuration: defaults in one place, checks on construction, the derived parser."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from dsgpt2 import accelerator
from dsgpt2.errors import ConfigError
from dsgpt2.train import trainer
from dsgpt2.train.config import (
    DEFAULT_CHUNK_DOCS,
    DEFAULT_SEED,
    DEFAULT_TR_RATIO,
    CheckpointOptions,
    DataOptions,
    EngineOptions,
    ModelOptions,
    RunOptions,
    TrainConfig,
    parse,
    trainer_parser,
)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "mongo.json").write_text("{}")
    (tmp_path / "ds.json").write_text("{}")
    return {"tok": tmp_path / "tok", "mongo": tmp_path / "mongo.json", "ds": tmp_path / "ds.json"}


def argv(files: dict[str, Path], *extra: str) -> list[str]:
    return ["--deepspeed_config", str(files["ds"]), "--config_train", str(files["mongo"]),
            "--vocab_dir", str(files["tok"]), *extra]  # fmt: skip


def test_parsed_defaults_are_the_dataclass_defaults(files: dict[str, Path]) -> None:
    cfg = parse(argv(files))
    assert (cfg.data.tr_ratio, cfg.data.seed, cfg.data.chunk_docs) == (
        DEFAULT_TR_RATIO, DEFAULT_SEED, DEFAULT_CHUNK_DOCS,
    )  # fmt: skip
    assert cfg.run == RunOptions() and cfg.ckpt == CheckpointOptions() and cfg.model == ModelOptions()
    # tokenize takes the same data flags, with the same defaults.
    from dsgpt2.cli.main import build_parser as cli_parser

    ns = cli_parser().parse_args(["tokenize", "--config_train", str(files["mongo"])])
    assert (ns.tr_ratio, ns.seed, ns.chunk_docs) == (DEFAULT_TR_RATIO, DEFAULT_SEED, DEFAULT_CHUNK_DOCS)


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda f: DataOptions(config_train=f["mongo"], vocab_dir=f["tok"], tr_ratio=1.5), "--tr_ratio"),
        (lambda f: DataOptions(config_train=f["mongo"], vocab_dir=f["tok"], chunk_docs=0), "--chunk_docs"),
        (lambda f: RunOptions(train_iters=-3), "--train_iters"),
        (lambda f: ModelOptions(model_select="huge"), "--model_select"),
        (lambda f: CheckpointOptions(no_resume=True, ckpt_id="global_step2"), "--no_resume"),
    ],
)
def test_config_made_in_code_is_checked_like_flags(files: dict[str, Path], make, flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        make(files)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda f: TrainConfig(DataOptions(config_train=f["mongo"].with_name("nope.json"))),
            r"--config_train .*nope\.json: file not found",
        ),
        (
            lambda f: TrainConfig(DataOptions(config_train=f["mongo"], vocab_dir=f["mongo"].parent)),
            r"--vocab_dir .*: no tokenizer\.json",
        ),
        (
            lambda f: TrainConfig(DataOptions(f["mongo"]), ModelOptions(model_config=f["tok"] / "m.json")),
            r"--model_config .*m\.json: file not found",
        ),
        (
            lambda f: TrainConfig(DataOptions(f["mongo"]), ModelOptions(init_from=f["tok"] / "model")),
            r"--init_from .*model: not found",
        ),
        (
            lambda f: TrainConfig(DataOptions(f["mongo"]), run=RunOptions(hellaswag=f["mongo"].parent / "h")),
            r"--hellaswag .*h: file not found",
        ),
        (
            lambda f: TrainConfig(DataOptions(f["mongo"], f["tok"]), engine=EngineOptions(None)),
            r"--deepspeed_config is required",
        ),
    ],
)
def test_files_are_checked_as_the_run_is_built_not_as_the_config_is_made(
    files: dict[str, Path], make, message: str
) -> None:
    cfg = make(files)
    with pytest.raises(ConfigError, match=message):
        cfg.check_files()


def test_a_directory_as_model_config_is_said_to_be_one_and_its_config_json_named(
    files: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    cfg = TrainConfig(DataOptions(files["mongo"]), ModelOptions(model_config=model))
    with pytest.raises(ConfigError, match=r"--model_config .*model: a directory, not a file$"):
        cfg.check_files()
    (model / "config.json").write_text('{"n_layer": 2}')
    with pytest.raises(
        ConfigError,
        match=r"model: a directory, not a file; its model config is --model_config .*config\.json$",
    ):
        cfg.check_files()


def test_vocab_dir_default_is_checked(files: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(data=DataOptions(config_train=files["mongo"]))
    with pytest.raises(ConfigError, match=r"--vocab_dir runs/tokenizer: no tokenizer\.json"):
        cfg.check_files()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tokenizer").symlink_to(files["tok"])
    cfg.check_files()
    assert cfg.data.vocab_dir == Path("runs/tokenizer")


def test_a_config_made_in_code_needs_no_connection_config_file(files: dict[str, Path]) -> None:
    """The connection config can be handed to the trainer's build instead (the demo's)."""
    cfg = TrainConfig(DataOptions(config_train=None, vocab_dir=files["tok"]))
    cfg.check_files()
    assert cfg.data.config_train is None and "config_train" not in cfg.resolved()
    with pytest.raises(ConfigError, match="--config_train is required"):
        trainer.build(cfg)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"n_layer": 2, "n_layers": 4}', "unknown key(s) n_layers; GPT-2 configs have"),
        # Zero layers trained the embeddings alone, silently; a width as text ended in a traceback.
        ('{"n_layer": 0}', "n_layer must be a whole number of at least 1, not 0"),
        ('{"n_head": -2}', "n_head must be a whole number of at least 1, not -2"),
        ('{"n_embd": "wide"}', "Validation error for field 'n_embd': TypeError: Field 'n_embd' expected int"),
        ('{"attn_pdrop": 1.0}', "attn_pdrop must be a probability in [0, 1), not 1.0"),
    ],
)
def test_model_config_is_one_clear_line(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    bad = tmp_path / "model.json"
    bad.write_text(content)
    assert trainer.main(argv(files, "--model_config", str(bad))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ds_trainer.py: error: --model_config") and expected in err
    assert "\n" not in err


def test_model_config_accepts_what_save_pretrained_writes(files: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GPT2Config

    from dsgpt2.train.engine import run_context

    GPT2Config(n_layer=2, n_embd=64, n_head=2).save_pretrained(str(tmp_path / "m"))
    cfg = parse(argv(files, "--model_config", str(tmp_path / "m" / "config.json")))
    assert run_context(cfg.model) == 1024


def test_no_silent_abbreviations_and_hidden_old_spelling(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    # --train_iter is not --train_iters: an error, not a guess.
    with pytest.raises(SystemExit) as exited:
        parse(argv(files, "--train_iter", "5"))
    assert exited.value.code == 2
    assert "unrecognized arguments: --train_iter" in capsys.readouterr().err
    cfg = parse(argv(files, "--distributed-backend", "gloo"))
    assert cfg.engine.distributed_backend == "gloo"
    assert "--distributed-backend" not in trainer_parser().format_help()


def test_config_dump_holds_every_flag(files: dict[str, Path]) -> None:
    dumped = parse(argv(files, "--train_iters", "7")).to_dict()
    assert dumped["train_iters"] == 7 and dumped["vocab_dir"] == str(files["tok"])
    assert json.loads(json.dumps(dumped)) == dumped


def test_the_resolved_configuration_is_frozen_and_each_flag_recorded_once(files: dict[str, Path]) -> None:
    from dataclasses import fields

    cfg = parse(argv(files, "--train_iters", "7"))
    cfg.check_files()
    said = cfg.settle(None)
    assert cfg.optim.optimizer == "muon" and cfg.schedule.lr_schedule == "wsd" and said == []
    cfg.freeze()
    # Every section, and the whole: what the run recorded is what it uses.
    for part, name in ((cfg.data, "vocab_dir"), (cfg.ckpt, "ckpt_dir"), (cfg.optim, "muon_scale"),
                       (cfg.schedule, "lr_schedule"), (cfg, "data")):  # fmt: skip
        with pytest.raises(AttributeError, match="resolved and frozen"):
            setattr(part, name, None)
    assert len(cfg.to_dict()) == sum(len(fields(part)) for part in cfg.parts())  # no flag in two sections
    assert parse(argv(files)).ckpt.frozen is False  # a configuration parsed is not yet


def test_arch_suffixes_deepspeed_cannot_read_are_made_plain() -> None:
    """CUDA images for Hopper set TORCH_CUDA_ARCH_LIST=9.0a, on which DeepSpeed's FusedAdam build
    fails (seen on an H100); the plain arch builds the same ops."""
    import os
    import subprocess
    import sys

    code = (
        "import os; from dsgpt2.accelerator import prepare_deepspeed_environment as p; p(); "
        "print(os.environ['TORCH_CUDA_ARCH_LIST'])"
    )
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "8.0;9.0a;10.0f+PTX"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "8.0;9.0;10.0+PTX"


def test_deepspeed_builds_its_ops_with_the_environments_own_ninja(tmp_path: Path) -> None:
    """A system ninja of another version first on PATH (an environment used without activating it)
    and the environment's own for other commands: each reads the other's build log as stale and
    compiles DeepSpeed's CPU op again (~30 s). Before DeepSpeed is imported, the environment's
    ninja comes first."""
    import os
    import shutil
    import subprocess
    import sys

    own = Path(sys.executable).parent / "ninja"
    if not own.is_file():
        pytest.skip("no ninja in this environment (DeepSpeed's dependency)")
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.0\n")
    (other / "ninja").chmod(0o755)
    code = (
        "import shutil; from dsgpt2.accelerator import prepare_deepspeed_environment as p; "
        "print(shutil.which('ninja')); p(); p(); print(shutil.which('ninja'))"
    )
    env = {**os.environ, "PATH": f"{other}{os.pathsep}/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before == str(other / "ninja") and after == str(own) and shutil.which("ninja") is not None


def test_each_environment_builds_deepspeeds_op_in_its_own_cache_and_says_so_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two environments of one Python shared torch's ~/.cache/torch_extensions/py311_cpu and rebuilt
    each other's op; a user's TORCH_EXTENSIONS_DIR is kept; the first run names the build before it."""
    import logging
    import sys

    from dsgpt2 import accelerator

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "envs" / "a"))
    a = accelerator.extensions_dir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "envs" / "b"))
    b = accelerator.extensions_dir()
    assert a != b and Path(a).parent == Path(b).parent == tmp_path / "cache" / "torch_extensions"
    assert Path(b).name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-b-")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert accelerator.extensions_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with caplog.at_level(logging.INFO, logger="dsgpt2"):
        accelerator.announce_cpu_op_build()
    assert "compiling DeepSpeed's CPU communication op (once per environment, 1-3 min" in caplog.text
    (tmp_path / "mine" / "deepspeed_shm_comm").mkdir(parents=True)
    (tmp_path / "mine" / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsgpt2"):
        accelerator.announce_cpu_op_build()
    assert caplog.text == ""


def test_the_op_loaded_from_the_cache_is_not_announced_as_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capsys: Any
) -> None:
    """DeepSpeed prints "... built successfully" whether it compiled its CPU communication op or
    loaded it from the cache: silent when cached, one line when compiled now."""
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    def deepspeeds(*_: Any) -> object:  # what DeepSpeed's build_shm_op says and returns
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        return object()

    monkeypatch.setattr(ds_torch, "build_shm_op", deepspeeds)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    accelerator.quiet_cached_op_load()
    accelerator.quiet_cached_op_load()  # once wrapped, not twice
    with caplog.at_level(logging.INFO, logger="dsgpt2"):
        assert ds_torch.build_shm_op() is not None  # compiled now: nothing was cached
    assert capsys.readouterr().out == "" and caplog.messages == [
        f"DeepSpeed's CPU communication op compiled, cached in {tmp_path / 'ext' / 'deepspeed_shm_comm'}"
    ]
    Path(accelerator.shm_op_path()).parent.mkdir(parents=True)
    Path(accelerator.shm_op_path()).write_bytes(b"")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsgpt2"):
        ds_torch.build_shm_op()  # loaded from the cache
    assert capsys.readouterr().out == "" and caplog.messages == []


def test_compile_is_on_where_cuda_is_unless_turned_off(files: dict[str, Path]) -> None:
    from dsgpt2.train.engine import compiles

    assert parse(argv(files)).compute.compile is None
    assert parse(argv(files, "--compile")).compute.compile is True
    assert parse(argv(files, "--no_compile")).compute.compile is False
    assert parse(argv(files, "--no-compile")).compute.compile is False
    assert compiles(None, "cuda") and not compiles(None, "cpu")
    assert not compiles(False, "cuda") and compiles(True, "cpu")


def test_an_error_about_the_connection_config_names_the_flag_as_typed(tmp_path: Path) -> None:
    """`train --config FILE.json` is the trainer's --config_train: its error says --config, as typed."""
    from conftest import run_cli

    missing = tmp_path / "nope.json"
    for flag in ("--config", "--config_train"):
        result = run_cli("train", flag, str(missing))
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line == f"dsgpt2 train: error: {flag} {missing}: file not found", line
