"""A disk that fills while a checkpoint, an export, a tokenizer, a report, a plot or a run's records are
written: one line naming the place and what is kept, exit 2, nothing half-written left where it goes; the
same command, once there is room, resumes or writes it whole. An output found on a full disk, or naming
one of the command's inputs, is refused before the work."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from dsgpt2.cli.main import main
from dsgpt2.corpus.ingest_report import SkipLog
from dsgpt2.corpus.records import Source
from dsgpt2.errors import NoRoomError
from dsgpt2.files import FULL_DISK_BYTES, out_of_room, output_writer, staged_dir
from dsgpt2.train.metrics import MetricsLog
from training import steps, train, training_corpus

usage = namedtuple("usage", "total used free")
# A connection config whose server never answers: the commands below must stop before they ask it.
UNREACHABLE = (
    '{"MONGO_CONNECTION_STRING": "mongodb://127.0.0.1:9", "MONGO_CONNECTION_DB": "d", "COLLECTIONS": ["a"]}'
)


def test_a_write_failing_on_a_full_disk_is_told_from_any_other(tmp_path: Path, monkeypatch: Any) -> None:
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert out_of_room(tmp_path / "x", enospc) is not None
    try:  # said only by an exception it came from (torch.save's, a library's wrapper)
        try:
            raise enospc
        except OSError as inner:
            raise RuntimeError("unexpected pos 2532864 vs 2532752") from inner
    except RuntimeError as outer:
        assert out_of_room(tmp_path, outer) is not None
    opaque = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2532864 vs 2532752")
    assert out_of_room(tmp_path, opaque) is None  # room left: not the disk
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    assert (
        out_of_room(tmp_path / "not" / "made", opaque)
        == f"the disk holding {tmp_path}/not/made is full (1 MB free)"
    )
    # Any other error keeps its own message, however full the disk: a bug is not a full disk.
    assert out_of_room(tmp_path, KeyError("step")) is None
    assert FULL_DISK_BYTES > 2**20


def test_an_artifact_that_does_not_fit_leaves_the_one_before_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(NoRoomError) as caught, staged_dir(out) as staging:
        (staging / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(caught.value).startswith(f"{out}: not written, the disk holding {tmp_path} is full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and os.listdir(out) == ["config.json"]
    # Whole, it is readable as open() would have made it, not only by its writer (mkdtemp's 0700).
    with staged_dir(tmp_path / "other") as staging:
        (staging / "f").write_text("x")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "other").stat().st_mode & 0o777 == 0o777 & ~mask


def _full_under(disk: Path, monkeypatch: Any) -> None:
    """The disk holding ``disk`` says it is full (0 bytes free); any other has room."""
    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: usage(2**30, 2**30, 0) if Path(p).is_relative_to(disk) else real(p)
    )


def _one_line(capsys: Any, *needles: str) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_an_output_on_a_full_disk_is_refused_before_the_work_and_nothing_is_made_there(
    tmp_path: Path, monkeypatch: Any, capsys: Any
) -> None:
    """A report or plot on a full disk: one line naming it, exit 2, before the database is asked, the
    model loaded or a document stored; nothing made there (no empty file)."""
    disk = tmp_path / "full"
    disk.mkdir()
    _full_under(disk, monkeypatch)
    cfg = tmp_path / "c.json"
    cfg.write_text(UNREACHABLE)
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a document"}\n{"other": 1}\n')
    commands = {
        "report.json": ["evaluate", "--model", str(tmp_path / "model"), "--config", str(cfg), "--report"],
        "p.png": ["curate", "report", "--config", str(cfg), "--plot"],
        "skips.jsonl": ["ingest", "--config", str(cfg), str(source), "--report"],
        "vd": ["vocab", "download", "--config", str(cfg), "--out"],
    }
    for name, command in commands.items():
        assert main([*command, str(disk / name)]) == 2
        _one_line(capsys, f"{disk / name}: the disk holding {disk / name} is full (0 MB free)", "free space")
    assert os.listdir(disk) == []


def test_an_output_naming_an_input_is_refused_before_the_work(tmp_path: Path, capsys: Any) -> None:
    """``--report``/``--plot`` naming the connection config, an input file or a file of the model: one
    line, exit 2, the input as it was."""
    cfg = tmp_path / "c.json"
    cfg.write_text(UNREACHABLE)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "a document"}\n')
    evaluate = ["evaluate", "--model", str(model), "--config", str(cfg), "--report"]
    for command, output, given in (
        (evaluate, cfg, "--config"),
        (evaluate, model / "config.json", f"a file of --model {model}"),
        (["curate", "report", "--config", str(cfg), "--plot"], cfg, "--config"),
        (["ingest", "--config", str(cfg), str(source), "--report"], source, f"input {source}"),
    ):
        assert main([*command, str(output)]) == 2
        _one_line(capsys, f"{output} is ", given, "writing it would replace that")
    assert cfg.read_text() == UNREACHABLE and source.read_text() == '{"text": "a document"}\n'
    assert (model / "config.json").read_text() == "{}"


def test_a_report_or_plot_that_does_not_fit_leaves_the_one_before_as_it_was(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    out.write_text("before")
    with pytest.raises(NoRoomError) as caught, output_writer(out) as f:
        f.write("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert str(caught.value).startswith(f"{out}: not written, the disk holding {tmp_path} is full")
    assert os.listdir(tmp_path) == ["r.json"] and out.read_text() == "before"
    with pytest.raises(KeyError), output_writer(out):  # any other error is its own
        raise KeyError("bug")
    with output_writer(tmp_path / "new" / "r.json") as f:
        f.write("whole")
    assert (tmp_path / "new" / "r.json").read_text() == "whole"


class _FullFile:
    """A file on a disk that has just filled."""

    def write(self, data: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        pass


def test_an_ingest_report_is_whole_or_absent(tmp_path: Path) -> None:
    """The skips file is put in place whole when the run ends (its earlier version kept until then); a
    disk that fills under it is one NoRoomError that keeps the earlier file and leaves no temporary one."""
    path = tmp_path / "skips.jsonl"
    path.write_text("earlier\n")
    source = Source("file:in.jsonl", "in.jsonl", "text", lambda: iter(()))
    skips = SkipLog(path)
    skips.add(source, {"file": "in.jsonl", "line": 2}, "empty")
    assert path.read_text() == "earlier\n"
    skips.close()
    assert path.read_text() == '{"file": "in.jsonl", "line": 2, "reason": "empty"}\n'
    skips = SkipLog(path)
    skips.file.close()
    skips.file = _FullFile()  # type: ignore[assignment]
    with pytest.raises(NoRoomError) as full:
        skips.add(source, {"file": "in.jsonl", "line": 3}, "empty")
    assert str(full.value).startswith(f"--report {path}: not written, the disk holding {tmp_path} is full")
    assert "the documents stored before it are kept" in str(full.value)
    skips.close()
    assert os.listdir(tmp_path) == ["skips.jsonl"] and "line" in path.read_text()


def test_a_run_record_that_does_not_fit_is_one_error_and_leaves_no_empty_metrics_file(tmp_path: Path) -> None:
    run = tmp_path / "train"
    metrics = MetricsLog(run, "off", None, {})
    metrics._f.close()
    metrics._f = _FullFile()  # type: ignore[assignment]
    with pytest.raises(NoRoomError) as full:
        metrics.write({"step": 1, "loss": 2.0})
    assert str(full.value).startswith(f"{run / 'metrics.jsonl'}: a record could not be written, the disk")
    assert "free space there and run the same command to resume" in str(full.value)
    assert os.listdir(run) == []
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a resumed run's records stay
    metrics = MetricsLog(run, "off", None, {})
    metrics._f.close()
    metrics._f = _FullFile()  # type: ignore[assignment]
    with pytest.raises(NoRoomError):
        metrics.write({"step": 2})
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_block_ids_that_do_not_fit_are_one_error(tmp_path: Path) -> None:
    from dsgpt2.train.config import RunOptions
    from dsgpt2.train.runlog import RunLog

    run = RunOptions(workspace=tmp_path / "ws", log_block_ids=True, wandb="off")
    records = RunLog(
        run, {}, resolved="", rank=1, world=2, flops_per_token=1.0, peak_flops=None, start=(0, 0)
    )
    with records.open():
        records.stepped(1, [[0, 1]])
        records.blocks.close()
        records.blocks = _FullFile()
        with pytest.raises(NoRoomError) as full:
            records.stepped(2, [[2, 3]])
    assert str(full.value).startswith(
        f"{run.workspace / 'block_ids_rank1.jsonl'}: step 2's block ids could not"
    )
    assert "free space there and run the same command to resume" in str(full.value)
    assert (run.workspace / "block_ids_rank1.jsonl").read_text() == '{"step": 1, "block_ids": [[0, 1]]}\n'


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return training_corpus(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk (tmpfs) needs root")
def test_a_checkpoint_that_fills_the_disk_is_one_line_and_the_run_resumes_once_there_is_room(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("this machine does not let root mount a tmpfs")
    try:
        train(corpus, disk, "--train_iters", "2", "--save_interval", "2")
        size = sum(f.stat().st_size for f in (disk / "ckpt" / "global_step2").rglob("*") if f.is_file())
        filler = disk / "filler"
        with open(filler, "wb") as f:  # room left for half a checkpoint
            f.truncate(shutil.disk_usage(disk).free - size // 2)
        with open(filler, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, filler.stat().st_size)
        full = train(corpus, disk, "--train_iters", "4", "--save_interval", "2", check=False)
        assert full.returncode == 2, full.stderr[-3000:]
        line = full.stderr.strip().splitlines()[-1]
        assert f"saving {disk}/ckpt/global_step4 failed: the disk holding {disk}/ckpt is full" in line, line
        assert f"the last whole checkpoint, {disk}/ckpt/global_step2, is kept" in line, line
        assert "Traceback" not in full.stderr
        assert (disk / "ckpt" / "latest").read_text() == "global_step2"
        assert not (disk / "ckpt" / "global_step4").exists()  # the attempt's files given back
        filler.unlink()
        train(corpus, disk, "--train_iters", "4", "--save_interval", "2")
        assert (disk / "ckpt" / "latest").read_text() == "global_step4" and max(steps(disk)) == 4
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
