from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from dsgpt2.checkpoints.format import CHECKPOINTS, COMPLETE, resolve
from dsgpt2.checkpoints.publisher import Publisher
from dsgpt2.errors import CheckpointError
from dsgpt2.stores.base import DirectoryStore


class FakeEngine:
    """Writes what DeepSpeed writes for a tag; can die half-way like a killed process."""

    global_rank = 0

    def __init__(self, die: bool = False) -> None:
        self.die = die

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        assert save_latest is False  # dsgpt2 moves `latest` itself, after the save is complete
        d = Path(save_dir) / tag
        d.mkdir(parents=True, exist_ok=True)
        (d / "mp_rank_00_model_states.pt").write_bytes(b"partial" if self.die else b"full")
        if self.die:
            raise KeyboardInterrupt("killed during the save")


class checkpoint:
    @staticmethod
    def save(engine: FakeEngine, directory: Path, step: int, client_state: dict, keep_last: int) -> str:
        publisher = Publisher(DirectoryStore(directory, CHECKPOINTS), keep_last, rank=0, world=1, wait_s=5)
        publisher.fetch(None)  # the latest it starts from
        tag = publisher.save(engine, step, client_state, {})
        publisher.settle()
        return tag


def test_crash_during_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    checkpoint.save(FakeEngine(), tmp_path, 10, {}, keep_last=3)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(FakeEngine(die=True), tmp_path, 20, {}, keep_last=3)
    assert (tmp_path / "latest").read_text() == "global_step10"
    assert resolve(tmp_path, None) == "global_step10"
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve(tmp_path, "global_step20")


def test_keep_last_prunes_older_complete_checkpoints_and_earlier_saves_that_died(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=2)
    # Incomplete ones are not counted; one before the save can never finish, one after it may be the
    # step a resumed run gets to: it is replaced then. What is not a checkpoint is not touched.
    (tmp_path / "global_step2").mkdir()
    (tmp_path / "global_step9").mkdir()
    (tmp_path / "tokenizer").mkdir()
    checkpoint.save(FakeEngine(), tmp_path, 5, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "global_step4",
        "global_step5",
        "global_step9",
        "tokenizer",
    ]
    assert json.loads((tmp_path / "global_step5" / COMPLETE).read_text())["step"] == 5


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no `latest` file"):
        resolve(tmp_path, None)
    (tmp_path / "latest").write_text("\x00\x00garbage")
    with pytest.raises(CheckpointError, match="empty or corrupt"):
        resolve(tmp_path, None)
    (tmp_path / "latest").write_text("global_step7")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        resolve(tmp_path, None)
    checkpoint.save(FakeEngine(), tmp_path, 7, {}, keep_last=0)
    assert resolve(tmp_path, None) == "global_step7"
    # A marker edited by hand (its file listing not one): incomplete, as an unreadable one is.
    marker = tmp_path / "global_step7" / COMPLETE
    saved = marker.read_text()
    for files in (3, {"model.pt": 3}, {"model.pt": {"size": "big", "sha256": "x"}}):
        marker.write_text(json.dumps({"step": 7, "files": files}))
        with pytest.raises(CheckpointError, match="missing or incomplete"):
            resolve(tmp_path, None)
    marker.write_text(saved)
    assert resolve(tmp_path, None) == "global_step7"


def _states(ckpt: Path, step: int) -> Path:
    return ckpt / f"global_step{step}" / "mp_rank_00_model_states.pt"


def test_a_complete_checkpoint_is_never_written_again(tmp_path: Path) -> None:
    checkpoint.save(FakeEngine(), tmp_path, 4, {}, keep_last=0)
    before = _states(tmp_path, 4).stat().st_mtime_ns
    # A relaunch reaching step 4 again, killed in the middle of its save, would have destroyed it.
    assert checkpoint.save(FakeEngine(die=True), tmp_path, 4, {}, keep_last=0) == "global_step4"
    assert _states(tmp_path, 4).stat().st_mtime_ns == before
    assert resolve(tmp_path, None) == "global_step4"
    # A damaged one is replaced.
    _states(tmp_path, 4).write_bytes(b"fu")
    checkpoint.save(FakeEngine(), tmp_path, 4, {}, keep_last=0)
    assert _states(tmp_path, 4).read_bytes() == b"full" and resolve(tmp_path, None) == "global_step4"
    # Whole, and `latest` never moved to it (a run stopped between the two): the save that reaches it
    # again moves `latest` without writing it.
    checkpoint.save(FakeEngine(), tmp_path, 6, {}, keep_last=0)
    (tmp_path / "latest").write_text("global_step4")
    before = _states(tmp_path, 6).stat().st_mtime_ns
    assert checkpoint.save(FakeEngine(die=True), tmp_path, 6, {}, keep_last=0) == "global_step6"
    assert (tmp_path / "latest").read_text() == "global_step6" and _states(
        tmp_path, 6
    ).stat().st_mtime_ns == before


def test_a_rewound_resume_replaces_the_later_checkpoints_of_the_run_it_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (2, 4, 6, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    (tmp_path / "best").write_text("global_step8")
    (tmp_path / "global_step4.universal").mkdir()  # a form made of the step the rewind leaves

    def resumed(tag: str, keep_last: int) -> Publisher:
        publisher = Publisher(DirectoryStore(tmp_path, CHECKPOINTS), keep_last, rank=0, world=1, wait_s=5)
        publisher.fetch((tmp_path, tag, {}))
        return publisher

    def tags() -> list[str]:
        return sorted(
            (p.name for p in tmp_path.iterdir() if p.is_dir() and "." not in p.name),
            key=lambda t: int(t[11:]),
        )

    logging.getLogger("dsgpt2").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="dsgpt2"):
            rewound = resumed("global_step2", keep_last=2)
            assert "the later global_step4, global_step6, global_step8, of a run that went on" in caplog.text
            # --keep_last counts this run's checkpoints only: the other run's neither count nor are lost.
            rewound.save(FakeEngine(), 3, {}, {})
            assert tags() == ["global_step2", "global_step3", "global_step4", "global_step6", "global_step8"]
            assert (tmp_path / "best").read_text() == ""  # the other run's finding, not this one's
            # Another run's step 4 (another --train_iters, another learning rate): never adopted.
            assert rewound.save(FakeEngine(), 4, {}, {}) == "global_step4"
    finally:
        logging.getLogger("dsgpt2").removeHandler(caplog.handler)
    assert "replacing " in caplog.text and "global_step4, a step of the run this one rewound" in caplog.text
    assert _states(tmp_path, 4).stat().st_mtime_ns > _states(tmp_path, 8).stat().st_mtime_ns
    assert (tmp_path / "latest").read_text() == "global_step4" and resolve(tmp_path, None) == "global_step4"
    assert not (tmp_path / "global_step4.universal").exists()
    assert tags() == ["global_step3", "global_step4", "global_step6", "global_step8"]
    # Stopped, then resumed from `latest`: the other run's later steps are still told apart (saved before
    # the checkpoint resumed), and replaced in turn.
    caplog.clear()
    logging.getLogger("dsgpt2").addHandler(caplog.handler)  # whatever an earlier test left on the logger
    try:
        with caplog.at_level(logging.INFO, logger="dsgpt2"):
            again = resumed("global_step4", keep_last=2)
    finally:
        logging.getLogger("dsgpt2").removeHandler(caplog.handler)
    assert "the later global_step6, global_step8, of a run" in caplog.text
    again.save(FakeEngine(), 5, {}, {})
    assert tags() == ["global_step4", "global_step5", "global_step6", "global_step8"]
    before = _states(tmp_path, 6).stat().st_mtime_ns
    assert again.save(FakeEngine(), 6, {}, {}) == "global_step6"
    assert _states(tmp_path, 6).stat().st_mtime_ns > before
    assert tags() == ["global_step5", "global_step6", "global_step8"]
    # Without `latest`, the newest intact checkpoint is the last saved, not the other run's higher step.
    (tmp_path / "latest").unlink()
    assert resolve(tmp_path, None) == "global_step6"
    (tmp_path / "latest").write_text("global_step6")
    # A plain resume keeps a later whole one saved after the checkpoint it resumes: its own, whole just
    # before a stop that left `latest` unmoved.
    checkpoint.save(FakeEngine(), tmp_path, 10, {}, keep_last=0)
    (tmp_path / "latest").write_text("global_step6")
    before = _states(tmp_path, 10).stat().st_mtime_ns
    assert resumed("global_step6", keep_last=0).save(FakeEngine(die=True), 10, {}, {}) == "global_step10"
    assert _states(tmp_path, 10).stat().st_mtime_ns == before
    assert (tmp_path / "latest").read_text() == "global_step10"
    # A checkpoint resumed under another name: its step is its marker's, not a number in its name.
    shutil.copytree(tmp_path / "global_step5", tmp_path / "before_the_change")
    assert resumed("before_the_change", keep_last=0)._left == {
        "global_step6",
        "global_step8",
        "global_step10",
    }


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncated", "truncated or grown"),
        ("emptied", "truncated or grown"),
        ("deleted", "is missing"),
        ("garbage", "is damaged (its SHA-256 differs"),
    ],
)
def test_damaged_files_are_found_before_loading(tmp_path: Path, damage: str, needle: str) -> None:
    for step in (4, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    states = _states(tmp_path, 8)
    if damage == "truncated":
        states.write_bytes(b"fu")
    elif damage == "emptied":
        states.write_bytes(b"")
    elif damage == "deleted":
        states.unlink()
    else:
        states.write_bytes(b"f\xffll")  # same size, other bytes
    with pytest.raises(CheckpointError) as err:
        resolve(tmp_path, None)
    assert needle in str(err.value) and "--ckpt_id global_step4" in str(err.value)
    with pytest.raises(CheckpointError, match="--ckpt_id global_step4"):
        resolve(tmp_path, "global_step8")
    assert resolve(tmp_path, "global_step4") == "global_step4"


def test_a_damaged_marker_is_blamed_not_the_files_it_lists(tmp_path: Path) -> None:
    for step in (4, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    marker = tmp_path / "global_step8" / COMPLETE
    text = marker.read_text()
    digest = json.loads(text)["files"]["mp_rank_00_model_states.pt"]["sha256"]
    flipped = digest[:10] + ("0" if digest[10] != "0" else "1") + digest[11:]
    for damaged in (text.replace(digest, flipped), text.replace('"size": 4', '"size": 5')):
        marker.write_text(damaged)
        with pytest.raises(CheckpointError) as err:
            resolve(tmp_path, None)
        assert f"{marker} is damaged" in str(err.value) and "mp_rank_00" not in str(err.value)
        assert "--ckpt_id global_step4" in str(err.value)
    # A marker written before markers carried their own digest is checked as it was.
    old = json.loads(text)
    del old["marker_sha256"]
    marker.write_text(json.dumps(old))
    assert resolve(tmp_path, None) == "global_step8"


def test_latest_deleted_or_garbled(tmp_path: Path) -> None:
    import logging

    for step in (4, 8, 12):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    _states(tmp_path, 12).write_bytes(b"")
    (tmp_path / "latest").unlink()
    # Deleted: the newest intact checkpoint, with a warning (never a silent fresh start).
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dsgpt2.checkpoints.format").addHandler(handler)
    try:
        assert resolve(tmp_path, None) == "global_step8"
    finally:
        logging.getLogger("dsgpt2.checkpoints.format").removeHandler(handler)
    assert any("no `latest` file" in w and "global_step8" in w for w in warnings), warnings
    # Garbled (not even UTF-8): one line naming the newest intact checkpoint.
    (tmp_path / "latest").write_bytes(b"\xff\xfe\x00global")
    with pytest.raises(CheckpointError, match=r"empty or corrupt.*--ckpt_id global_step8"):
        resolve(tmp_path, None)
    (tmp_path / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match=r"missing or incomplete.*--ckpt_id global_step8"):
        resolve(tmp_path, None)


def test_a_garbled_marker_neither_counts_nor_crashes_the_pruning(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    (tmp_path / "global_step1" / COMPLETE).write_bytes(b'{"step": 1, "fi\xff')
    checkpoint.save(FakeEngine(), tmp_path, 4, {}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "global_step1",  # not known to be complete: left alone
        "global_step3",
        "global_step4",
    ]
    marker = json.loads((tmp_path / "global_step4" / COMPLETE).read_text())
    assert marker["files"]["mp_rank_00_model_states.pt"]["size"] == 4


def test_a_resume_refuses_another_init_from_and_takes_the_one_it_started_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from dsgpt2.checkpoints.checkpointer import _check_init
    from dsgpt2.errors import CheckpointError

    where = tmp_path / "ckpt" / "global_step4"
    model = str(tmp_path / "model")
    _check_init({"init_from": model}, {"init_from": model}, where)  # the command typed again
    _check_init({"init_from": model}, {}, where)  # a resume without the flag
    for theirs in ({}, {"init_from": str(tmp_path / "other")}):
        with pytest.raises(CheckpointError, match=rf"--init_from {model}: this run resumes .*global_step4"):
            _check_init(theirs, {"init_from": model}, where)
    # Recorded relative to where the run started (maybe not here): said, not refused.
    logging.getLogger("dsgpt2").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="dsgpt2"):
            _check_init({"init_from": "runs/model"}, {"init_from": model}, where)
    finally:
        logging.getLogger("dsgpt2").removeHandler(caplog.handler)
    assert any("reads no --init_from" in r.getMessage() for r in caplog.records), caplog.records


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["pipe", "folder"])
def test_a_pipe_or_folder_in_place_of_latest_best_or_a_marker_is_said_not_waited_on(
    tmp_path: Path, kind: str
) -> None:
    """Opened, a named pipe waits for a writer: a `latest`, `best` or marker that is one hung every reader
    of the run. A folder there was taken for no `latest`, and the run failed to save over it once trained."""
    import os

    from dsgpt2.checkpoints.format import best_tag, peek_tag, pointer_problem

    for step in (4, 8):
        checkpoint.save(FakeEngine(), tmp_path, step, {}, keep_last=0)
    (tmp_path / "best").write_text("global_step8")

    def odd(path: Path) -> None:
        path.unlink()
        os.mkfifo(path) if kind == "pipe" else path.mkdir()

    said = "a named pipe, not a regular file" if kind == "pipe" else "a directory, not a file"
    odd(tmp_path / "best")
    assert best_tag(tmp_path) is None
    assert pointer_problem(tmp_path, "best") == (
        f"{tmp_path / 'best'}: {said}; a run keeps `best` there as a file naming a checkpoint: move it away"
    )
    with pytest.raises(CheckpointError, match=rf"--ckpt_id best: .*best: {said}"):
        resolve(tmp_path, "best")
    odd(tmp_path / "latest")
    assert peek_tag(tmp_path, None) == "global_step8"
    with pytest.raises(CheckpointError, match=rf"latest: {said};.*--ckpt_id global_step8"):
        resolve(tmp_path, None)
    odd(tmp_path / "global_step8" / COMPLETE)  # that checkpoint is no longer whole
    with pytest.raises(CheckpointError, match="--ckpt_id global_step4"):
        resolve(tmp_path, None)
    assert DirectoryStore(tmp_path, CHECKPOINTS).read("latest") is None
    assert list(DirectoryStore(tmp_path, CHECKPOINTS).tags()) == ["global_step4"]
