"""Files kept in the database (GridFS) for checkpoints: stored with their size and SHA-256, downloaded
only when their bytes are the ones stored, replaced without a moment of absence."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import make_config
from dsgpt2.db import blobs
from dsgpt2.db.blobs import BlobStore
from dsgpt2.db.client import Connection
from dsgpt2.errors import CheckpointError


@pytest.fixture
def store() -> BlobStore:
    conn = Connection(make_config(["a"]))
    s = BlobStore(conn, f"ck{os.getpid()}")
    s.delete("")
    return s


def _file(path: Path, size: int, seed: int = 0) -> Path:
    path.write_bytes(bytes((i * 7 + seed) % 251 for i in range(size)))
    return path


def test_a_file_goes_up_and_comes_back_whole(
    store: BlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blobs, "_WINDOW", 2)  # read back two chunks a query
    src = _file(tmp_path / "w.pt", 1_300_000)  # six chunks
    stored = store.put("run/global_step1/w.pt", src)
    assert stored["size"] == 1_300_000
    got = store.get("run/global_step1/w.pt", tmp_path / "out" / "w.pt")
    assert (tmp_path / "out" / "w.pt").read_bytes() == src.read_bytes() and got == stored
    assert store.names("run/") == ["run/global_step1/w.pt"]
    assert store.listing("run/global_step1/") == {"run/global_step1/w.pt": stored}


def test_a_replaced_file_is_the_new_one_and_only_it(store: BlobStore, tmp_path: Path) -> None:
    store.put_text("run/latest", "global_step1", tmp_path / "s")
    store.put_text("run/latest", "global_step2", tmp_path / "s")
    assert store.get_text("run/latest", tmp_path / "s") == "global_step2"
    assert store._files.count_documents({"filename": "run/latest"}) == 1
    assert store.get_text("run/nothing", tmp_path / "s") is None


def test_a_damaged_chunk_is_an_error_and_nothing_is_written(store: BlobStore, tmp_path: Path) -> None:
    store.put("run/w.pt", _file(tmp_path / "w.pt", 600_000))  # three chunks
    chunks = store.conn.db[f"{store.bucket_name}.chunks"]
    first = chunks.find_one({"n": 1})
    data = bytearray(first["data"])
    data[10] ^= 0xFF
    chunks.update_one({"_id": first["_id"]}, {"$set": {"data": bytes(data)}})
    dest = tmp_path / "out" / "w.pt"
    with pytest.raises(CheckpointError, match=r"run/w.pt is damaged"):
        store.get("run/w.pt", dest)
    assert not dest.exists() and list((tmp_path / "out").iterdir()) == []
    chunks.delete_one({"_id": first["_id"]})
    with pytest.raises(CheckpointError, match=r"run/w.pt is damaged \(no chunk 1\)"):
        store.get("run/w.pt", dest)


def test_an_upload_that_died_is_not_a_file_and_a_prefix_goes_at_once(
    store: BlobStore, tmp_path: Path
) -> None:
    stream = store._bucket.open_upload_stream("run/global_step2/w.pt", metadata={"pending": True})
    stream.write(b"half")
    stream.close()  # stored, but never given its digest: an upload that died before its end
    assert store.stat("run/global_step2/w.pt") is None and store.names("run/") == []
    with pytest.raises(CheckpointError, match="is missing"):
        store.get("run/global_step2/w.pt", tmp_path / "w.pt")
    store.put("run/global_step2/x.pt", _file(tmp_path / "x.pt", 10))
    store.put("run2/global_step1/x.pt", _file(tmp_path / "x.pt", 10))
    assert store.delete("run/") == 2 and store.names("") == ["run2/global_step1/x.pt"]
