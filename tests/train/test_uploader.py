"""What a run keeps of its checkpoints in the database: --keep_last counts the run's own checkpoints, a
universal form goes with its checkpoint, and a save that never finished its upload is dropped."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import make_config
from dsgpt2.checkpoints.stored import StoredCheckpoints
from dsgpt2.db.client import Connection
from dsgpt2.train.uploader import Uploader


def _stored(tmp_path: Path) -> StoredCheckpoints:
    stored = StoredCheckpoints(Connection(make_config(["a"])), f"prune{os.getpid()}", tmp_path / "stage")
    stored.store.delete(stored.run + "/")
    (tmp_path / "f").write_bytes(b"weights")
    for tag, step in (
        ("global_step2", 2),
        ("global_step4", 4),
        ("global_step4.universal", 4),
        ("global_step6", 6),
    ):
        stored.store.put(f"{stored.run}/{tag}/f", tmp_path / "f")
        stored.publish(tag, {"step": step, "files": {}}, latest=False)
    stored.store.put(f"{stored.run}/global_step8/f", tmp_path / "f")  # a save whose upload died
    return stored


def test_keep_last_counts_the_runs_checkpoints_and_a_universal_form_goes_with_its_own(tmp_path: Path) -> None:
    stored = _stored(tmp_path)
    Uploader(stored, 2, rank=0, world=1, wait_s=1)._prune("global_step6")
    assert sorted(stored.tags()) == ["global_step4", "global_step4.universal", "global_step6"]
    assert stored.unfinished() == []
    Uploader(stored, 1, rank=0, world=1, wait_s=1)._prune("global_step6")
    assert sorted(stored.tags()) == ["global_step6"]
    assert stored.store.names(stored.run + "/") == [f"{stored.run}/global_step6/dsgpt2_complete.json",
                                                     f"{stored.run}/global_step6/f"]  # fmt: skip
