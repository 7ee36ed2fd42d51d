"""A disk that fills while a checkpoint, an export or a tokenizer is written: one line naming the place
and what is kept, exit 2, nothing half-written left where it goes; the same command, once there is room,
resumes or writes it whole."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from dsgpt2.errors import NoRoomError
from dsgpt2.files import FULL_DISK_BYTES, out_of_room, staged_dir
from training import steps, train, training_corpus

usage = namedtuple("usage", "total used free")


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
