"""``gridfs:NAME``: checkpoints (``--ckpt_dir gridfs:RUN``) and tokenizers (``--vocab_dir gridfs:NAME``) kept
in a GridFS bucket of the corpus's database (``checkpoints``, ``tokenizers``), under ``NAME/``, for nodes
that share the database and no directory.

Every machine works on a copy of its own, laid out as a checkpoint directory is: DeepSpeed saves into it
as ever, each rank keeps the files it wrote (:meth:`GridFSStore.put`), and the marker is stored once
every rank has (:mod:`dsgpt2.checkpoints.publisher`); a reader brings the files of the tag it reads, each
checked against its SHA-256 (:mod:`dsgpt2.db.blobs`), and reads the copy as any directory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

from dsgpt2.db.blobs import BlobStore
from dsgpt2.db.client import Connection
from dsgpt2.stores.base import STORES, Artifact

SCHEME = "gridfs"


@STORES.register(SCHEME)
class GridFSStore:
    """The files of ``NAME/`` in the artifact's GridFS bucket, and this machine's copy ``local``."""

    needs_connection: ClassVar[bool] = True
    staged = True

    def __init__(self, conn: Connection, name: str, artifact: Artifact, local: Path) -> None:
        self.conn, self.name, self.artifact, self.local = conn, name, artifact, local
        self.blobs = BlobStore(conn, artifact.name)

    @classmethod
    def open(cls, name: str, artifact: Artifact, conn: Any, local: Path) -> GridFSStore:
        return cls(conn, name, artifact, local)

    @property
    def location(self) -> str:
        return f"{SCHEME}:{self.name}"

    def _name(self, *parts: str) -> str:
        return "/".join(p for p in (self.name, *parts) if p)

    def _scratch(self, what: str) -> Path:
        return self.local / f".{os.getpid()}.{what}"

    def tags(self) -> dict[str, dict[str, Any]]:
        prefix = self._name() + "/" if self.name else ""
        out = {}
        for name in self.blobs.names(prefix):
            rest = name[len(prefix) :]
            if rest.count("/") == 1 and rest.endswith("/" + self.artifact.marker):
                tag = rest.split("/")[0]
                try:
                    marker = json.loads(self.blobs.get_text(name, self._scratch(f"{tag}.marker")) or "")
                except ValueError:
                    continue  # an unreadable marker: not whole, as on a disk
                if isinstance(marker, dict) and marker.get(self.artifact.holds) is not None:
                    out[tag] = marker
        return out

    def started(self) -> list[str]:
        prefix = self._name() + "/" if self.name else ""
        names = [n[len(prefix) :] for n in self.blobs.names(prefix)]
        marked = {
            n.split("/")[0] for n in names if n.count("/") == 1 and n.endswith("/" + self.artifact.marker)
        }
        return sorted({n.split("/")[0] for n in names if "/" in n} - marked)

    def put(self, tag: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        return {name: self.blobs.put(self._name(tag, name), self.local / tag / name) for name in names}

    def get(self, tag: str, name: str) -> dict[str, Any]:
        return self.blobs.get(self._name(tag, name), self.local / tag / name)

    def complete(self, tag: str, marker: dict[str, Any]) -> None:
        self.write(f"{tag}/{self.artifact.marker}", json.dumps(marker, indent=1) + "\n")

    def read(self, name: str) -> str | None:
        return self.blobs.get_text(self._name(name), self._scratch("read"))

    def write(self, name: str, text: str) -> None:
        self.blobs.put_text(self._name(name), text, self._scratch("write.part"))

    def delete(self, tag: str, files: Iterable[str] | None = None) -> int:
        self.blobs.delete_file(self._name(tag, self.artifact.marker))
        if files is None:
            return self.blobs.delete(self._name(tag) + "/")
        return sum(self.blobs.delete_file(self._name(tag, name)) for name in files)

    def holding(self, name: str) -> list[str]:
        ends = "/" + name
        return [f"{SCHEME}:{n.removesuffix(ends)}" for n in self.blobs.names("") if n.endswith(ends)]
