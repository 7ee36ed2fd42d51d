"""Files kept in the database (GridFS): what lets a run's nodes share checkpoints through the server they
already reach, with no shared file system.

Each file is stored under a name (``run/global_step4/mp_rank_00_model_states.pt``) with its size and
SHA-256 in its metadata, computed while it is read for the upload; a download is written to a temporary
file beside its destination, checked against both, then renamed: a damaged chunk, a truncated file or a
file of another upload is one error naming it, never a file in place. Replacing a name uploads the new
version before the old ones are deleted, so a reader finds one or the other, never none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gridfs
from gridfs.errors import NoFile

from dsgpt2.db.client import Connection, with_retries
from dsgpt2.errors import CheckpointError

_BLOCK = 1 << 22
_WINDOW = 64  # chunks read per query (16 MB of GridFS's 255 KB chunks)


class _Hashing:
    """A file read for an upload, its size and SHA-256 taken on the way."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


class BlobStore:
    """The files of GridFS bucket ``bucket`` of the connection's database."""

    def __init__(self, conn: Connection, bucket: str) -> None:
        self.conn, self.bucket_name = conn, bucket

    @property
    def _bucket(self) -> gridfs.GridFSBucket:
        # Made per call: a connection's client is remade in another process or after a server move.
        return gridfs.GridFSBucket(self.conn.db, bucket_name=self.bucket_name)

    @property
    def _files(self) -> Any:
        return self.conn.db[f"{self.bucket_name}.files"]

    def put(self, name: str, path: Path) -> dict[str, Any]:
        """Upload the file ``path`` as ``name`` (replacing any file of that name once it is stored);
        returns its size and SHA-256."""

        def upload() -> dict[str, Any]:
            with open(path, "rb") as f:
                source = _Hashing(f)
                with self._bucket.open_upload_stream(name, metadata={"pending": True}) as stream:
                    while block := source.read(_BLOCK):
                        stream.write(block)
                file_id = stream._id
            digest = {"size": source.size, "sha256": source.sha.hexdigest()}
            self._files.update_one({"_id": file_id}, {"$set": {"metadata": digest}})
            return {"_id": file_id, **digest}

        stored = with_retries(upload, self.conn.config, f"uploading {name}")
        self._drop_others(name, keep=stored.pop("_id"))
        return stored

    def put_text(self, name: str, text: str, scratch: Path) -> None:
        """Store ``text`` as the file ``name`` (``scratch``: a local file to write it through)."""
        scratch.parent.mkdir(parents=True, exist_ok=True)
        scratch.write_text(text, encoding="utf-8")
        try:
            self.put(name, scratch)
        finally:
            scratch.unlink(missing_ok=True)

    def get(self, name: str, dest: Path) -> dict[str, Any]:
        """Download the file ``name`` to ``dest``, checked against the size and SHA-256 stored with it;
        returns them.

        Raises:
            CheckpointError: there is no complete file of that name, or its bytes are not the ones
                stored (a damaged or missing chunk).
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")

        def download() -> dict[str, Any]:
            info = self.stat(name)
            if info is None:
                raise CheckpointError(f"{self._where(name)} is missing")
            chunks = self.conn.db[f"{self.bucket_name}.chunks"]
            sha, size, n = hashlib.sha256(), 0, 0
            with open(tmp, "wb") as out:
                while True:
                    # A window of chunks at a time, on the (files_id, n) index: one cursor over the
                    # whole file would have the embedded engine hold all of it in its memory.
                    query = {"files_id": info["_id"], "n": {"$gte": n, "$lt": n + _WINDOW}}
                    window = list(chunks.find(query, {"_id": 0, "n": 1, "data": 1}).sort("n", 1))
                    for chunk in window:
                        if chunk["n"] != n:
                            raise CheckpointError(f"{self._where(name)} is damaged (no chunk {n})")
                        data = bytes(chunk["data"])
                        sha.update(data)
                        out.write(data)
                        size, n = size + len(data), n + 1
                    if len(window) < _WINDOW:
                        break
            if size != info["size"] or sha.hexdigest() != info["sha256"]:
                raise CheckpointError(
                    f"{self._where(name)} is damaged (its bytes differ from the size and SHA-256 stored "
                    "with it)"
                )
            return {"size": size, "sha256": info["sha256"]}

        try:
            got = with_retries(download, self.conn.config, f"downloading {name}")
            tmp.replace(dest)
            return got
        finally:
            tmp.unlink(missing_ok=True)

    def get_text(self, name: str, scratch: Path) -> str | None:
        """The text of the file ``name``, or None when there is none."""
        if self.stat(name) is None:
            return None
        self.get(name, scratch)
        try:
            return scratch.read_text(encoding="utf-8")
        finally:
            scratch.unlink(missing_ok=True)

    def stat(self, name: str) -> dict[str, Any] | None:
        """The newest complete file of ``name``: its id, size and SHA-256; None when there is none."""
        query = {"filename": name, "metadata.sha256": {"$exists": True}}
        found = with_retries(
            lambda: list(self._files.find(query, {"metadata": 1}).sort("uploadDate", -1).limit(1)),
            self.conn.config,
            f"reading {name}",
        )
        if not found:
            return None
        return {"_id": found[0]["_id"], **found[0]["metadata"]}

    def names(self, prefix: str) -> list[str]:
        """The names of the complete files under ``prefix`` (a name's start), sorted."""
        return sorted(n for n, _ in self._listed(prefix))

    def listing(self, prefix: str) -> dict[str, dict[str, Any]]:
        """The complete files under ``prefix``: their size and SHA-256, by name."""
        return dict(self._listed(prefix))

    def delete_file(self, name: str) -> int:
        """Delete every version of the file ``name`` (that name only); returns how many."""
        ids = with_retries(
            lambda: [d["_id"] for d in self._files.find({"filename": name}, {"_id": 1})],
            self.conn.config,
            f"listing {name}",
        )
        for file_id in ids:
            self._delete(file_id)
        return len(ids)

    def delete(self, prefix: str) -> int:
        """Delete every file (complete or not) whose name starts with ``prefix``; returns how many."""
        ids = with_retries(
            lambda: [
                d["_id"]
                for d in self._files.find({"filename": {"$regex": f"^{_escape(prefix)}"}}, {"_id": 1})
            ],
            self.conn.config,
            f"listing {prefix}",
        )
        for file_id in ids:
            self._delete(file_id)
        return len(ids)

    def _listed(self, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
        query = {"filename": {"$regex": f"^{_escape(prefix)}"}, "metadata.sha256": {"$exists": True}}
        docs = with_retries(
            lambda: list(self._files.find(query, {"filename": 1, "metadata": 1, "uploadDate": 1})),
            self.conn.config,
            f"listing {prefix}",
        )
        newest: dict[str, dict[str, Any]] = {}
        for d in sorted(docs, key=lambda d: d["uploadDate"]):
            newest[d["filename"]] = {"size": d["metadata"]["size"], "sha256": d["metadata"]["sha256"]}
        yield from newest.items()

    def _drop_others(self, name: str, keep: Any) -> None:
        others = with_retries(
            lambda: [
                d["_id"] for d in self._files.find({"filename": name, "_id": {"$ne": keep}}, {"_id": 1})
            ],
            self.conn.config,
            f"replacing {name}",
        )
        for file_id in others:
            self._delete(file_id)

    def _delete(self, file_id: Any) -> None:
        def drop() -> None:
            with contextlib.suppress(NoFile):  # deleted meanwhile (a retry after a lost acknowledgement)
                self._bucket.delete(file_id)

        with_retries(drop, self.conn.config, "deleting a stored file")

    def _where(self, name: str) -> str:
        return f"{self.conn.config.db}.{self.bucket_name}:{name}"


def _escape(prefix: str) -> str:
    return re.escape(prefix)
