"""The :class:`Store` protocol, the whole of what a kind of location implements, and the registry of
kinds, chosen once from a location's scheme: where checkpoints and tokenizers are kept.

A location is a directory (``runs/ckpt``) or ``SCHEME:NAME`` (``gridfs:gpt2-small/run1``). A store keeps
files by tag (a checkpoint's ``global_step4``, a tokenizer's name): a tag is whole once its marker is
stored (every file's size and SHA-256), and small files beside the tags (``latest``, ``best``, the ranks'
manifests) are read and written whole. DeepSpeed writes and every reader reads a directory, the store's
``local``: the location itself for a directory, else this machine's copy, to which files travel by
:meth:`Store.put` and :meth:`Store.get`. What is decided above a store is decided once for every kind:
for checkpoints in :mod:`dsgpt2.checkpoints.publisher` (writing while training goes on, ``latest``, ``best``,
``--keep_last``) and :mod:`dsgpt2.checkpoints.copies` (this machine's copy, what readers read); for
tokenizers in :mod:`dsgpt2.tokenizer.stored`.

A new kind is one module: a class of this protocol registered in :data:`STORES` under its scheme
(``dsgpt2/stores/gridfs.py`` is one).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.files import atomic_write_text, file_sha256, read_regular, reader_cache
from dsgpt2.registry import Registry

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):(?!//)")


@dataclass(frozen=True)
class Artifact:
    """What a store keeps (checkpoints, tokenizers: their owners declare it): its name (a GridFS bucket),
    the file that marks a tag whole and the field a marker always holds."""

    name: str
    marker: str
    holds: str
    example: str  # a location of it, as an error shows one

    def read_marker(self, path: Path) -> dict[str, Any] | None:
        """The marker at ``path``; None where it is absent or unreadable (the tag is not whole)."""
        try:
            marker = json.loads(read_regular(path))  # a named pipe is not waited on
        except (OSError, ValueError):
            return None
        return marker if isinstance(marker, dict) and marker.get(self.holds) is not None else None


class Store(Protocol):
    """Files kept by tag at one location (see the module's doc)."""

    needs_connection: ClassVar[bool]  # reached through the corpus's database connection
    location: str  # as a user names it
    local: Path  # the directory DeepSpeed writes into and readers read from
    staged: bool  # ``local`` is this machine's copy (files travel by put and get), not the location

    @classmethod
    def open(cls, name: str, artifact: Artifact, conn: Any, local: Path) -> Store:
        """The store of ``artifact`` at ``SCHEME:name`` (``conn``: the database connection, where the kind
        needs one; ``local``: this machine's copy)."""
        ...

    def tags(self) -> dict[str, dict[str, Any]]:
        """The whole tags: their markers, by tag."""
        ...

    def started(self) -> list[str]:
        """Tags with files and no marker at all (one there but unreadable is a damaged tag, not this):
        saves that did not finish."""
        ...

    def put(self, tag: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Keep the files ``names`` of ``local/tag``; returns their size and SHA-256."""
        ...

    def get(self, tag: str, name: str) -> dict[str, Any]:
        """Bring the kept file ``name`` of ``tag`` to ``local/tag/name``, checked; its size and SHA-256.

        Raises:
            CheckpointError: no such file, or its bytes are not the ones kept.
        """
        ...

    def complete(self, tag: str, marker: dict[str, Any]) -> None:
        """Mark ``tag`` whole (every file of it kept)."""
        ...

    def read(self, name: str) -> str | None:
        """The small file ``name`` (``latest``, ``TAG/config.yaml``...); None when there is none."""
        ...

    def write(self, name: str, text: str) -> None:
        """Replace the small file ``name`` with ``text``, in one step."""
        ...

    def delete(self, tag: str, files: Iterable[str] | None = None) -> int:
        """Delete ``tag``, its marker first (never a whole tag with files missing): every file under it,
        or only ``files`` of it; how many files."""
        ...

    def holding(self, name: str) -> list[str]:
        """The locations of this kind and artifact that hold the small file ``name`` (``latest``: a run's
        checkpoints), as a user names them: what a message lists where a location holds nothing."""
        ...


# The kinds of location by scheme; a directory (no scheme) is DirectoryStore, the default.
STORES: Registry[type[Store]] = Registry("kind of location", "location scheme")


def split_location(location: str | Path | None, artifact: Artifact) -> tuple[str, str] | None:
    """``(scheme, name)`` of a ``SCHEME:NAME`` location of a registered kind; None for a directory.

    Raises:
        ConfigError: the scheme of a kind mistyped in case (``GridFS:``), or a name that is not one: letters,
            digits, ``.``, ``_``, ``-`` and ``/``, no part ``.`` or ``..``.
    """
    text = "" if location is None else str(location)
    found = _SCHEME.match(text)
    if found is None:
        return None
    scheme = found.group(1)
    if scheme not in STORES:
        close = [s for s in STORES if s.lower() == scheme.lower()]
        if close:
            raise ConfigError(f"{text}: the location kind is spelt {close[0]}: (e.g. {artifact.example})")
        return None  # a directory whose name holds a colon
    name = text[found.end() :].strip("/")
    if not _NAME.match(name) or any(part in (".", "..") for part in name.split("/")):
        where = "in the database " if STORES[scheme].needs_connection else ""
        raise ConfigError(
            f"{text}: a location {where}is {scheme}:NAME, NAME made of letters, digits, '.', '_', '-' and "
            f"'/', no part of it '.' or '..' (e.g. {artifact.example})"
        )
    return scheme, name


def open_store(
    location: str | Path, artifact: Artifact, *, conn: Any = None, copies: Path | None = None
) -> Store:
    """The store of ``location``: a directory, or the registered kind its scheme names, whose copy on this
    machine is kept in ``copies/SCHEME/NAME`` (default: under the reader cache).

    Raises:
        ConfigError: a misspelt location, or a kind that needs a connection and none is given.
    """
    kind = split_location(location, artifact)
    if kind is None:
        if _SCHEME.match(str(location)):  # a plugin's kind, not registered in this process?
            log.warning("%s: no kind of location is registered as %s:, so it is a directory here (kinds: %s)",
                        location, str(location).split(":")[0], ", ".join(STORES))  # fmt: skip
        return DirectoryStore(Path(location), artifact)
    scheme, name = kind
    cls = STORES[scheme]
    if cls.needs_connection and conn is None:
        raise ConfigError(f"{location}: reached through the corpus's database; give its connection config")
    if copies is None:  # the reader cache, shared by every database: one folder each
        copies = reader_cache() / (conn.config.db if conn is not None else "-")
    return cls.open(name, artifact, conn, copies / scheme / name)


def offered(store: Store, name: str, what: str, location: str | None = None) -> str:
    """The end of a message about a location (``store``'s, or ``location`` in it) that holds nothing: the
    locations of its kind that hold ``name`` (``what`` they are), and the closest where one is close."""
    import difflib

    location = location or store.location
    there = [s for s in store.holding(name) if s != location]
    if not there:
        return ""
    close = difflib.get_close_matches(location, there, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"; the {what} stored there: {', '.join(there[:20])}{' ...' if len(there) > 20 else ''}{hint}"


def where(store: Store, tag: str) -> str:
    """Where ``tag`` is, as a user names it."""
    return f"{store.location.rstrip('/')}/{tag}"


class DirectoryStore:
    """A directory: the location is its own copy, so files are where they are written and read."""

    needs_connection: ClassVar[bool] = False
    staged = False

    def __init__(self, directory: Path, artifact: Artifact) -> None:
        self.local, self.artifact, self.location = Path(directory), artifact, str(directory)

    @classmethod
    def open(cls, name: str, artifact: Artifact, conn: Any, local: Path) -> DirectoryStore:
        return cls(Path(name), artifact)

    def tags(self) -> dict[str, dict[str, Any]]:
        if not self.local.is_dir():
            return {}
        out = {}
        for path in sorted(p for p in self.local.iterdir() if p.is_dir()):
            marker = self.artifact.read_marker(path / self.artifact.marker)
            if marker is not None:
                out[path.name] = marker
        return out

    def started(self) -> list[str]:
        if not self.local.is_dir():
            return []
        return sorted(
            p.name
            for p in self.local.iterdir()
            if p.is_dir() and not p.name.startswith(".") and not (p / self.artifact.marker).exists()
        )

    def put(self, tag: str, names: Iterable[str]) -> dict[str, dict[str, Any]]:
        # The named files only: other ranks may be writing theirs beside them.
        return {name: file_sha256(self.local / tag / name) for name in names}

    def get(self, tag: str, name: str) -> dict[str, Any]:
        path = self.local / tag / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        return file_sha256(path)

    def complete(self, tag: str, marker: dict[str, Any]) -> None:
        atomic_write_text(self.local / tag / self.artifact.marker, json.dumps(marker, indent=1) + "\n")

    def read(self, name: str) -> str | None:
        try:
            return read_regular(self.local / name).decode("utf-8", "replace")
        except OSError:
            return None

    def write(self, name: str, text: str) -> None:
        (self.local / name).parent.mkdir(parents=True, exist_ok=True)  # a rank's manifest may come first
        atomic_write_text(self.local / name, text)

    def delete(self, tag: str, files: Iterable[str] | None = None) -> int:
        path = self.local / tag
        if not path.exists():
            return 0
        (path / self.artifact.marker).unlink(missing_ok=True)
        if files is not None:
            gone = [path / name for name in files if (path / name).is_file()]
            for file in gone:
                file.unlink()
            return len(gone)
        count = sum(1 for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path, ignore_errors=True)
        return count

    def holding(self, name: str) -> list[str]:
        return []  # a directory is named by its path: there is no list of others to offer
