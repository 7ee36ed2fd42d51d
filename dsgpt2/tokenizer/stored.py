"""Tokenizers in the database: ``gridfs:NAME`` (``vocab train --out``, ``vocab push``, a run's
``--vocab_dir``) is a tokenizer directory kept in the GridFS bucket ``tokenizers`` of the corpus's
database, under ``NAME/``, so that nodes sharing the database need no copy of it.

Its files are uploaded first, then a marker listing each file's size and SHA-256 and the tokenizer's hash
(what a run's data fingerprint pins): a tokenizer whose upload died part-way has no marker and is not
there. A reader downloads the files into a directory of its own, each checked against the marker (files
already there and intact are kept), and reads that directory as any other; a run records the location,
and its checkpoint is checked against the hash as ever.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from dsgpt2.db.blobs import PREFIX, BlobStore, gridfs_name
from dsgpt2.db.client import Connection, connect
from dsgpt2.db.config import MongoConfig, load_config
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.files import file_sha256, reader_cache
from dsgpt2.tokenizer.bpe import tokenizer_digest

log = logging.getLogger(__name__)

BUCKET = "tokenizers"
MARKER = "tokenizer.complete.json"
COPIES = "gridfs-tokenizers"  # the folder of a machine's copies, under a workspace or the cache


def stored_tokenizer(location: str | Path | None) -> str | None:
    """The name of a ``gridfs:NAME`` tokenizer location; None for a directory.

    Raises:
        ConfigError: a ``gridfs:`` location without a valid name.
    """
    return gridfs_name(location, "gridfs:tok-32k")


class StoredTokenizer:
    """The tokenizer ``name`` of the connection's database."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn, self.name = conn, name
        self.store = BlobStore(conn, BUCKET)

    @property
    def location(self) -> str:
        return f"{PREFIX}{self.name}"

    def _where(self) -> str:
        return f"{self.location} in {self.conn.config.display_uri} ({self.conn.config.db})"

    def marker(self, scratch: Path) -> dict[str, Any] | None:
        """What the stored marker says (files, hash); None when no whole tokenizer is stored."""
        text = self.store.get_text(f"{self.name}/{MARKER}", scratch)
        try:
            found = json.loads(text or "")
        except ValueError:
            return None
        return found if isinstance(found, dict) and isinstance(found.get("files"), dict) else None

    def push(self, directory: Path, overwrite: bool = False) -> str:
        """Upload the tokenizer in ``directory`` (its files, then the marker); returns its hash. A
        tokenizer replaced loses its marker first: a reader meanwhile finds none, never new files under
        the old hash.

        Raises:
            ConfigError: ``directory`` holds no tokenizer, or one is stored under the name already and
                not ``overwrite``.
        """
        if not (directory / "tokenizer.json").is_file():
            raise ConfigError(f"{directory}: no tokenizer.json; train one first (dsgpt2 vocab train)")
        self.check_free(overwrite)
        with tempfile.TemporaryDirectory(prefix="dsgpt2-tokenizer-") as scratch:
            self.store.delete(f"{self.name}/{MARKER}")
            digest = tokenizer_digest(directory)
            names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
            files = {n: self.store.put(f"{self.name}/{n}", directory / n) for n in names}
            # Files of a replaced tokenizer that this one lacks (its own, not those of NAME/other).
            for old in self._own_files() - {f"{self.name}/{n}" for n in names}:
                self.store.delete(old)
            marker = {"tokenizer": digest, "files": files}
            self.store.put_text(
                f"{self.name}/{MARKER}", json.dumps(marker, indent=1) + "\n", Path(scratch) / "m"
            )
        return digest

    def check_free(self, overwrite: bool) -> None:
        """Refuse a name that holds a tokenizer already, unless ``overwrite``.

        Raises:
            ConfigError: naming the stored tokenizer's hash.
        """
        with tempfile.TemporaryDirectory(prefix="dsgpt2-tokenizer-") as scratch:
            stored = self.marker(Path(scratch) / "marker")
        if stored is not None and not overwrite:
            raise ConfigError(
                f"{self._where()} holds a tokenizer (hash {stored.get('tokenizer')}), which runs may have "
                "trained with and are checked against; pass --overwrite to replace it, or give another name"
            )

    def _own_files(self) -> set[str]:
        prefix = f"{self.name}/"
        return {n for n in self.store.names(prefix) if "/" not in n[len(prefix) :]}

    def pull(self, local: Path) -> Path:
        """This machine's copy of the tokenizer, in ``local`` (files already there and intact kept), each
        file checked against the marker.

        Raises:
            ConfigError: no tokenizer is stored under the name, or ``local`` cannot be written.
            CheckpointError: a stored file is damaged, or not the one the marker names (replaced while
                it was read).
        """
        try:
            return self._pull(local)
        except OSError as exc:
            raise ConfigError(
                f"{self.location}: cannot keep a copy of it in {local} ({exc.strerror})"
            ) from None

    def _pull(self, local: Path) -> Path:
        local.mkdir(parents=True, exist_ok=True)
        marker = self.marker(local / f".{os.getpid()}.marker")
        if marker is None:
            raise ConfigError(
                f"{self._where()}: no tokenizer stored there; store one with `dsgpt2 vocab train --out "
                f"{self.location}` or `dsgpt2 vocab push DIR --out {self.location}` (with --config)"
            )
        fetched = 0
        for name, want in marker["files"].items():
            # File by file: another process of this machine may be fetching the same tokenizer here.
            if (local / name).is_file() and file_sha256(local / name) == want:
                continue
            got = self.store.get(f"{self.name}/{name}", local / name)
            if got != want:
                raise CheckpointError(
                    f"{self.location}: {name} is not the file its marker names (the tokenizer was replaced "
                    "while it was read); run the command again"
                )
            fetched += 1
        if fetched:
            log.info("downloaded the tokenizer %s (hash %s) to %s", self.location, marker["tokenizer"], local)
        return local


def fetch_tokenizer(location: str | Path, conn: Connection, root: Path) -> Path:
    """A tokenizer directory for ``location``: itself, or for ``gridfs:NAME`` this machine's copy under
    ``root`` of the tokenizer stored in ``conn``'s database."""
    name = stored_tokenizer(location)
    if name is None:
        return Path(location)
    return StoredTokenizer(conn, name).pull(root / COPIES / conn.config.db / name)


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
