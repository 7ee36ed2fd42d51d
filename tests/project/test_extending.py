"""What docs/development.md promises a contributor: a new input format, a new curation step and a new
optimizer are each one class and one registry line. Each test here adds a toy one from outside the
package's tree and runs it end to end through the command a user types."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import ROOT, store_config
from dsgpt2.cli.main import main
from dsgpt2.corpus.formats import READERS
from dsgpt2.corpus.readers import LineReader
from dsgpt2.corpus.records import BadRecord, Record, Text
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
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
