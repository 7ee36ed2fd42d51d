"""Experiment files (`--config run.yaml` / `run.toml`): any flag as a key, flags typed after it
override it, one line for a bad key or value, tables per command, the shipped examples."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, store_config, write_config
from dsgpt2.cli.main import COMMANDS, SECTIONS
from dsgpt2.cli.main import build_parser as cli_parser
from dsgpt2.settings.options import command_names, subcommands
from dsgpt2.settings.runfile import find_run_file
from dsgpt2.train.config import parse
from zygote import run_python


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "mongo.json").write_text("{}")
    (tmp_path / "ds.json").write_text("{}")
    return {"tok": tmp_path / "tok", "mongo": tmp_path / "mongo.json", "ds": tmp_path / "ds.json"}


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def yaml_run(tmp_path: Path, files: dict[str, Path], extra: str = "") -> Path:
    return write(
        tmp_path / "run.yaml",
        f"config: {files['mongo']}\ndeepspeed_config: {files['ds']}\nvocab_dir: {files['tok']}\n"
        "model_select: tiny\ntrain_iters: 300\nearly_stopping: true\npatience: 2\nlr: 3e-3\n"
        "wandb: off\n" + extra,
    )


def test_a_yaml_file_sets_the_flags_and_the_command_line_overrides_it(
    tmp_path: Path, files: dict[str, Path]
) -> None:
    run = yaml_run(tmp_path, files)
    cfg = parse(["--config", str(run)])
    assert cfg.data.config_train == files["mongo"] and cfg.model.model_select == "tiny"
    assert cfg.run.train_iters == 300 and cfg.run.early_stopping and cfg.run.patience == 2
    assert cfg.schedule.lr == 3e-3 and cfg.run.wandb == "off"  # an unquoted YAML `off` is the choice
    cfg = parse(["--train_iters", "7", f"--config={run}", "--no_resume", "--wandb", "offline"])
    assert cfg.run.train_iters == 7 and cfg.ckpt.no_resume and cfg.run.wandb == "offline"
    assert cfg.run.patience == 2  # the file's, not the default
    # Without the file every one of these is the default again.
    plain = parse(["--config", str(files["mongo"]), "--deepspeed_config", str(files["ds"]),
                   "--vocab_dir", str(files["tok"])])  # fmt: skip
    assert (
        plain.run.train_iters == 1000 and not plain.run.early_stopping and plain.model.model_select == "112m"
    )


def test_toml_and_tables_per_command(tmp_path: Path, files: dict[str, Path]) -> None:
    run = write(
        tmp_path / "run.toml",
        f'config = "{files["mongo"]}"\ndeepspeed_config = "{files["ds"]}"\nvocab_dir = "{files["tok"]}"\n'
        'model_select = "tiny"\n\n[train]\ntrain_iters = 40\ncompile = true\n\n'
        "[evaluate]\nbatch_size = 3\n\n[vocab.train]\nvocab_size = 512\n",
    )
    cfg = parse(["--config", str(run)])
    assert cfg.run.train_iters == 40 and cfg.compute.compile and cfg.model.model_select == "tiny"


@pytest.mark.parametrize(
    "text, message",
    [
        ("train_iterz: 3\n", "unknown key 'train_iterz'; did you mean 'train_iters'?"),
        ("train_iters: abc\n", "key 'train_iters': expected a positive integer, got 'abc'"),
        ("train_iters: 2.5\n", "key 'train_iters': expected a positive integer, got '2.5'"),
        ("early_stopping: 3\n", "key 'early_stopping' must be true or false, got 3"),
        ("model_select: huge\n", "key 'model_select': 'huge' is not one of tiny"),
        ("lr: [1, 2]\n", "key 'lr' must be a single value"),
        ("monitor: true\n", "key 'monitor' must be one of val_loss, val_ppl, not true/false"),
        ("train:\n  save_intervall: 5\n", "unknown key 'save_intervall'"),
        ("train: 5\n", "[train] must be a table of flags"),
        ("- a\n- b\n", "expected a mapping of flag names to values, got list"),
        ("a: b: c\n", "not valid YAML at line 2"),
        ("train_iters: 3\nlr: 1e-3\ntrain_iters: 5\n", "at line 4 (key 'train_iters' given twice"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_it(
    tmp_path: Path, files: dict[str, Path], text: str, message: str
) -> None:
    prefix = "" if text.startswith("-") else f"config: {files['mongo']}\n"
    run = write(tmp_path / "bad.yaml", prefix + text)
    result = run_python([str(ROOT / "ds_trainer.py"), "--config", str(run)], cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"ds_trainer.py: error: --config {run}: ")
    assert message in result.stderr


def test_a_missing_or_second_experiment_file_is_refused(tmp_path: Path) -> None:
    result = run_cli("info", "--config", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and result.stderr.strip().endswith("nope.toml: file not found")
    for empty in ("empty.yaml", "empty.toml"):  # not "--config is required" of the command's own
        (tmp_path / empty).write_text("\n")
        result = run_cli("info", "--config", str(tmp_path / empty))
        assert result.returncode == 2 and f"{empty}: the experiment file is empty" in result.stderr
    with pytest.raises(Exception, match="one experiment file at a time"):
        find_run_file(["--config", "a.yaml", "--config", "b.toml"])


def test_every_dsgpt2_command_reads_one(tmp_path: Path) -> None:
    """`config` in the file names the connection JSON; the command's table applies to it alone."""
    config, _ = store_config(tmp_path, ["a", "b"])
    text = (
        f"config: {config}\n"
        "ingest:\n  collection: a\n  sample: stdlib\n  limit: 30\n"
        "validate:\n  json: true\n"
        "info:\n  json: true\n"
        "vocab:\n  train:\n    vocab_size: 300\n"
    )
    run = write(tmp_path / "corpus.yaml", text)
    ingest = run_cli("ingest", "--config", str(run))
    assert ingest.returncode == 0, ingest.stderr
    # A flag typed after the file overrides it.
    more = run_cli("ingest", "--config", str(run), "--collection", "b", "--limit", "20")
    assert more.returncode == 0, more.stderr
    info = run_cli("info", "--config", str(run))
    assert [c["count"] for c in json.loads(info.stdout)["collections"]] == [30, 20]
    validate = run_cli("validate", "--config", str(run))
    assert validate.returncode == 0 and json.loads(validate.stdout)
    # A key of another command at the top level is not this command's.
    write(run, f"config: {config}\nvocab_size: 300\n")
    bad = run_cli("info", "--config", str(run))
    assert bad.returncode == 2 and "unknown key 'vocab_size'" in bad.stderr


def test_the_parser_is_built_from_the_table_of_commands() -> None:
    """One list of the commands (dsgpt2.cli.main.COMMANDS): the parser's commands and steps, in its order,
    and the names an experiment file's tables may have. `dsgpt2 launch` hands every argument to the
    deepspeed launcher: the script it starts reads the file."""
    parser = cli_parser()
    top = subcommands(parser)
    assert list(top) == [c.name for c in COMMANDS]
    for c in COMMANDS:
        assert tuple(subcommands(top[c.name])) == tuple(s.name for s in c.steps), c.name
    assert command_names(parser) - {"launch"} == SECTIONS
    assert "launch" not in SECTIONS and {"vocab", "download", "train", "dedup"} <= SECTIONS


def test_a_command_added_to_the_table_is_a_command_everywhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A new entry of the table is all a command needs: its flags parse, an experiment file's table of it
    applies, and its handler runs and gives the exit code."""
    from dataclasses import dataclass

    from dsgpt2.cli import main as cli_main
    from dsgpt2.cli.common import Command, section_names
    from dsgpt2.settings.options import POSITIVE_INT, from_namespace, option

    @dataclass(frozen=True, kw_only=True)
    class Frob:
        times: int = option(1, "how often", check=POSITIVE_INT)

    seen: list[int] = []

    def handler(args):
        seen.append(from_namespace(Frob, args).times)
        return 7

    table = (*cli_main.COMMANDS, Command("frobnicate", help="frob", settings=(Frob,), handler=handler))
    monkeypatch.setattr(cli_main, "COMMANDS", table)
    monkeypatch.setattr(cli_main, "SECTIONS", section_names(table))
    assert "frobnicate" in subcommands(cli_main.build_parser())
    run = write(tmp_path / "run.yaml", "frobnicate:\n  times: 3\ninfo:\n  json: true\n")
    assert cli_main.main(["frobnicate", "--config", str(run)]) == 7
    assert cli_main.main(["frobnicate", "--times", "5"]) == 7 and seen == [3, 5]


def test_the_demo_trains_by_the_shipped_recipe(files: dict[str, Path], tmp_path: Path) -> None:
    """The demo reads its pretraining recipe from configs/recipes/demo.yaml (as shipped in the package):
    its model, split, schedule, tail average and DeepSpeed config, and its evaluations and checkpoints
    spread over the demo's steps."""
    from dsgpt2.cli.pipeline import DEMO_RECIPE, demo_recipe, train_config
    from dsgpt2.data.split import DEFAULT_CHUNK_DOCS
    from dsgpt2.settings.shipped import shipped_config

    shipped = shipped_config(DEMO_RECIPE)
    assert shipped.read_text() == (ROOT / "configs" / "recipes" / "demo.yaml").read_text()
    recipe = parse(["--config", str(shipped), "--vocab_dir", str(files["tok"])])
    assert recipe.data.config_train == Path("configs/sample.json")
    ds = json.loads(Path(ROOT / recipe.engine.deepspeed_config).read_text())
    assert ds["train_micro_batch_size_per_gpu"] == 16
    assert (
        recipe.data.chunk_docs == DEFAULT_CHUNK_DOCS and recipe.data.read_order == "spread"
    )  # no work-around
    assert demo_recipe().train_iters == recipe.run.train_iters

    steps = recipe.run.train_iters
    cfg = train_config(tmp_path, steps, pretrain=True, vocab_dir=files["tok"])
    assert cfg.engine.deepspeed_config == shipped_config("recipes/ds_muon.json")
    assert recipe.engine.deepspeed_config == Path("configs/recipes/ds_muon.json")
    assert cfg.model == recipe.model and cfg.schedule == recipe.schedule and cfg.compute == recipe.compute
    assert cfg.optim == recipe.optim
    assert cfg.data.tr_ratio == recipe.data.tr_ratio and cfg.data.config_train is None
    same = ("train_iters", "eval_interval", "eval_iters", "wandb", "hellaswag", "ema_tail")
    assert [getattr(cfg.run, k) for k in same] == [getattr(recipe.run, k) for k in same]
    assert cfg.ckpt.save_interval == recipe.ckpt.save_interval and cfg.ckpt.no_resume
    assert cfg.run.workspace == tmp_path / "train" and cfg.ckpt.ckpt_dir == tmp_path / "ckpt"
    # A shorter demo keeps the recipe's number of evaluations and checkpoints, and warms up for a quarter.
    short = train_config(tmp_path, 12, pretrain=True, vocab_dir=files["tok"])
    assert (short.run.train_iters, short.run.eval_interval, short.ckpt.save_interval) == (12, 2, 4)
    assert short.schedule.warmup_iters == 3 and short.schedule.lr == recipe.schedule.lr
    # Finetuning on conversations: the recipe's split and run, the shipped CPU config and schedule.
    chat = train_config(tmp_path, 6, init_from=files["tok"], task="conversation", vocab_dir=files["tok"])
    assert chat.data.tr_ratio == recipe.data.tr_ratio and chat.schedule.lr_schedule == "deepspeed"
    assert chat.engine.deepspeed_config.name == "ds_config_cpu.json" and chat.model.task == "conversation"
    # The recipe's tail average is pretraining's: the finetuning ends on its last step's weights.
    assert recipe.run.ema_tail == cfg.run.ema_tail == 0.2 and chat.run.ema_tail == 0


def test_the_demo_trains_with_the_optimizer_its_recipe_names(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo recipe naming Muon (the fast recipe's keys) pretrains with Muon, its rate and schedule."""
    from dsgpt2.cli import pipeline

    monkeypatch.setattr(pipeline, "DEMO_RECIPE", "recipes/fast.yaml")
    pipeline.demo_recipe.cache_clear()
    try:
        fast = parse(
            ["--config", str(ROOT / "configs" / "recipes" / "fast.yaml"), "--vocab_dir", str(files["tok"])]
        )
        assert fast.optim.optimizer == "muon"
        cfg = pipeline.train_config(tmp_path, 40, pretrain=True, vocab_dir=files["tok"])
        assert cfg.optim == fast.optim and cfg.schedule.lr_schedule == "wsd"
        chat = pipeline.train_config(
            tmp_path, 6, init_from=files["tok"], task="conversation", vocab_dir=files["tok"]
        )
        assert chat.optim.optimizer == "adamw"
    finally:
        pipeline.demo_recipe.cache_clear()


def test_the_shipped_8_gpu_recipe_loads_and_steps_on_a_million_tokens(files: dict[str, Path]) -> None:
    from dsgpt2.optim.ds_config import precision

    cfg = parse(
        ["--config", str(ROOT / "configs" / "recipes" / "112m_8gpu.toml"), "--vocab_dir", str(files["tok"])]
    )
    ds = json.loads(Path(ROOT / cfg.engine.deepspeed_config).read_text())
    tokens = (
        ds["train_micro_batch_size_per_gpu"]
        * ds["gradient_accumulation_steps"]
        * 8
        * cfg.model.context_length
    )
    assert cfg.model.model_select == "112m" and precision(ds) == "bf16" and tokens == 1_048_576
    assert cfg.schedule.lr_schedule == "cosine" and cfg.run.train_iters * tokens > 9.9e9
    # llm.c's GPT-2 warmup, 700 steps of ~0.5 M tokens, over the same tokens at twice the batch.
    assert cfg.schedule.warmup_iters * tokens == 700 * 524_288


def test_a_flag_typed_after_the_file_switches_its_choice_and_drops_the_keys_serving_the_other(
    tmp_path: Path, files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """A recipe's Muon keys serve its `optimizer: muon`: a typed `--optimizer adamw` switches the choice
    and drops them with one line naming the file; a Muon flag typed beside it is still refused."""
    run = yaml_run(
        tmp_path,
        files,
        "optimizer: muon\nmuon_scale: rms\nmuon_momentum: 0.9\nlr_schedule: wsd\ndecay_fraction: 0.3\n",
    )
    with caplog.at_level("WARNING", logger="dsgpt2"):
        cfg = parse(["--config", str(run), "--optimizer", "adamw"])
    assert cfg.optim.optimizer == "adamw" and cfg.optim.muon_scale is None and cfg.optim.muon_momentum is None
    assert cfg.schedule.lr_schedule == "wsd" and cfg.schedule.decay_fraction == 0.3  # they serve both
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [f"{run}: muon_scale, muon_momentum dropped: they serve --optimizer muon, and the "
                     "command line chose --optimizer adamw"]  # fmt: skip
    # The file alone, or the same choice typed: nothing dropped.
    caplog.clear()
    assert parse(["--config", str(run), "--optimizer", "muon"]).optim.muon_momentum == 0.9
    assert parse(["--config", str(run)]).optim.muon_scale == "rms" and not caplog.records
    # The schedule's own key follows its choice the same way.
    assert parse(["--config", str(run), "--lr_schedule", "cosine"]).schedule.decay_fraction == 0.2
    # What the user typed is never dropped: a Muon flag beside --optimizer adamw is one line, exit 2.
    with pytest.raises(Exception, match="--muon_scale set the Muon optimizer"):
        parse(["--config", str(run), "--optimizer", "adamw", "--muon_scale", "rms"])


def test_an_error_about_a_value_the_file_set_names_the_file(tmp_path: Path, files: dict[str, Path]) -> None:
    """A recipe's value the user never typed (its warmup, against a shorter --train_iters typed after it):
    the one line names the file it came from; the same value typed is the user's own, and named alone."""
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="mongodb://127.0.0.1:9",
                       MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])  # fmt: skip
    ds = ROOT / "configs" / "ds_config_cpu.json"
    run = yaml_run(tmp_path, files | {"mongo": cfg, "ds": ds}, "warmup_iters: 40\n")
    from_file = run_cli("train", "--config", str(run), "--train_iters", "30")
    assert from_file.returncode == 2 and "Traceback" not in from_file.stderr
    assert from_file.stderr.strip().endswith(
        f"--warmup_iters 40: must be below --train_iters 30 (--warmup_iters as set in {run})"
    ), from_file.stderr
    typed = run_cli("train", "--config", str(run), "--train_iters", "30", "--warmup_iters", "35")
    assert typed.returncode == 2 and typed.stderr.strip().endswith("must be below --train_iters 30")


def test_the_shipped_fast_recipe_trains_with_adamw_by_one_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dsgpt2 train --config configs/recipes/fast.yaml --optimizer adamw`, parsed as the command does."""
    monkeypatch.chdir(ROOT)
    cfg = parse(["--config", "configs/recipes/fast.yaml", "--optimizer", "adamw"])
    assert cfg.optim.optimizer == "adamw" and cfg.optim.muon_scale is None and cfg.optim.muon_momentum is None
    assert cfg.optim.muon_normuon is None  # a switch the file set goes with the others


def test_the_recipe_bench_reads_both_shipped_recipes() -> None:
    """`python -m bench recipe` trains the recipes as shipped: each parses, by the trainer's own parser, to
    the optimizer and schedule it names."""
    from bench.bench_recipe import _recipe

    fast, adamw = _recipe("fast"), _recipe("adamw")
    assert (fast.optimizer, fast.lr_schedule, fast.muon_scale) == ("muon", "wsd", "rms")
    assert (adamw.optimizer, adamw.lr_schedule) == ("adamw", "cosine")


def test_the_recipe_bench_screens_variants_of_the_fast_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """``BENCH_RECIPE_VARIANTS``: each variant is the fast recipe with its flags typed after the file."""
    from bench import bench_recipe

    variants = (
        "polar=--muon_ns polar_express|all=--muon_ns polar_express --muon_cautious --muon_momentum_warmup 300"
    )
    monkeypatch.setenv("BENCH_RECIPE_VARIANTS", variants)
    reread = importlib.reload(bench_recipe)
    try:
        assert list(reread.VARIANTS) == ["polar", "all"]
        polar, both = reread._recipe("polar"), reread._recipe("all")
        assert (polar.optimizer, polar.muon_ns, polar.muon_cautious) == ("muon", "polar_express", None)
        assert (both.muon_ns, both.muon_cautious, both.muon_momentum_warmup) == ("polar_express", True, 300)
        assert both.muon_scale == "rms" and both.lr_schedule == "wsd"  # the rest as fast.yaml has it
    finally:
        monkeypatch.delenv("BENCH_RECIPE_VARIANTS")
        importlib.reload(bench_recipe)


def test_muons_speedrun_options_are_recipe_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The five options of Muon from the speedrun, as keys of an experiment file."""
    monkeypatch.chdir(ROOT)
    recipe = tmp_path / "mine.yaml"
    keys = ("config: configs/sample.json", "optimizer: muon", "muon_ns: polar_express", "muon_cautious: true",
            "muon_normuon: true", "muon_soap: true", "muon_momentum_warmup: 300")  # fmt: skip
    recipe.write_text("\n".join(keys) + "\n")
    cfg = parse(["--config", str(recipe)])
    o = cfg.optim
    assert (o.muon_ns, o.muon_cautious, o.muon_normuon, o.muon_soap, o.muon_momentum_warmup) == (
        "polar_express",
        True,
        True,
        True,
        300,
    )


def test_the_fast_recipe_is_the_demos_in_a_workspace_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe bench's figures are the demo's: fast.yaml and demo.yaml train alike (the optimizer,
    schedule and model the bench measured), only their folders differ."""
    monkeypatch.chdir(ROOT)
    fast, demo = (parse(["--config", f"configs/recipes/{name}.yaml"]) for name in ("fast", "demo"))
    assert fast.optim == demo.optim and fast.schedule == demo.schedule and fast.model == demo.model
    assert fast.data == demo.data and fast.engine == demo.engine
    assert (fast.optim.muon_momentum, fast.schedule.decay_fraction) == (0.95, 0.2)
    # The speedrun's options that won the screen at both shapes (docs/training/speedrun.md).
    o = fast.optim
    assert (o.muon_ns, o.muon_momentum_warmup, o.muon_normuon, o.muon_cautious, o.muon_soap) == (
        "polar_express",
        300,
        True,
        None,
        None,
    )
    assert fast.run.workspace != demo.run.workspace and fast.ckpt.ckpt_dir != demo.ckpt.ckpt_dir


def test_a_null_value_is_refused_not_taken_for_the_default(
    tmp_path: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`model_select:` left empty had started the 112m model (the default) on a CPU for hours."""
    for empty in ("model_select:\n", "ckpt_dir: ~\n", "model_select: null\n"):
        text = yaml_run(tmp_path, files).read_text().replace("model_select: tiny\n", "")
        run = write(tmp_path / "run.yaml", text + empty)
        with pytest.raises(SystemExit) as caught:
            parse(["--config", str(run)])
        key = empty.split(":")[0]
        err = capsys.readouterr().err
        assert caught.value.code == 2 and f"key '{key}' has no value (null); give it one, or leave" in err, (
            err
        )


def test_a_value_built_by_yaml_aliases_is_shown_bounded(
    tmp_path: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Nine levels of aliases are 9**9 leaves: the error once built their whole repr (gigabytes)."""
    levels = "abcdefghi"
    lines = ["&a [x, x, x, x, x, x, x, x, x]"]
    lines += [f"&{n} [{', '.join(['*' + levels[i - 1]] * 9)}]" for i, n in enumerate(levels) if i]
    text = yaml_run(tmp_path, files).read_text() + f"model_config: [{', '.join(lines)}]\n"
    with pytest.raises(SystemExit):
        parse(["--config", str(write(tmp_path / "run.yaml", text))])
    err = capsys.readouterr().err
    assert "key 'model_config' must be a single value, got [['x', " in err and len(err) < 1000, err[:1000]


def test_an_empty_path_is_refused_not_taken_for_the_working_directory(
    tmp_path: Path, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`--workspace ''` (a script's unset variable) wrote config.yaml, metrics.jsonl and loss.png over the
    files of the directory the user stood in."""
    run = yaml_run(tmp_path, files)
    empty = write(tmp_path / "e.yaml", run.read_text() + "ckpt_dir: ''\n")
    for argv in (["--config", str(run), "--workspace", ""], ["--config", str(empty)]):
        with pytest.raises(SystemExit) as caught:
            parse(argv)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and "an empty path; name a file or directory ('.' for this one)" in err
