"""Checkpoints in the database: ``--ckpt_dir gridfs:RUN`` keeps a run's checkpoints in the GridFS bucket
``checkpoints`` of the corpus's database, under ``RUN/``, for nodes that share the database and no
directory.

Every node works on a copy of its own, a staging directory laid out as a checkpoint directory is:
DeepSpeed saves into it as ever, then each rank uploads the files it wrote, and rank 0, once every rank
has, the complete marker (every file's size and SHA-256, from every rank) and only then ``latest``. A
save that dies part-way therefore never becomes ``latest``; files of an unfinished save are deleted by
the next one. A reader (a resume, ``export``, ``evaluate``...) first makes the staging directory's index
(``latest``, ``best``, the markers) the database's, then downloads the files of the checkpoint it reads,
each checked against its SHA-256 (files already there and intact are kept), and reads the directory as
any other.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints.format import BEST, COMPLETE, LATEST, UNIVERSAL, file_digests, peek_tag
from dsgpt2.db.blobs import PREFIX, BlobStore, gridfs_name
from dsgpt2.db.client import Connection
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.files import reader_cache

log = logging.getLogger(__name__)

BUCKET = "checkpoints"
_RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")
_POINTERS = (LATEST, BEST)


def stored_run(location: str | Path | None) -> str | None:
    """The run name of a ``gridfs:RUN`` location; None for a directory.

    Raises:
        ConfigError: a ``gridfs:`` location without a valid run name.
    """
    return gridfs_name(location, "gridfs:gpt2-small/run1")


def staging_dir(root: Path, run: str) -> Path:
    """This node's copy of the stored run ``run``, under ``root``."""
    return root / "gridfs" / run


def own_files(directory: Path, rank: int) -> list[str]:
    """The files of a saved checkpoint directory that rank ``rank`` wrote (its ZeRO shards; rank 0 also
    every file of no rank: the model states, dsgpt2's own files), the marker excepted."""
    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE):
        m = _RANK_FILE.search(path.name)
        if (int(m.group(1)) if m else 0) == rank:
            out.append(str(path.relative_to(directory)))
    return out


class StoredCheckpoints:
    """The checkpoints of run ``run`` in the database, and this node's staging directory ``local``."""

    def __init__(self, conn: Connection, run: str, local: Path) -> None:
        self.conn, self.run, self.local = conn, run, local
        self.store = BlobStore(conn, BUCKET)

    @property
    def location(self) -> str:
        return f"{PREFIX}{self.run}"

    def _name(self, *parts: str) -> str:
        return "/".join((self.run, *parts))

    def tags(self) -> dict[str, dict[str, Any]]:
        """The complete checkpoints stored: their markers, by tag."""
        out = {}
        for name in self.store.names(self.run + "/"):
            rest = name[len(self.run) + 1 :]
            if rest.count("/") == 1 and rest.endswith("/" + COMPLETE):
                tag = rest.split("/")[0]
                text = self.store.get_text(name, self.local / f".{tag}.marker")
                try:
                    marker = json.loads(text or "")
                except ValueError:
                    continue  # an unreadable marker: not complete, as on a disk
                if isinstance(marker, dict):
                    out[tag] = marker
        return out

    def store_json(self, name: str, value: Any) -> None:
        """Store ``value`` as the JSON file ``RUN/name``."""
        self.store.put_text(self._name(name), json.dumps(value), self.local / f".{os.getpid()}.json.part")

    def load_json(self, name: str) -> Any:
        """The JSON file ``RUN/name``; None when there is none."""
        text = self.store.get_text(self._name(name), self.local / f".{os.getpid()}.json.read")
        return None if text is None else json.loads(text)

    def latest(self) -> str | None:
        """The tag the stored ``latest`` names; None when there is none."""
        text = self.store.get_text(self._name(LATEST), self.local / ".latest.read")
        return None if text is None else text.strip()

    def resumed_args(self, ckpt_id: str | None, resolved: str) -> dict[str, Any] | None:
        """The options of the stored checkpoint a resume would take (``ckpt_id``, else the one ``latest``
        names, or the newest complete one where it names none that is), from its resolved configuration
        (the file ``resolved``), read before anything is downloaded; None when there is none or it does not
        read."""
        import yaml

        tag = ckpt_id or LATEST
        if tag in _POINTERS:
            tag = (
                self.store.get_text(self._name(tag), self.local / f".{os.getpid()}.tag.read") or ""
            ).strip()
            stored = {t: m for t, m in self.tags().items() if not t.endswith(UNIVERSAL)}
            if tag not in stored and ckpt_id is None and stored:
                tag = max(stored, key=lambda t: stored[t].get("step", -1))
        text = (
            self.store.get_text(self._name(tag, resolved), self.local / f".{os.getpid()}.yaml.read")
            if tag
            else None
        )
        try:
            values = yaml.safe_load(text or "")
        except yaml.YAMLError:
            return None  # the resume names the problem in one line
        return values if isinstance(values, dict) else None

    def pull_index(self) -> None:
        """Make the staging directory's ``latest``, ``best`` and markers the stored ones: a marker or
        pointer only here (a save that did not finish its upload) is removed."""
        self.local.mkdir(parents=True, exist_ok=True)
        stored = self.tags()
        for path in self.local.glob(f"*/{COMPLETE}"):
            if path.parent.name not in stored:
                path.unlink()
        for tag, marker in stored.items():
            (self.local / tag).mkdir(exist_ok=True)
            (self.local / tag / COMPLETE).write_text(json.dumps(marker, indent=1) + "\n")
        for pointer in _POINTERS:
            text = self.store.get_text(self._name(pointer), self.local / f".{pointer}.part")
            if text is None:
                (self.local / pointer).unlink(missing_ok=True)
            else:
                (self.local / pointer).write_text(text)

    def pull(self, tag: str) -> None:
        """Download the files of the stored checkpoint ``tag`` that the staging directory lacks, each
        checked against its SHA-256 (the index first: :meth:`pull_index`).

        Raises:
            CheckpointError: ``tag`` is not a complete stored checkpoint, or a file of it is damaged.
        """
        try:
            marker = json.loads((self.local / tag / COMPLETE).read_text())
        except (OSError, ValueError):
            raise CheckpointError(f"{self.location}: no complete checkpoint {tag}") from None
        present = file_digests(self.local / tag)
        fetched = 0
        for name, want in (marker.get("files") or {}).items():
            if present.get(name) == want:
                continue
            self.store.get(self._name(tag, name), self.local / tag / name)
            fetched += 1
        if fetched:
            log.info("downloaded %d file(s) of %s/%s to %s", fetched, self.location, tag, self.local / tag)

    def pull_resumable(self, ckpt_id: str | None) -> None:
        """The index, and the files of the checkpoint a resume would take (``ckpt_id``, else the one
        ``latest`` names), so that it is verified and loaded as on a disk."""
        self.pull_index()
        tag = peek_tag(self.local, ckpt_id)
        if tag is None:
            return
        try:
            self.pull(tag)
        except CheckpointError as exc:
            others = [t for t in sorted(self.tags(), key=_step) if t != tag]
            advice = f"; resume another with --ckpt_id {others[-1]}" if others else ""
            raise CheckpointError(f"{exc}{advice}") from None

    def push(self, tag: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Upload the files ``names`` of the staging directory's ``tag``; their size and SHA-256."""
        return {name: self.store.put(self._name(tag, name), self.local / tag / name) for name in names}

    def publish(self, tag: str, marker: dict[str, Any], latest: bool = True) -> None:
        """Store ``tag``'s complete marker (every rank's files uploaded), then point ``latest`` at it."""
        self.store.put_text(self._name(tag, COMPLETE), json.dumps(marker, indent=1) + "\n", self._scratch())
        if latest:
            self.point(LATEST, tag)

    def point(self, pointer: str, tag: str) -> None:
        """Set the stored ``latest`` or ``best`` to ``tag``."""
        self.store.put_text(self._name(pointer), tag, self._scratch())

    def drop(self, tag: str) -> int:
        """Delete every stored file of ``tag`` (the marker first: never a complete checkpoint with files
        missing); returns how many."""
        self.store.delete(self._name(tag, COMPLETE))
        return self.store.delete(self._name(tag) + "/")

    def drop_local_extras(self) -> list[str]:
        """Remove the staging directory's checkpoints that are not stored (pruned by ``--keep_last``, or
        saves that never finished their upload): on a node other than rank 0's nothing else prunes them.
        Returns their tags."""
        stored = set(self.tags())
        extra = [p for p in self.local.glob("global_step*") if p.is_dir() and p.name not in stored]
        for path in extra:
            shutil.rmtree(path, ignore_errors=True)
        return sorted(p.name for p in extra)

    def unfinished(self) -> list[str]:
        """Tags with files stored and no marker: saves that did not finish their upload."""
        complete = set(self.tags())
        found = {
            n[len(self.run) + 1 :].split("/")[0]
            for n in self.store.names(self.run + "/")
            if "/" in n[len(self.run) + 1 :]
        }
        return sorted(found - complete)

    def _scratch(self) -> Path:
        return self.local / f".{os.getpid()}.upload.part"


def _step(tag: str) -> int:
    digits = re.sub(r"\D", "", tag)
    return int(digits) if digits else -1


def readable(location: Path, ckpt_id: str | None, config: str | None, flag: str) -> Path:
    """A checkpoint directory to read ``location``'s checkpoint from: ``location`` itself, or, for a
    ``gridfs:RUN`` location, this machine's copy of the run's index and of the checkpoint ``ckpt_id``
    (else the one ``latest`` names), downloaded from the database ``config`` names.

    Raises:
        ConfigError: a stored location without a connection config.
        CheckpointError: no such stored checkpoint, or a damaged file of it.
    """
    run = stored_run(location)
    if run is None:
        return location
    if not config:
        raise ConfigError(
            f"{flag} {location}: checkpoints in the database are read through its connection config; "
            "add --config c.json (the one the run trained with)"
        )
    from dsgpt2.db.client import connect
    from dsgpt2.db.config import load_config

    mongo = load_config(config)
    stored = StoredCheckpoints(connect(mongo, create=False), run, staging_dir(reader_cache() / mongo.db, run))
    stored.pull_resumable(ckpt_id)
    if not any(stored.local.glob(f"*/{COMPLETE}")):
        raise CheckpointError(f"{location}: no checkpoint stored there in {mongo.display_uri} ({mongo.db})")
    return stored.local


def merged_marker(step: int, time: float, uploads: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The complete marker of a checkpoint whose ranks uploaded ``uploads`` (one listing each)."""
    files: dict[str, dict[str, Any]] = {}
    for listing in uploads:
        files.update(listing)
    return {"step": step, "time": time, "files": dict(sorted(files.items()))}


def clear_staging(local: Path) -> None:
    """Remove a staging directory (its checkpoints are in the database)."""
    shutil.rmtree(local, ignore_errors=True)
