from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_cli, store_config, write_config
from dsgpt2.cli.main import build_parser, main
from dsgpt2.settings.options import listed_flags, make_optional, subcommands
from dsgpt2.train.config import trainer_parser as train_parser
from pace import deadline


def _commands(parser=None, prefix=()) -> list[tuple[str, ...]]:
    """Every command path, nested ones included: ("ingest",), ("vocab", "train"), ..."""
    parser = parser or build_parser()
    subs = subcommands(parser)
    if not subs:
        return [prefix]
    out = [prefix] if prefix else []
    for name, sub in sorted(subs.items()):
        out += _commands(sub, (*prefix, name))
    return out


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, *_ in _commands():
        assert name in out
    assert "MONGO_CONNECTION_STRING" in out


@pytest.mark.parametrize("path", _commands(), ids=" ".join)
def test_each_command_has_help(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: dsgpt2 {' '.join(path)}" in out
    assert len(out.splitlines()) > 5  # a description and the options, not just a usage line


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    return store_config(tmp_path)[0]


def _one_line_error(result, *needles: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_cli_input_is_one_line_and_exit_2(tmp_path: Path, cfg: Path) -> None:
    txt = tmp_path / "t.txt"
    txt.write_text("hello\n")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{oops")
    unknown = write_config(tmp_path / "u.json", MONGO_CONNECTION_DB="d", COLLECTIONS=["a"], COLECTIONS=["a"])
    cases = [
        (["ingest", "--config", str(cfg), "--batch_size", "-3", str(txt)], ["--batch_size", "positive"]),
        (["ingest", "--config", str(cfg), "--batch_size", "x", str(txt)], ["--batch_size", "'x'"]),
        (["ingest", "--config", str(tmp_path / "none.json"), str(txt)], ["none.json", "not found"]),
        (["ingest", "--config", str(bad_json), str(txt)], ["not valid JSON", "line 1"]),
        (["ingest", "--config", str(unknown), str(txt)], ["COLECTIONS", "valid keys"]),
        (["ingest", "--config", str(cfg), "--format", "xml", str(txt)], ["--format", "invalid choice"]),
        (["ingest", "--config", str(cfg)], ["FILE", "--sample"]),
        (["ingest", "--config", str(cfg), str(tmp_path / "missing.txt")], ["missing.txt", "not found"]),
        (["ingest", "--config", str(cfg), "--limit", "5", str(txt)], ["--limit", "--sample"]),
        # The toolkit's own records are no corpus: not written into, not marked.
        (
            ["ingest", "--config", str(cfg), "--collection", "meta_info", str(txt)],
            ["the toolkit's own records"],
        ),
        (["curate", "--config", str(cfg), "--collection", "meta_info"], ["'meta_info'", "the toolkit's own"]),
        (["validate", "--config", str(cfg), "--fix", "--collection", "meta_info"], ["the toolkit's own"]),
        (["validate"], ["--config"]),
        (["nonsense"], ["invalid choice"]),
    ]
    for args, needles in cases:
        _one_line_error(run_cli(*args), *needles)


def test_unreachable_server_via_cli_never_prints_the_password(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path / "c.json",
        MONGO_CONNECTION_DB="d",
        COLLECTIONS=["a"],
        SERVER_SELECTION_TIMEOUT_MS=300,
    )
    env = {"MONGO_CONNECTION_STRING": "mongodb://user:secret@127.0.0.1:1/"}
    for command in ("info", "validate"):
        result = run_cli(command, "--config", str(cfg), "-v", env=env)
        _one_line_error(result, "127.0.0.1:1", "MONGO_CONNECTION_STRING")
        assert "secret" not in result.stdout + result.stderr


def test_ingest_then_info_through_the_cli(tmp_path: Path, cfg: Path) -> None:
    txt = tmp_path / "t.txt"
    txt.write_text("one\ntwo\n\nthree\n")
    result = run_cli("ingest", "--config", str(cfg), str(txt))
    assert result.returncode == 0, result.stderr
    assert "3 inserted, 1 skipped (empty: 1)" in result.stdout
    info = run_cli("info", "--config", str(cfg), "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["documents"] == 3
    assert data["collections"][0]["sources"][0]["complete"] is True


@pytest.mark.slow
def test_demo_runs_every_stage(tmp_path: Path) -> None:
    result = run_cli(
        "demo", "--out", str(tmp_path / "demo"), "--limit", "1000", "--steps", "12", "--chat_steps", "6",
        "--no_progress",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # No noise a newcomer must learn to ignore: no warning about a model "trained on None", none
    # of DeepSpeed's accelerator guess or transformers' loss_type notice.
    for noise in ("trained on None", "held out", "Setting accelerator", "loss_type", "Traceback"):
        assert noise not in result.stderr, noise
    # Nor any warning at all: a deprecated call of ours (FutureWarning, transformers' notices), or
    # DeepSpeed's scheduler complaining in its own constructor.
    output = (result.stdout + result.stderr).splitlines()  # DeepSpeed logs to stdout
    warned = [line for line in output if re.search(r"(?i)warn|deprecat", line)]
    assert not warned, warned
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    # Its training runs are told the connection config in memory: no file of it on disk.
    assert list((tmp_path / "demo").rglob("mongo.json")) == []
    assert summary["ingest"]["documents"] == 1000
    assert summary["validate"] == "ok"
    assert summary["read"]["documents"] == 1000
    assert summary["read"]["queries_per_1000_docs"] <= 2
    assert summary["vocab_download"]["documents"] == 1000
    assert summary["vocab"]["vocab_size"] > 1000
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(summary["vocab"]["dir"])) == summary["vocab"]["vocab_size"]
    assert summary["train"]["steps"] == 12 and summary["train"]["val_ppl"] < summary["vocab"]["vocab_size"]
    # The demo's pretraining recipe: micro-batches of 16, Muon under WSD, a model without dropout.
    import yaml

    resolved = yaml.safe_load((tmp_path / "demo" / "train" / "config.yaml").read_text())
    ds = json.loads(Path(resolved["deepspeed_config"]).read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 16 and resolved["lr_schedule"] == "wsd"
    assert resolved["optimizer"] == "muon"  # the default for a new run, and the demo's
    model_config = json.loads((Path(summary["export"]["dir"]) / "config.json").read_text())
    assert model_config["resid_pdrop"] == model_config["embd_pdrop"] == model_config["attn_pdrop"] == 0
    assert Path(summary["train"]["plot"]).exists()
    assert (Path(summary["export"]["dir"]) / "model.safetensors").exists()
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["tokens"] == after["tokens"] > 0
    assert after["perplexity"] < before["perplexity"]
    assert 0 < after["bpb"] < before["bpb"] and summary["train"]["val_bpb"] > 0
    assert f"bits per byte {before['bpb']} untrained → {after['bpb']}" in result.stdout
    assert 0.7 * summary["vocab"]["vocab_size"] < before["perplexity"] < 1.5 * summary["vocab"]["vocab_size"]
    assert summary["sample"]["prompt"] and 0 < summary["sample"]["tokens"] <= 40
    chat = summary["chat"]
    assert summary["chat_ingest"]["conversations"] == 1000 and chat["train"]["steps"] == 6
    assert chat["reply_loss_after"]["loss"] < chat["reply_loss_before"]["loss"]
    assert chat["exchange"]["user"] and isinstance(chat["exchange"]["bot"], str)
    assert (Path(chat["dir"]) / "model.safetensors").exists()
    lines = result.stdout.splitlines()
    assert "dsgpt2 demo: summary" in lines
    assert any(line.strip().startswith("validation    perplexity") for line in lines)
    assert any(line.strip().startswith("sample") for line in lines)


def test_one_spelling_old_ones_hidden_no_abbreviations(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    new = parser.parse_args(["vocab", "train", "--from_mongo", "--config", "c.json", "--vocab_size", "300"])
    old = parser.parse_args(["vocab", "train", "--from-mongo", "--config", "c.json", "--vocab-size", "300"])
    assert vars(new) == vars(old) and new.vocab_size == 300 and new.from_mongo
    ev = ["evaluate", "--model", "m", "--config", "c.json"]
    masks = ([], ["--doc_mask"], ["--no_doc_mask"], ["--no-doc_mask"])
    assert [parser.parse_args([*ev, *m]).doc_mask for m in masks] == [None, True, False, False]
    with pytest.raises(SystemExit):
        parser.parse_args(["vocab", "train", "--help"])
    shown = capsys.readouterr().out
    assert "--vocab_size" in shown and "--no_progress" in shown and "--vocab-size" not in shown
    # A prefix is not a flag: `--vocab 300` is an error, not --vocab_size.
    with pytest.raises(SystemExit) as exited:
        main(["vocab", "train", "--from_mongo", "--config", "c.json", "--vocab", "300"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --vocab 300" in err and err.count("\n") == 1


def test_info_on_a_missing_collection_names_it_and_the_fix(tmp_path: Path, cfg: Path) -> None:
    result = run_cli("info", "--config", str(cfg))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "does not exist in database" in line and "it holds no corpus collection" in line
    assert f"dsgpt2 ingest --config {cfg} --collection" in line
    txt = tmp_path / "t.txt"
    txt.write_text("one\n")
    assert run_cli("ingest", "--config", str(cfg), "--collection", "other", str(txt)).returncode == 0
    line = run_cli("info", "--config", str(cfg)).stderr.strip()
    assert "it holds" in line and "other" in line


def test_the_product_never_imports_the_embedded_server_or_a_test_double() -> None:
    """SecantusDB (GPL) runs as a process of its own; mongomock is no part of the product."""
    code = (
        "import sys, dsgpt2.cli.main, dsgpt2.db.wrapper, dsgpt2.db.idx, dsgpt2.db.embedded, "
        "dsgpt2.train.trainer, dsgpt2.infer.serve, dsgpt2.cli.pipeline\n"
        "for m in ('corpus', 'db', 'vocab', 'train', 'infer', 'demo'):\n"
        "    __import__('dsgpt2.cli.' + m)\n"
        "print(any(m.split('.')[0] in ('mongomock', 'secantus') for m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("name", ["bad$name", "system.profile", ""])
def test_ingest_into_an_impossible_collection_is_one_line(tmp_path: Path, cfg: Path, name: str) -> None:
    txt = tmp_path / "t.txt"
    txt.write_text("one\n")
    result = run_cli("ingest", "--config", str(cfg), "--collection", name, str(txt))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"--collection {name!r} is not a collection name" in line


def test_vocab_download_into_a_file_is_one_line(tmp_path: Path, cfg: Path) -> None:
    txt = tmp_path / "t.txt"
    txt.write_text("one\ntwo\n")
    assert run_cli("ingest", "--config", str(cfg), str(txt)).returncode == 0
    for out in (txt, txt / "shards"):
        result = run_cli("vocab", "download", "--config", str(cfg), "--out", str(out))
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert f"{txt} is a file" in line
    assert txt.read_text() == "one\ntwo\n"


def test_a_named_pipe_given_as_a_file_is_said_to_be_one_and_never_opened(tmp_path: Path, cfg: Path) -> None:
    """A named pipe (or a device) where a file is read was "not found", or waited forever for a writer
    (the connection config, the DeepSpeed config): opened, a pipe waits for one."""
    fifo, recipe = tmp_path / "pipe.json", tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    os.mkfifo(recipe)
    pipe = "a named pipe, not a regular file"
    for args, said in (
        (["ingest", "--config", str(cfg), str(fifo)], f"input file '{fifo}': {pipe}"),
        (
            ["ingest", "--config", str(cfg), "/dev/null"],
            "'/dev/null': a character device, not a regular file",
        ),
        (["info", "--config", str(fifo)], f"config file '{fifo}': {pipe}"),
        (["train", "--config", str(recipe)], f"--config {recipe}: {pipe}"),
        (["train", "--config_train", str(fifo)], f"--config_train {fifo}: {pipe}"),
        (
            ["train", "--config_train", str(cfg), "--model_config", str(fifo)],
            f"--model_config {fifo}: {pipe}",
        ),
        (
            ["vocab", "train", "--input", str(fifo), "--out", str(tmp_path / "v")],
            "a named pipe, not a directory",
        ),
        (
            ["generate", "--model", str(tmp_path), "--prompts_file", str(fifo)],
            f"--prompts_file {fifo}: {pipe}",
        ),
        (["decontaminate", "--config", str(cfg), "--against", str(fifo)], f"--against {fifo}: {pipe}"),
    ):
        _one_line_error(run_cli(*args), said)
    from dsgpt2.errors import ConfigError
    from dsgpt2.optim.ds_config import read_ds_config

    with pytest.raises(ConfigError, match=f"--deepspeed_config .*pipe.json: {pipe}"):
        read_ds_config(fifo)


def test_a_flag_the_launcher_does_not_have_is_one_line_naming_it() -> None:
    """DeepSpeed's runner answered with its whole usage (forty lines)."""
    result = run_cli("launch", "--bogus", "--num_gpuz", "2", "ds_trainer.py")
    _one_line_error(
        result,
        "dsgpt2 launch: error: unrecognized arguments: --bogus --num_gpuz; did you mean --num_gpus?",
        "deepspeed --help",
    )


def test_a_rank_killed_by_a_signal_is_named_and_the_launch_exits_as_a_shell_reports_it(
    tmp_path: Path,
) -> None:
    """DeepSpeed's launchers exit 247 (-9 as a status) for a rank the kernel killed, and say no more."""
    from dsgpt2.collective import free_port

    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ.get('RANK') == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    result = run_cli("launch", "--num_gpus", "2", "--master_port", str(free_port()), str(script))
    assert result.returncode == 137, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("dsgpt2 launch: error:")]
    assert len(errors) == 1 and "a rank was killed by SIGKILL (the kernel's out-of-memory killer" in errors[0]
    assert "the same command resumes from the last whole checkpoint" in errors[0]


def test_a_launch_killed_by_sigkill_takes_its_ranks_with_it(tmp_path: Path) -> None:
    """The runner is in a process group of its own: the ranks trained on, unwatched, after the command
    was killed, and the same command run again met them (their port, their checkpoints)."""
    import psutil

    from dsgpt2.collective import free_port
    from pace import wait_for

    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, pathlib, sys, time\n"
        "pathlib.Path(sys.argv[-1], 'rank' + os.environ['RANK']).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    argv = ["launch", "--num_gpus", "2", "--master_port", str(free_port()), str(script), str(tmp_path)]
    launch = subprocess.Popen([sys.executable, "-m", "dsgpt2", *argv], cwd=ROOT, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        files = [tmp_path / "rank0", tmp_path / "rank1"]
        wait_for(lambda: all(f.exists() and f.read_text() for f in files), 60, "both ranks", launch)
        tree = psutil.Process(launch.pid).children(recursive=True)
        assert {int(f.read_text()) for f in files} <= {p.pid for p in tree}
        launch.kill()
        launch.wait()
        _, alive = psutil.wait_procs(tree, timeout=deadline(10))
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        for p in [*tree, psutil.Process(launch.pid)] if launch.poll() is None else tree:
            with contextlib.suppress(psutil.Error):
                p.kill()
        launch.wait()


def test_the_command_line_starts_without_torch() -> None:
    """`dsgpt2 info`, `--help` and the argument errors answer in a fraction of a second."""
    code = "import sys, dsgpt2.cli.main as c; c.build_parser(); print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.stdout.strip() == "False", result.stderr


def test_settings_come_from_their_dataclass_through_the_flags() -> None:
    """Each flag lands in its settings object by one road (``from_namespace``), renamed flags too."""
    from dsgpt2.infer.settings import EvalRequest, ServeLimits
    from dsgpt2.settings.options import from_namespace
    from dsgpt2.tokenizer.texts import DownloadSettings, Draw

    parse = build_parser().parse_args
    ev = ["evaluate", "--model", "m", "--config", "c.json"]
    request = from_namespace(EvalRequest, parse(
        [*ev, "--collection", "news", "--collection", "wiki", "--stop", "50", "--split_seed", "4",
         "--context_length", "32", "--num_workers", "0", "--no_doc_mask"]
    ))  # fmt: skip
    assert request.collections == ("news", "wiki") and request.window == (0, 50)
    assert (request.seed, request.context, request.workers, request.doc_mask) == (4, 32, 0, False)
    assert from_namespace(EvalRequest, parse(ev)) == EvalRequest()
    serve = parse(["serve", "--model", "m", "--max_tokens_limit", "32", "--max_new_tokens", "9"])
    assert from_namespace(ServeLimits, serve) == ServeLimits(max_new_tokens=32) and serve.max_new_tokens == 9
    down = parse(["vocab", "download", "--config", "c", "--count", "7", "--shards", "3", "--overwrite"])
    assert from_namespace(Draw, down) == Draw(count=7)
    assert from_namespace(DownloadSettings, down) == DownloadSettings(shards=3, overwrite=True)


def test_a_commands_positionals_may_follow_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    """`db status --json local://DIR` is `db status local://DIR --json`, as a user expects."""
    parse = build_parser().parse_args
    for argv in (["db", "status", "--json", "local://d"], ["db", "--json", "status", "local://d"],
                 ["db", "status", "local://d", "--json"]):  # fmt: skip
        args = parse(argv)
        assert (args.action, args.database, args.json) == ("status", "local://d", True), argv
    with pytest.raises(SystemExit) as ended:
        parse(["db", "status", "--json", "local://d", "extra"])
    assert ended.value.code == 2 and "unrecognized arguments: extra" in capsys.readouterr().err


def test_bad_settings_are_one_line_naming_the_flag(tmp_path: Path, cfg: Path) -> None:
    ev = ["evaluate", "--model", str(tmp_path / "no-model"), "--config", str(cfg)]
    down = ["vocab", "download", "--config", str(cfg), "--out", str(tmp_path / "shards")]
    cases = [
        ([*ev, "--start", "-1"], ["--start", "at least 0"]),
        ([*ev, "--start", "9", "--stop", "3"], ["--start/--stop"]),
        ([*ev, "--tr_ratio", "2"], ["--tr_ratio", "(0, 1]"]),
        ([*down, "--fraction", "0.5", "--count", "3"], ["--fraction or --count"]),
        ([*down, "--fraction", "0"], ["--fraction must be in (0, 1]"]),
        ([*down, "--seed", "-2"], ["--seed", "at least 0"]),
        ([*ev, "--split_seed", "-3"], ["--split_seed", "between 0 and 9223372036854775807"]),
        (["serve", "--model", "m", "--api_key", ""], ["--api_key is empty; give a key"]),
        (
            ["train", "--config_train", str(cfg), "--early_stopping", "--tr_ratio", "1"],
            ["and --tr_ratio 1 leaves none"],
        ),
        (["train", "--config_train", str(cfg), "--context_length", "1"], ["between 2 and"]),
        (
            ["train", "--config_train", str(cfg), "--seed", "-1"],
            ["--seed", "between 0 and 9223372036854775807"],
        ),
        (["train", "--config_train", str(cfg), "--lr", "1e308"], ["--lr must be a number in (0, 1000.0]"]),
        (
            ["serve", "--model", "m", "--max_tokens_limit", "8", "--max_new_tokens", "9"],
            ["--max_tokens_limit"],
        ),
    ]
    for args, needles in cases:
        _one_line_error(run_cli(*args), *needles)
    assert not (tmp_path / "shards").exists()


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    subs = subcommands(parser)
    if not subs:
        return [(path, parser)]
    return [leaf for name, sub in subs.items() for leaf in _leaves(sub, (*path, name))]


def test_a_misspelt_flag_or_command_gets_a_suggestion_from_every_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--train_iter 300` is answered with the flag meant, by every command (its own flags, not the
    top level's), as an experiment file's misspelt key is; a misspelt command too."""
    parser = build_parser()
    leaves = _leaves(parser)
    for _, leaf in leaves:  # nothing required: the misspelt flag is the one error
        make_optional(leaf)
    assert len(leaves) > 20
    for path, leaf in leaves:
        if path in (("train",), ("launch",)):  # their flags are the trainer's (below) and the launcher's
            continue
        flag = [f for f in listed_flags(leaf) if f.startswith("--") and len(f) > 5][-1]
        with pytest.raises(SystemExit) as exited:
            parser.parse_args([*path, flag[:-1]])
        assert exited.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"unrecognized arguments: {flag[:-1]}; did you mean {flag}? "
                            f"(see `dsgpt2 {' '.join(path)} --help`)"), err  # fmt: skip
    for typo, meant in (["trian"], "train"), (["vocab", "donwload"], "download"):
        with pytest.raises(SystemExit):
            parser.parse_args(typo)
        assert f"; did you mean {meant!r}?" in capsys.readouterr().err
    # ds_trainer.py's parser too.
    with pytest.raises(SystemExit):
        train_parser().parse_args(["--config_train", "c.json", "--train_iter", "300"])
    assert "unrecognized arguments: --train_iter 300; did you mean --train_iters?" in capsys.readouterr().err


def test_bad_ports_garbage_files_and_huge_numbers_are_one_line(tmp_path: Path) -> None:
    """What had ended in a traceback, a Rust panic or the kernel's OOM killer: a connection string's
    port that is not a number (its password never printed), a binary DeepSpeed config or HellaSwag
    file, a directory as the HellaSwag file, sizes no machine holds."""
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])
    for uri in ("mongodb://alice:S3cretPW@dbhost:27x17/", "mongodb://alice:S3cretPW@dbhost:99999/"):
        result = run_cli("info", "--config", str(cfg), env={"MONGO_CONNECTION_STRING": uri})
        _one_line_error(result, "invalid MONGO_CONNECTION_STRING", "alice:***@dbhost")
        assert "S3cretPW" not in result.stdout + result.stderr
    # An option pymongo does not know (it would ignore it with a warning): refused, the meant one named.
    # No value is shown: a misspelt secret option is not known to be one.
    uri = "mongodb://alice:S3cretPW@dbhost/?w=1;readPreferance=secondary&tlsCertificateKeyFilePasword=V4lue"
    result = run_cli("info", "--config", str(cfg), env={"MONGO_CONNECTION_STRING": uri})
    _one_line_error(
        result, "mongodb://alice:***@dbhost/?w=***;readPreferance=***&tlsCertificateKeyFilePasword=***"
    )
    uri = uri.replace(";", "&")
    result = run_cli("info", "--config", str(cfg), env={"MONGO_CONNECTION_STRING": uri})
    meant = "(did you mean tlscertificatekeyfilepassword?)"
    _one_line_error(
        result,
        f"option 'readPreferance' (did you mean readpreference?), 'tlsCertificateKeyFilePasword' {meant}",
    )
    out = result.stdout + result.stderr
    assert "S3cretPW" not in out and "V4lue" not in out and "UserWarning" not in out
    # A value pymongo cannot use (it would drop it with a warning), a CA file that is not there.
    for option, said in (
        ("authMechanism=BOGUS", "authmechanism must be in"),
        ("serverSelectionTimeoutMS=abc", "must be an integer or float"),
        ("tls=true&tlsCAFile=/no/such/ca.pem", "tlscafile file is not readable"),
    ):
        uri = f"mongodb://alice:S3cretPW@dbhost/?{option}"
        result = run_cli("info", "--config", str(cfg), env={"MONGO_CONNECTION_STRING": uri})
        _one_line_error(result, "invalid MONGO_CONNECTION_STRING 'mongodb://alice:***@dbhost/?", said)
        assert "S3cretPW" not in result.stdout + result.stderr and "Warning" not in result.stderr
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(bytes(range(128, 256)) * 4)
    from dsgpt2.errors import ConfigError
    from dsgpt2.optim.ds_config import read_ds_config

    with pytest.raises(ConfigError, match=r"--deepspeed_config .*garbage.json: not a JSON file"):
        read_ds_config(garbage)
    from dsgpt2.model.hellaswag import read_examples

    for hellaswag, why in (
        (garbage, "not JSON lines .its bytes are not UTF-8"),
        (tmp_path, "a directory, not"),
    ):
        with pytest.raises(ConfigError, match=why):
            read_examples(hellaswag)
    for args, needles in (
        (["dedup", "--config", str(cfg), "--near", "--num_perm", "100000000000"], ["--num_perm", "8192"]),
        (["vocab", "train", "--out", str(tmp_path / "v"), "--vocab_size", "99999999999"], ["--vocab_size"]),
        (["vocab", "train", "--out", str(tmp_path / "v"), "--reserved", "99999999999"], ["--reserved"]),
        (["evaluate", "--model", str(tmp_path), "--num_workers", "99999"], ["--num_workers", "256"]),
        (
            ["train", "--config_train", str(cfg), "--context_length", "99999999"],
            ["--context_length", "1048576"],
        ),
    ):
        _one_line_error(run_cli(*args), *needles)


def test_a_path_this_user_may_not_use_is_one_line(tmp_path: Path) -> None:
    """A PermissionError anywhere (a read-only database directory, an unreadable checkpoint file)
    names the path and exits 2, as the commands that check their paths first do."""
    from dsgpt2.exits import run_command

    def denied() -> int:
        raise PermissionError(13, "Permission denied", str(tmp_path / "db" / "server.lock"))

    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert run_command("dsgpt2", denied) == 2
    assert err.getvalue() == (
        f"dsgpt2: error: cannot use {tmp_path / 'db' / 'server.lock'}: Permission denied; "
        "check its owner and mode\n"
    )


def test_an_allocation_that_fails_is_one_line_and_any_other_error_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --context_length the host cannot hold failed in torch's allocator with a traceback: the
    machine's limit is one line naming what to lower, exit 1; a bug still shows its traceback."""
    from dsgpt2.exits import run_command

    def asks(exc: BaseException) -> Any:
        def command() -> int:
            raise exc

        return command

    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 999998000001 bytes.")  # fmt: skip
    import torch

    for exc in (
        cpu,
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),
    ):
        assert run_command("dsgpt2", asks(exc)) == 1
        err = capsys.readouterr().err
        assert err.startswith("dsgpt2: error: out of memory (") and "--context_length" in err, err
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(RuntimeError, match="a bug"):
        run_command("dsgpt2", asks(RuntimeError("a bug")))


def test_a_ctrl_c_once_the_command_has_ended_changes_nothing_and_prints_no_traceback() -> None:
    """Run as the process's command, dsgpt2 ignores a Ctrl-C once its command has ended (the interpreter
    then joins pymongo's threads at exit); called from Python with arguments, it leaves SIGINT alone."""
    code = (
        "import signal, sys\n"
        "from dsgpt2.cli.main import main\n"
        "main(['db', 'status', '--json'])\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
        "sys.argv = ['dsgpt2', 'db', 'status', '--json']\n"
        "main()\n"
        "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            timeout=deadline(120))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True" and result.stdout.splitlines()[-3] == "True", (
        result.stdout
    )
