"""Where checkpoints and tokenizers are kept: a location's kind chosen from its scheme, and the protocol a
directory answers as any kind does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsgpt2.checkpoints.format import CHECKPOINTS
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.stores.base import STORES, DirectoryStore, open_store, split_location, where
from dsgpt2.tokenizer.stored import TOKENIZERS


def test_a_location_is_a_directory_unless_a_registered_scheme_names_it() -> None:
    assert "gridfs" in STORES
    assert split_location("gridfs:gpt2/run1", CHECKPOINTS) == ("gridfs", "gpt2/run1")
    assert split_location("gridfs:/tok/", TOKENIZERS) == ("gridfs", "tok")
    for directory in ("runs/ckpt", "/abs/dir", "local://runs/db", "C:/x", "odd:name", None):
        assert split_location(directory, CHECKPOINTS) is None
    with pytest.raises(ConfigError, match=r"GridFS:x: the location kind is spelt gridfs: \(e.g. gridfs:gpt2"):
        split_location("GridFS:x", CHECKPOINTS)
    for bad in ("gridfs:../x", "gridfs:a/./b", "gridfs:a b", "gridfs:"):
        with pytest.raises(ConfigError, match="a location in the database is gridfs:NAME"):
            split_location(bad, TOKENIZERS)
    with pytest.raises(ConfigError, match="reached through the corpus's database"):
        open_store("gridfs:run", CHECKPOINTS)  # no connection


def test_a_directory_keeps_tags_whole_once_marked(tmp_path: Path) -> None:
    store = open_store(tmp_path / "ckpt", CHECKPOINTS)
    assert isinstance(store, DirectoryStore) and not store.staged and store.local == tmp_path / "ckpt"
    assert store.tags() == {} and store.started() == [] and store.read("latest") is None
    store.write("global_step2/.rank1.json", "{}")  # a rank's manifest may come before any other file
    (store.local / "global_step2" / "weights.pt").write_bytes(b"w")
    kept = store.put("global_step2", ["weights.pt"])
    assert kept == {"weights.pt": {"size": 1, "sha256": kept["weights.pt"]["sha256"]}}
    assert store.get("global_step2", "weights.pt") == kept["weights.pt"]
    assert store.started() == ["global_step2"] and store.tags() == {}
    store.complete("global_step2", {"step": 2, "files": kept})
    store.write("latest", "global_step2")
    assert store.tags() == {"global_step2": {"step": 2, "files": kept}} and store.started() == []
    assert (
        store.read("latest") == "global_step2"
        and where(store, "global_step2") == f"{store.local}/global_step2"
    )
    # A marker that does not read is a damaged tag: neither whole nor a save that died.
    (store.local / "global_step4").mkdir()
    (store.local / "global_step4" / CHECKPOINTS.marker).write_text('{"step": 4, "fi')
    assert sorted(store.tags()) == ["global_step2"] and store.started() == []
    with pytest.raises(CheckpointError, match="is missing"):
        store.get("global_step2", "other.pt")
    assert store.delete("global_step2", files=["weights.pt"]) == 1
    assert not (store.local / "global_step2" / CHECKPOINTS.marker).exists()  # the marker first
    assert (
        store.delete("global_step4") == 0 and not (store.local / "global_step4").exists()
    )  # its marker only
    assert json.loads(json.dumps(store.tags())) == {}


def test_a_latest_left_half_written_by_a_killed_writer_is_cleared_by_the_next_write(tmp_path: Path) -> None:
    """A writer SIGKILLed between writing ``latest``'s temporary file and its rename leaves that file
    behind; the next write of ``latest`` removes it, and leaves a living writer's alone."""
    import os
    import signal
    import subprocess
    import sys

    from dsgpt2.files import atomic_writer

    store = open_store(tmp_path / "ckpt", CHECKPOINTS)
    store.write("latest", "global_step2")
    pid = os.fork()
    if pid == 0:  # the killed writer
        with atomic_writer(store.local / "latest") as f:
            f.write("global_st")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    living = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = store.local / f".latest.{living.pid}.abcdefgh.tmp"  # a writer still at work
        kept.write_text("global_step6")
        left = [p.name for p in store.local.glob(".latest.*.tmp")]
        assert len(left) == 2 and f".latest.{pid}." in " ".join(left)
        store.write("latest", "global_step4")
        assert store.read("latest") == "global_step4"
        assert [p.name for p in store.local.glob(".latest.*.tmp")] == [kept.name]
    finally:
        living.kill()
        living.wait()
