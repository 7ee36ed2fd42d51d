"""What a run keeps of its checkpoints in the database: --keep_last counts the run's own checkpoints, a
universal form goes with its checkpoint, and a save that never finished its upload is dropped; a save
holds the step only while its tensors are copied."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import make_config
from dsgpt2.checkpoints.stored import StoredCheckpoints
from dsgpt2.db.client import Connection
from dsgpt2.train.ds_checkpoint import QueuedWrites
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


class _SlowEngine:
    """A checkpoint engine whose writes take until told to go on (torch.save's, once released)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.name = "slow"

    def save(self, state: dict, path: str) -> None:
        assert self.go.wait(30)
        if state.get("fail"):
            raise OSError(28, "No space left on device")
        torch.save(state, path)


def test_a_queued_save_holds_the_step_only_while_the_tensors_are_copied(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    installed = QueuedWrites.install(engine)
    assert isinstance(installed, QueuedWrites) and QueuedWrites.install(engine) is installed  # once
    assert QueuedWrites.install(SimpleNamespace(checkpoint_engine=_SlowEngine())) is None  # another writer
    inner = _SlowEngine()
    writes = QueuedWrites(inner)
    assert writes.name == "slow"  # the rest is the engine's
    weights = torch.ones(4)
    path = tmp_path / "mp_rank_00_model_states.pt"
    state = {"module": {"w": weights}, "step": [1], "seen": defaultdict(list, {"a": [torch.zeros(1)]})}
    writes.save(state, str(path))  # returns with the write not begun
    weights.add_(1)  # the next step changes the tensor: the file keeps the saved values
    assert not path.exists()
    inner.go.set()
    writes.wait()
    saved = torch.load(path, weights_only=False)
    assert torch.equal(saved["module"]["w"], torch.ones(4)) and not list(tmp_path.glob("*.part"))
    assert saved["seen"].default_factory is list and torch.equal(saved["seen"]["a"][0], torch.zeros(1))
    writes.save({"fail": True}, str(tmp_path / "other.pt"))
    with pytest.raises(OSError, match="No space left"):
        writes.wait()
    assert not (tmp_path / "other.pt").exists()  # never a part-written file under its name


def test_a_save_marked_best_while_it_uploads_becomes_the_stored_best_once_stored(tmp_path: Path) -> None:
    stored = StoredCheckpoints(Connection(make_config(["a"])), f"best{os.getpid()}", tmp_path / "stage")
    stored.store.delete(stored.run + "/")
    (stored.local / "global_step2").mkdir(parents=True)
    (stored.local / "global_step2" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    uploader, written = Uploader(stored, 2, rank=0, world=1, wait_s=5), threading.Event()
    uploader.upload("global_step2", 2, lambda: written.wait(30))
    uploader.mark_best("global_step2")  # returns at once: the step does not wait for the upload
    assert stored.store.get_text(f"{stored.run}/best", tmp_path / "b") is None
    written.set()
    uploader.settle()
    assert stored.store.get_text(f"{stored.run}/best", tmp_path / "b") == "global_step2"
    assert (
        stored.latest() == "global_step2"
        and (stored.local / "global_step2" / "dsgpt2_complete.json").is_file()
    )


def test_a_resume_reads_the_options_of_the_checkpoint_it_takes_and_a_dead_attempt_is_cleared(
    tmp_path: Path,
) -> None:
    stored = _stored(tmp_path)
    for tag, optimizer in (("global_step4", "adamw"), ("global_step6", "muon")):
        stored.store.put_text(f"{stored.run}/{tag}/config.yaml", f"optimizer: {optimizer}\n", tmp_path / "y")
    stored.point("latest", "global_step8")  # a save whose upload died: latest names no complete checkpoint
    assert stored.resumed_args(None, "config.yaml") == {"optimizer": "muon"}  # the newest complete one
    assert stored.resumed_args("global_step4", "config.yaml") == {"optimizer": "adamw"}
    uploader = Uploader(stored, 2, rank=0, world=1, wait_s=1)
    assert uploader.holds("global_step6") and not uploader.holds("global_step8")
    assert not [n for n in stored.store.names(stored.run + "/") if "/global_step8/" in n]  # cleared
