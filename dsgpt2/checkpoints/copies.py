"""This machine's copy of a run's checkpoints where its store keeps copies (:mod:`dsgpt2.stores`): the
index (``latest``, ``best``, the markers) made the store's, the files of the checkpoint a reader or a
resume takes brought and checked, what is no longer stored dropped; :func:`readable` gives every reader
(export, evaluate, generate, lineage...) a directory to read, whatever the location."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from dsgpt2.checkpoints.format import BEST, CHECKPOINTS, COMPLETE, LATEST, UNIVERSAL, peek_tag, saved_at
from dsgpt2.errors import CheckpointError, ConfigError
from dsgpt2.files import file_digests
from dsgpt2.stores.base import STORES, Store, offered, open_store, split_location, where

log = logging.getLogger(__name__)

POINTERS = (LATEST, BEST)
_RANK_FILE = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


def own_files(directory: Path, rank: int) -> list[str]:
    """The files of a saved checkpoint directory that rank ``rank`` wrote (its ZeRO shards; rank 0 also
    every file of no rank: the model states, dsgpt2's own files), the marker and hidden files (the ranks'
    manifests) excepted."""
    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != COMPLETE):
        if path.name.startswith("."):
            continue
        m = _RANK_FILE.search(path.name)
        if (int(m.group(1)) if m else 0) == rank:
            out.append(str(path.relative_to(directory)))
    return out


def pull_index(store: Store) -> None:
    """Make the copy's pointers and markers the store's: a marker or pointer only here (a save that did
    not finish being kept) is removed."""
    if not store.staged:
        return
    store.local.mkdir(parents=True, exist_ok=True)
    kept = store.tags()
    for path in store.local.glob(f"*/{COMPLETE}"):
        if path.parent.name not in kept:
            path.unlink()
    for tag, marker in kept.items():
        (store.local / tag).mkdir(exist_ok=True)
        (store.local / tag / COMPLETE).write_text(json.dumps(marker, indent=1) + "\n")
    for pointer in POINTERS:
        text = store.read(pointer)
        if text is None:
            (store.local / pointer).unlink(missing_ok=True)
        else:
            (store.local / pointer).write_text(text)


def pull(store: Store, tag: str) -> None:
    """Bring the files of the whole tag ``tag`` that the copy lacks, each checked against its SHA-256
    (the index first: :func:`pull_index`).

    Raises:
        CheckpointError: ``tag`` is not whole there, or a file of it is damaged.
    """
    if not store.staged:
        return
    try:
        marker = json.loads((store.local / tag / COMPLETE).read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{store.location}: no complete checkpoint {tag}") from None
    present = file_digests(store.local / tag)
    fetched = 0
    for name, want in (marker.get("files") or {}).items():
        if present.get(name) != want:
            store.get(tag, name)
            fetched += 1
    if fetched:
        log.info("downloaded %d file(s) of %s to %s", fetched, where(store, tag), store.local / tag)


def pull_resumable(store: Store, ckpt_id: str | None) -> None:
    """The index, and the files of the checkpoint a resume would take (``ckpt_id``, else the one
    ``latest`` names), so that it is verified and loaded as on a disk."""
    if not store.staged:
        return
    pull_index(store)
    tag = peek_tag(store.local, ckpt_id)
    if tag is None:
        return
    try:
        pull(store, tag)
    except CheckpointError as exc:
        kept = store.tags()
        others = sorted(
            (t for t in kept if t != tag and not t.endswith(UNIVERSAL)), key=lambda t: saved_at(kept[t])
        )
        advice = f"; resume another with --ckpt_id {others[-1]}" if others else ""
        raise CheckpointError(f"{exc}{advice}") from None


def drop_local_extras(store: Store) -> list[str]:
    """Remove the copy's checkpoints that are not kept (pruned by ``--keep_last``, or saves that never
    finished being kept): on a node other than rank 0's nothing else prunes them. Returns their tags."""
    if not store.staged:
        return []
    kept = set(store.tags())
    extra = [p for p in store.local.glob("global_step*") if p.is_dir() and p.name not in kept]
    for path in extra:
        shutil.rmtree(path, ignore_errors=True)
    return sorted(p.name for p in extra)


def resumable_tag(store: Store, ckpt_id: str | None) -> str | None:
    """The tag a resume would take, read from the store before anything is brought: ``ckpt_id``, else the
    one the pointer names, or the newest whole one where it names none that is."""
    tag = ckpt_id or LATEST
    if tag not in POINTERS:
        return tag
    named = (store.read(tag) or "").strip()
    kept = {t: m for t, m in store.tags().items() if not t.endswith(UNIVERSAL)}
    if named not in kept and ckpt_id is None and kept:
        return max(kept, key=lambda t: saved_at(kept[t]))
    return named or None


def readable(
    location: str | Path, ckpt_id: str | None, config: str | None, flag: str, config_flag: str = "--config"
) -> Path:
    """A checkpoint directory to read ``location``'s checkpoint from: ``location`` itself, or this
    machine's copy of the index and of the checkpoint ``ckpt_id`` (else the one ``latest`` names) of a
    stored run, reached through the connection config ``config`` (the command's ``config_flag``) where
    its kind needs one.

    Raises:
        ConfigError: a stored location of a kind that needs a connection, without one.
        CheckpointError: no such stored checkpoint, or a damaged file of it.
    """
    kind = split_location(location, CHECKPOINTS)
    if kind is None:
        return Path(location)
    conn = None
    if STORES[kind[0]].needs_connection:
        if not config:
            raise ConfigError(
                f"{flag} {location}: checkpoints in the database are read through its connection config; "
                f"add {config_flag} c.json (the one the run trained with)"
            )
        from dsgpt2.db.client import connect
        from dsgpt2.db.config import load_config

        conn = connect(load_config(config), create=False)
    store = open_store(
        location, CHECKPOINTS, conn=conn
    )  # the copy: where every earlier version's reader kept it
    pull_resumable(store, ckpt_id)
    if not any(store.local.glob(f"*/{COMPLETE}")):
        shown = f" in {conn.config.display_uri} ({conn.config.db})" if conn is not None else ""
        raise CheckpointError(
            f"{location}: no checkpoint stored there{shown}{offered(store, LATEST, 'runs')}"
        )
    return store.local


def last_whole_in(location: str | Path) -> str | None:
    """The newest whole checkpoint of the directory ``location``, as a user names it; None where there is
    none, or where the location keeps copies (not read without its connection)."""
    from dsgpt2.checkpoints.format import by_saving

    if split_location(location, CHECKPOINTS) is not None:
        return None
    tags = by_saving(Path(location))
    return f"{location}/{tags[-1]}" if tags else None
