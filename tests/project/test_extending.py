"""What docs/development.md promises a contributor: a new input format, a new curation step and a new
optimizer are each one class and one registry line. Each test here adds a toy one from outside the
package's tree and runs it end to end through the command a user types."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, store_config
from dsgpt2.cli.main import main
from dsgpt2.corpus.formats import READERS
from dsgpt2.corpus.readers import LineReader
from dsgpt2.corpus.records import BadRecord, Record, Text
from dsgpt2.curation.steps import STEPS, About, AtIngest, Reason, Split, Step
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.db.filters import unknown_fields
from dsgpt2.db.meta import write_meta
from dsgpt2.documents import document_text
from training import steps, trainer_args, training_corpus
from zygote import run_python


class TsvReader(LineReader):
    """Tab-separated lines: the text in the second column, the first kept as ``key``."""

    name = "tsv"
    keeps_fields = False

    def records(self, start: int = 0) -> Iterator[Record]:
        with open(self.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                self.line = n
                key, tab, text = line.rstrip("\n").partition("\t")
                yield Text(text, {"key": key}) if tab else BadRecord("no_tab")


@pytest.fixture
def tsv_format() -> Iterator[None]:
    READERS.register("tsv")(TsvReader)
    yield
    READERS.unregister("tsv")


def test_a_new_input_format_is_one_class_and_one_registry_line(
    tmp_path: Path, tsv_format: None, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, _ = store_config(tmp_path, ["t"])
    data = tmp_path / "rows.tsv"
    data.write_text("a1\tthe first text\nbroken line\nb2\tthe second text\n")
    assert main(["ingest", "--config", str(cfg), "--format", "tsv", str(data), "--no_progress"]) == 0
    out = capsys.readouterr().out
    assert "rows.tsv (tsv): 3 records read, 2 inserted, 1 skipped (no_tab: 1)" in out
    conn = Connection(load_config(cfg))
    docs = list(conn.db["t"].find({}, {"_id": 0, "idx": 1, "filt_text": 1, "key": 1}).sort("idx", 1))
    assert docs == [
        {"idx": 0, "filt_text": "the first text", "key": "a1"},
        {"idx": 1, "filt_text": "the second text", "key": "b2"},
    ]
    # Its choice is listed where the built-in ones are, and an unknown one still names them all.
    with pytest.raises(SystemExit) as exit_:
        main(["ingest", "--config", str(cfg), "--format", "tsvv", str(data)])
    assert exit_.value.code == 2
    assert "'dataset', 'tsv'); did you mean 'tsv'?" in capsys.readouterr().err


@dataclass
class Shouting(Step):
    """Marks a text written in capitals: over the collections in place (`dsgpt2 shout`) and as each
    document is ingested (`dsgpt2 ingest --shout`)."""

    command = "shout"
    about = About(
        help="mark texts written in capitals (shouting)",
        description="Mark each document's text written in capitals with shouting: true.",
        epilog="examples:\n  dsgpt2 shout --config c.json",
    )
    marks = ("shouting", "shout_v")
    reasons = (Reason("shouting", {"shouting": True}, "dsgpt2 shout", ("shout",)),)
    at_ingest = AtIngest("shout", "mark texts written in capitals (as `dsgpt2 shout` does)")
    verb = "shout"
    writing = "shout"
    mark = "shout_v"

    def key(self) -> int:
        return 1

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        text = document_text(doc, text_field) or ""
        return {"shouting": text.isupper(), "shout_v": self.key()}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> Any:
        write_meta(conn, name, {"shout": {"at": time.time()}})  # what `curate report` reads as checked
        return super().finish(conn, name, done, split)


@pytest.fixture
def shout_step() -> Iterator[None]:
    STEPS.register("shout")(Shouting)
    yield
    STEPS.unregister("shout")


def test_a_new_curation_step_is_one_class_and_one_registry_line(
    tmp_path: Path, shout_step: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A toy step marks documents as they are ingested (its switch), in place over a collection (its
    command), and `curate report` counts what it leaves out beside the built-in reasons."""
    cfg, _ = store_config(tmp_path, ["a", "b"])
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["quiet words", "LOUD WORDS", "calm"]))
    assert (
        main(["ingest", "--config", str(cfg), "--collection", "a", "--shout", str(data), "--no_progress"])
        == 0
    )
    assert main(["ingest", "--config", str(cfg), "--collection", "b", str(data), "--no_progress"]) == 0
    conn = Connection(load_config(cfg))

    def marks(name: str) -> list[Any]:
        return [d.get("shouting") for d in conn.db[name].find({}, {"shouting": 1}).sort("idx", 1)]

    assert marks("a") == [False, True, False] and marks("b") == [None, None, None]
    capsys.readouterr()
    assert main(["shout", "--config", str(cfg), "--collection", "b", "--no_progress"]) == 0
    assert "b: 3 document(s) processed by this run (shout)" in capsys.readouterr().out
    assert marks("b") == [False, True, False]
    assert main(["shout", "--config", str(cfg), "--no_progress"]) == 0  # resumable: nothing left to do
    assert "a: 0 document(s) processed" in capsys.readouterr().out
    assert main(["curate", "report", "--config", str(cfg), "--plot", str(tmp_path / "p.png")]) == 0
    report = capsys.readouterr().out
    assert "  shouting                 1   33.3%" in report and "e.g. a:1: 'LOUD WORDS'" in report
    assert "  kept by all              2   66.7%" in report
    # Listed where the built-in commands are; gone with the registration.
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "mark texts written in capitals (shouting)" in capsys.readouterr().out
    # Its marks are fields a FILTER may name before any document holds them; gone with it too.
    assert unknown_fields({"shouting": {"$ne": True}}, set()) == []
    STEPS.unregister("shout")
    assert [f for f, _ in unknown_fields({"shouting": {"$ne": True}}, set())] == ["shouting"]
    with pytest.raises(SystemExit) as exit_:
        main(["shout", "--config", str(cfg)])
    assert exit_.value.code == 2


@pytest.mark.slow  # a DeepSpeed run
def test_a_new_optimizer_is_one_class_and_one_registry_line(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tests/plugins.py registers a toy SGD; `dsgpt2 train --optimizer sgd` trains with it, records it,
    and a resume keeps it without the flag."""
    corpus = training_corpus(tmp_path_factory)
    run = tmp_path_factory.mktemp("sgd")
    args = ["train", *trainer_args(corpus, run, "--train_iters", "4", "--save_interval", "4")]
    first = run_python([str(ROOT / "tests" / "plugins.py"), *args, "--optimizer", "sgd"], cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = [record["loss"] for _, record in sorted(steps(run).items())]
    assert len(losses) == 4 and losses[-1] < losses[0]
    more = run_python([str(ROOT / "tests" / "plugins.py"), *args[:-4], "--train_iters", "6"], cwd=ROOT)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "trained with --optimizer sgd, --lr_schedule deepspeed: this run continues with it" in more.stderr
    # Without the plugin the name is unknown, and said so in one line.
    bare = run_python(["-m", "dsgpt2", *args[:-4], "--train_iters", "8"], cwd=ROOT)
    assert bare.returncode == 2 and "sgd" in bare.stderr.strip().splitlines()[-1]


@pytest.mark.slow  # DeepSpeed runs
def test_a_new_checkpoint_store_is_one_module_and_one_registry_line(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """tests/plugins.py registers `mirror:NAME`, a kind of location only its put and get reach: a run saves
    there, prunes there, resumes from there on a machine with no copy of it, and `export` reads it."""
    corpus = training_corpus(tmp_path_factory)
    run, mirror = tmp_path_factory.mktemp("mirror"), tmp_path_factory.mktemp("kept")
    env = {**os.environ, "DSGPT2_MIRROR": str(mirror)}
    plugin = str(ROOT / "tests" / "plugins.py")

    def train(workspace: str, iters: int) -> Any:
        args = trainer_args(corpus, run / workspace, "--train_iters", str(iters), "--save_interval", "2",
                            "--keep_last", "1", "--optimizer", "adamw")  # fmt: skip
        args[args.index("--ckpt_dir") + 1] = "mirror:runs/a"
        done = run_python([plugin, "train", *args], cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    train("first", 4)
    kept = mirror / "runs" / "a"
    assert (kept / "latest").read_text() == "global_step4"
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["global_step4"]  # --keep_last 1
    marker = json.loads((kept / "global_step4" / "dsgpt2_complete.json").read_text())
    assert "mp_rank_00_model_states.pt" in marker["files"] and marker["step"] == 4
    # Another machine: a workspace of its own, no copy; the checkpoint comes from the store.
    resumed = train("second", 6)
    assert "resumed from mirror:runs/a/global_step4 at step 4" in resumed.stderr, resumed.stderr[-3000:]
    assert (kept / "latest").read_text() == "global_step6"
    copy = run / "second" / "ws" / "mirror" / "runs" / "a"  # this machine's keeps what is kept, no more
    assert sorted(p.name for p in copy.iterdir() if p.is_dir()) == ["global_step6"]
    out = run / "hf"
    exported = run_python([plugin, "export", "--ckpt_dir", "mirror:runs/a", "--out", str(out)], cwd=ROOT,
                          env={**env, "XDG_CACHE_HOME": str(run / "cache")})  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported mirror:runs/a/global_step6" in exported.stdout
    from transformers import GPT2LMHeadModel

    assert GPT2LMHeadModel.from_pretrained(out).config.n_layer == 2
