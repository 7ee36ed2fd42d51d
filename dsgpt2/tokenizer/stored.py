"""Tokenizers kept in a store (:mod:`dsgpt2.stores`): ``gridfs:NAME`` (``vocab train --out``, ``vocab
push``, a run's ``--vocab_dir``) is a tokenizer directory kept in the GridFS bucket ``tokenizers`` of the
corpus's database, under ``NAME/``, so that nodes sharing the database need no copy of it. A tokenizer is
a store's tag: its parent location's files under its last name.

Its files are uploaded first, then a marker listing each file's size and SHA-256 and the tokenizer's hash
(what a run's data fingerprint pins): a tokenizer whose upload died part-way has no marker and is not
there. A reader downloads the files into a directory of its own, each checked against the marker (files
already there and intact are kept), and reads that directory as any other; a run records the location,
and its checkpoint is checked against the hash as ever.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsgpt2.db.client import Connection, connect
from dsgpt2.db.config import MongoConfig, load_config
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.files import file_sha256, not_a_file, reader_cache
from dsgpt2.stores.base import STORES, Artifact, Store, offered, split_location
from dsgpt2.tokenizer.bpe import load_tokenizer, tokenizer_digest

log = logging.getLogger(__name__)

TOKENIZERS = Artifact("tokenizers", "tokenizer.complete.json", "files", "gridfs:tok-32k")
BUCKET, MARKER = TOKENIZERS.name, TOKENIZERS.marker


def stored_tokenizer(location: str | Path | None) -> str | None:
    """The name of a stored tokenizer's location (``gridfs:NAME``); None for a directory.

    Raises:
        ConfigError: a misspelt location.
    """
    kind = split_location(location, TOKENIZERS)
    return None if kind is None else kind[1]


def copies_dir(root: Path, scheme: str, conn: Connection) -> Path:
    """Where the machine's copies of ``scheme``'s tokenizers of ``conn``'s database are, under ``root`` (a
    workspace, the reader cache)."""
    return root / f"{scheme}-tokenizers" / conn.config.db


class StoredTokenizer:
    """The tokenizer ``name`` of the connection's database, and this machine's copy of it in ``local``
    (none: a scratch directory, for storing one)."""

    def __init__(
        self, conn: Connection, name: str, local: Path | None = None, scheme: str = "gridfs"
    ) -> None:
        self.conn, self.name, self.scheme, self.local = conn, name, scheme, local
        self.parent, _, self.tag = name.rpartition("/")

    @contextlib.contextmanager
    def _store(self) -> Iterator[Store]:
        """The store the tokenizer is a tag of, its copy in ``local`` (else in a scratch directory)."""
        if self.local is not None:
            yield STORES[self.scheme].open(self.parent, TOKENIZERS, self.conn, self.local.parent)
            return
        with tempfile.TemporaryDirectory(prefix="dsgpt2-tokenizer-") as scratch:
            yield STORES[self.scheme].open(self.parent, TOKENIZERS, self.conn, Path(scratch))

    @property
    def location(self) -> str:
        return f"{self.scheme}:{self.name}"

    def _where(self) -> str:
        return f"{self.location} in {self.conn.config.display_uri} ({self.conn.config.db})"

    def marker(self) -> dict[str, Any] | None:
        """What the stored marker says (files, hash); None when no whole tokenizer is stored."""
        import json

        with self._store() as store:
            text = store.read(f"{self.tag}/{MARKER}")
        try:
            found = json.loads(text or "")
        except ValueError:
            return None
        return found if isinstance(found, dict) and isinstance(found.get("files"), dict) else None

    def push(self, directory: Path, overwrite: bool = False) -> str:
        """Keep the tokenizer in ``directory`` (its files, then the marker); returns its hash. A tokenizer
        replaced is deleted first, its marker before its files: a reader meanwhile finds none, never new
        files under the old hash.

        The same tokenizer stored under the name already is left as it is.

        Raises:
            ConfigError: ``directory`` holds no tokenizer, or another is stored under the name already and
                not ``overwrite``.
        """
        if not (directory / "tokenizer.json").is_file():
            raise ConfigError(f"{directory}: no tokenizer.json; train one first (dsgpt2 vocab train)")
        load_tokenizer(directory)  # one that cannot be read is not stored for runs to fail on
        for path in sorted(directory.iterdir()):  # a named pipe would be waited on when copied
            why = None if path.name.startswith(".") or path.is_dir() else not_a_file(path)
            if why is not None:
                raise ConfigError(f"{path}: {why}; a tokenizer directory holds files only")
        digest = tokenizer_digest(directory)
        if self.holds(digest):
            return digest  # the same tokenizer: nothing to replace
        replaced = self.check_free(overwrite)
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
        with self._store() as store:
            # Its files only: NAME/other may be another tokenizer.
            store.delete(self.tag, files=(replaced or {}).get("files") or ())
            copy = store.local / self.tag  # the store keeps the files of its copy
            if not copy.exists() or copy.resolve() != directory.resolve():
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(directory, copy, ignore=shutil.ignore_patterns(".*"))
            files = store.put(self.tag, names)
            store.complete(self.tag, {"tokenizer": digest, "files": files})
        return digest

    def holds(self, digest: str) -> bool:
        """Whether the tokenizer of hash ``digest`` is the one stored under the name."""
        return (self.marker() or {}).get("tokenizer") == digest

    def check_free(self, overwrite: bool) -> dict[str, Any] | None:
        """Refuse a name that holds a tokenizer already, unless ``overwrite``; the marker of the one
        ``overwrite`` replaces.

        Raises:
            ConfigError: naming the stored tokenizer's hash.
        """
        stored = self.marker()
        if stored is not None and not overwrite:
            raise ConfigError(
                f"{self._where()} holds a tokenizer (hash {stored.get('tokenizer')}), which runs may have "
                "trained with and are checked against; pass --overwrite to replace it, or give another name"
            )
        return stored

    def pull(self) -> Path:
        """This machine's copy of the tokenizer, ``local`` (files already there and intact kept), each
        file checked against the marker.

        Raises:
            ConfigError: no tokenizer is stored under the name, or ``local`` cannot be written.
            CheckpointError: a stored file is damaged, or not the one the marker names (replaced while
                it was read).
        """
        try:
            return self._pull()
        except OSError as exc:
            raise ConfigError(
                f"{self.location}: cannot keep a copy of it in {self.local} ({exc.strerror})"
            ) from None

    def _pull(self) -> Path:
        assert self.local is not None, "a tokenizer is brought into the copy it was opened with"
        self.local.mkdir(parents=True, exist_ok=True)
        marker = self.marker()
        if marker is None:
            with self._store() as store:
                others = offered(store, MARKER, "tokenizers", self.location)
            raise ConfigError(
                f"{self._where()}: no tokenizer stored there; store one with `dsgpt2 vocab train --out "
                f"{self.location}` or `dsgpt2 vocab push DIR --out {self.location}` (with --config){others}"
            )
        fetched = 0
        for name, want in marker["files"].items():
            # File by file: another process of this machine may be fetching the same tokenizer here.
            if (self.local / name).is_file() and file_sha256(self.local / name) == want:
                continue
            with self._store() as store:
                got = store.get(self.tag, name)
            if got != want:
                raise CheckpointError(
                    f"{self.location}: {name} is not the file its marker names (the tokenizer was replaced "
                    "while it was read); run the command again"
                )
            fetched += 1
        if fetched:
            log.info("downloaded the tokenizer %s (hash %s) to %s", self.location, marker["tokenizer"],
                     self.local)  # fmt: skip
        return self.local


def tokenizer_store(
    location: str | Path, conn: Connection, local: Path | None = None
) -> StoredTokenizer | None:
    """The stored tokenizer ``location`` names, of the kind its scheme says (``local``: this machine's copy
    of it); None for a directory."""
    kind = split_location(location, TOKENIZERS)
    return None if kind is None else StoredTokenizer(conn, kind[1], local, kind[0])


def fetch_tokenizer(location: str | Path, conn: Connection, root: Path) -> Path:
    """A tokenizer directory for ``location``: itself, or for ``gridfs:NAME`` this machine's copy under
    ``root`` of the tokenizer stored in ``conn``'s database."""
    kind = split_location(location, TOKENIZERS)
    if kind is None:
        return Path(location)
    scheme, name = kind
    stored = tokenizer_store(location, conn, copies_dir(root, scheme, conn) / name)
    assert stored is not None
    return stored.pull()


def local_tokenizer(
    location: str | Path, config: str | MongoConfig | None, copy: str | None = None, flag: str = "--vocab_dir"
) -> Path:
    """A tokenizer directory to read ``location`` from, for a reader: ``location`` itself, or for
    ``gridfs:NAME`` a copy on this machine, fetched through the connection config ``config`` (a file or
    loaded) into ``$XDG_CACHE_HOME/dsgpt2``, else, without one, ``copy`` (the training run's own copy)
    where it is still here. The caller checks the hash against the model's, as for any directory.

    Raises:
        ConfigError: a stored tokenizer, no connection config and no copy of it here.
    """
    if stored_tokenizer(location) is None:
        return Path(location)
    if not config:
        if copy and (Path(copy) / "tokenizer.json").is_file():
            return Path(copy)
        raise ConfigError(
            f"{flag} {location}: a tokenizer in the database is read through its connection config; add "
            "the command's --config (--db_config for evaluate, generate, chat and serve), the one the run "
            "trained with"
        )
    mongo = config if isinstance(config, MongoConfig) else load_config(config)
    return fetch_tokenizer(location, connect(mongo, create=False), reader_cache())
