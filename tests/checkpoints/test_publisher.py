"""What a run keeps of its checkpoints in a store (here the database's): --keep_last counts the run's own
checkpoints, a universal form goes with its checkpoint, and a save before the last that never finished is
dropped; a save holds the step only while its tensors are copied."""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import make_config
from dsgpt2.checkpoints.checkpointer import resumed_options
from dsgpt2.checkpoints.copies import resumable_tag
from dsgpt2.checkpoints.ds_checkpoint import QueuedWrites
from dsgpt2.checkpoints.format import CHECKPOINTS
from dsgpt2.checkpoints.options import CheckpointOptions
from dsgpt2.checkpoints.publisher import Publisher
from dsgpt2.db.client import Connection
from dsgpt2.errors import CheckpointError
from dsgpt2.stores.gridfs import GridFSStore


def _store(tmp_path: Path, name: str) -> GridFSStore:
    store = GridFSStore(
        Connection(make_config(["a"])), f"{name}{os.getpid()}", CHECKPOINTS, tmp_path / "stage"
    )
    store.blobs.delete(store.name + "/")
    return store


def _stored(tmp_path: Path) -> GridFSStore:
    store = _store(tmp_path, "prune")
    (store.local / "global_step2").mkdir(parents=True)
    (store.local / "global_step2" / "f").write_bytes(b"weights")
    for tag, step in (
        ("global_step2", 2),
        ("global_step4", 4),
        ("global_step4.universal", 4),
        ("global_step6", 6),
    ):
        store.blobs.put(f"{store.name}/{tag}/f", store.local / "global_step2" / "f")
        store.complete(tag, {"step": step, "files": {}})
    store.blobs.put(f"{store.name}/global_step3/f", store.local / "global_step2" / "f")  # a save that died
    store.blobs.put(f"{store.name}/global_step8/f", store.local / "global_step2" / "f")  # one after the last
    store.blobs.put(
        f"{store.name}/nested/f", store.local / "global_step2" / "f"
    )  # another run's (NAME/nested)
    return store


def test_keep_last_counts_the_runs_checkpoints_and_a_universal_form_goes_with_its_own(tmp_path: Path) -> None:
    store = _stored(tmp_path)
    assert store.started() == ["global_step3", "global_step8", "nested"]
    Publisher(store, 2, rank=0, world=1, wait_s=1)._prune("global_step6")
    assert sorted(store.tags()) == ["global_step4", "global_step4.universal", "global_step6"]
    assert store.started() == ["global_step8", "nested"]  # the step a resumed run may get to; not ours
    Publisher(store, 1, rank=0, world=1, wait_s=1)._prune("global_step6")
    assert sorted(store.tags()) == ["global_step6"]
    assert store.blobs.names(store.name + "/global_step6") == [
        f"{store.name}/global_step6/dsgpt2_complete.json",
        f"{store.name}/global_step6/f",
    ]


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


class _Engine:
    """An engine whose save writes one file, and whose checkpoint engine writes when told to."""

    global_rank = 0

    def __init__(self) -> None:
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        self.checkpoint_engine = TorchCheckpointEngine()
        self.written = threading.Event()

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(
            {"w": torch.ones(2)}, str(Path(save_dir) / tag / "mp_rank_00_model_states.pt")
        )
        self.checkpoint_engine._pending.append(_Waiting(self.written))


class _Waiting:
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def result(self) -> None:
        assert self.event.wait(30)


def test_a_save_marked_best_while_it_is_kept_becomes_best_once_whole(tmp_path: Path) -> None:
    store = _store(tmp_path, "best")
    publisher, engine = Publisher(store, 2, rank=0, world=1, wait_s=5), _Engine()
    publisher.fetch(None)
    assert publisher.save(engine, 2, {}, {"config.yaml": "a: 1\n"}) == "global_step2"  # returns at once
    publisher.mark_best("global_step2")  # returns at once: the step does not wait for the save
    assert store.read("best") is None and store.read("latest") is None
    engine.written.set()
    publisher.settle()
    assert store.read("best") == "global_step2" and store.read("latest") == "global_step2"
    assert sorted(store.tags()["global_step2"]["files"]) == ["config.yaml", "mp_rank_00_model_states.pt"]
    assert (store.local / "global_step2" / "dsgpt2_complete.json").is_file()


def test_a_resume_reads_the_options_of_the_checkpoint_it_takes_and_a_dead_attempt_is_cleared(
    tmp_path: Path,
) -> None:
    store = _stored(tmp_path)
    for tag, optimizer in (("global_step4", "adamw"), ("global_step6", "muon")):
        store.write(f"{tag}/config.yaml", f"optimizer: {optimizer}\n")
    store.write("latest", "global_step8")  # a save that died: latest names no complete checkpoint
    assert resumable_tag(store, None) == "global_step6"  # the newest complete one
    options = CheckpointOptions(ckpt_dir=Path(f"gridfs:{store.name}"))
    assert resumed_options(options, store) == {"optimizer": "muon"}
    options = CheckpointOptions(ckpt_dir=Path(f"gridfs:{store.name}"), ckpt_id="global_step4")
    assert resumed_options(options, store) == {"optimizer": "adamw"}
    publisher = Publisher(store, 2, rank=0, world=1, wait_s=1)
    assert publisher.holds("global_step6") and not publisher.holds("global_step8")
    assert not [n for n in store.blobs.names(store.name + "/") if "/global_step8/" in n]  # cleared


def test_a_rank_whose_save_failed_tells_rank_0_at_once(tmp_path: Path) -> None:
    store = _store(tmp_path, "failed")
    store.write("global_step2/.rank0.json", json.dumps({"mp_rank_00_model_states.pt": {"size": 1}}))
    store.write("global_step2/.rank1.json", json.dumps({".failed": "[Errno 28] No space left on device"}))
    publisher = Publisher(store, 2, rank=0, world=2, wait_s=600)  # no waiting out the timeout
    with pytest.raises(
        CheckpointError, match=r"rank 1 could not save gridfs:failed\d+/global_step2: \[Errno 28\]"
    ):
        publisher._manifests("global_step2")
    assert store.read("latest") is None
