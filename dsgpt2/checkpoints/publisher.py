"""Saving a run's checkpoints into its store (:mod:`dsgpt2.stores`), decided once for every kind
of location: a checkpoint is marked whole once every rank's files are kept, then ``latest`` (and
``best``) move, then ``--keep_last`` prunes.

Where the store keeps copies (``gridfs:``, a plugin's kind: ``staged``), a save leaves the training
step once its tensors are copied (DeepSpeed's checkpoint engine made one that queues its writes:
:class:`~dsgpt2.checkpoints.ds_checkpoint.QueuedWrites`); a thread of each rank then waits for its files
to be written into this node's copy, keeps them (an upload) and writes a manifest of them
(``TAG/.rankN.json``). Rank 0's thread waits for every rank's manifest, marks the checkpoint whole with
them all, and only then moves ``latest``. The next save, and the end of the run, wait for the last one
first (on every rank, so that a save that failed stops every rank at once), and each node's copy then
keeps only what is stored. The threads take no collective: the ranks agree through the store.

In a directory the files written are the checkpoint: the step waits for the save, and rank 0 marks it
whole once every rank has written (agreed by barriers), so that a run killed right after a save resumes
from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints import ds_checkpoint
from dsgpt2.checkpoints.copies import drop_local_extras, own_files, pull, pull_index, pull_resumable
from dsgpt2.checkpoints.format import (
    BEST,
    CHECKPOINTS,
    LATEST,
    UNIVERSAL,
    damage,
    file_digests,
    read_marker,
    sealed,
    tag_for,
)
from dsgpt2.collective import barrier, gather, on_each_node, on_rank0, raise_shared
from dsgpt2.errors import CheckpointError, ConfigError, DsGpt2Error, NoRoomError
from dsgpt2.files import out_of_room
from dsgpt2.stores.base import Store, split_location, where

log = logging.getLogger("dsgpt2.checkpoints.checkpointer")

_POLL_S = 0.2
_FAILED = ".failed"  # in a rank's manifest: its save failed, and why
_CHECKPOINT = re.compile(r"global_step(\d+)")  # a checkpoint's tag (tag_for)


def merged_marker(step: int, at: float, manifests: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The marker of a checkpoint whose ranks kept the files of ``manifests`` (one listing each)."""
    files: dict[str, dict[str, Any]] = {}
    for listing in manifests:
        files.update(listing)
    return sealed({"step": step, "time": at, "files": dict(sorted(files.items()))})


class Publisher:
    """Saves one run's checkpoints into ``store`` (see the module's doc).

    Args:
        keep_last: how many of the run's checkpoints stay (0: all).
        rank, world: this rank and the number of ranks.
        wait_s: how long rank 0 waits for the other ranks' files of a save (the run's ``--dist_timeout``).
        background: saves are kept by a thread while training goes on, the ranks agreeing through the
            store (default: where the store keeps copies); else the step waits, the ranks agreeing by
            barriers.
    """

    def __init__(
        self,
        store: Store,
        keep_last: int,
        *,
        rank: int,
        world: int,
        wait_s: float,
        background: bool | None = None,
    ) -> None:
        self.store, self.keep_last = store, keep_last
        self.rank, self.world, self.wait_s = rank, world, wait_s
        self.background = store.staged if background is None else background
        self.published: str | None = None  # the latest as this run last saw it
        self._thread: threading.Thread | None = None
        self._error: tuple[str, str] | None = None
        # A save marked best while it is being kept: `best` is pointed at it once it is whole.
        self._lock = threading.Lock()
        self._pending: str | None = None
        self._best: str | None = None
        # A resume from an earlier checkpoint than `latest`: the later ones, of the run it left (rank 0).
        self._left: set[str] = set()

    def fetch(self, found: tuple[Path, str, dict[str, Any]] | None) -> None:
        """After the checkpoint to resume was found: a universal form rank 0 converted it to is kept for
        the other nodes and brought by them (the checkpoint itself every node has)."""

        def read() -> tuple[str | None, set[str]]:
            published = _pointer(self.store, LATEST)
            return published, self._left_behind(found, published)

        self.published, left = on_rank0(read)
        if self.rank == 0:
            self._left = set(left)
        if found is None or not found[1].endswith(UNIVERSAL) or not self.store.staged:
            return
        tag, store = found[1], self.store
        if self.rank == 0 and tag not in store.tags():
            files = store.put(tag, own_files(store.local / tag, 0))
            store.complete(tag, sealed({**(read_marker(store.local, tag) or {}), "files": files}))
        barrier()
        on_each_node(lambda: (pull_index(store), pull(store, tag)))

    def _left_behind(self, found: tuple[Path, str, dict[str, Any]] | None, published: str | None) -> set[str]:
        """The checkpoints of a run this one rewound: past the one it resumes, saved by another run. Each
        is replaced when this run gets to its step, and none counts for ``--keep_last``.

        Resumed from another checkpoint than the one ``latest`` names (``--ckpt_id`` an earlier one,
        ``best``, another ``--load_dir``), every later one is; resumed from ``latest``, the later ones saved
        before it (left by a rewind earlier in this run's life). A later one saved after it is this run's
        own, whole just before a stop that left ``latest`` unmoved, and is kept."""
        if found is None:
            return set()
        tag = found[1].removesuffix(UNIVERSAL)
        marker = read_marker(found[0], tag) or read_marker(found[0], found[1]) or {}
        start, at = marker.get("step", _step(tag)), marker.get("time")
        rewound = found[0] != self.store.local or tag != published
        kept = self.store.tags()
        later = sorted(
            (t for t, m in kept.items() if _CHECKPOINT.fullmatch(t) and m.get("step", -1) > start
             and (rewound or _saved_before(m, at))),
            key=lambda t: kept[t].get("step", -1),
        )  # fmt: skip
        if later:
            log.warning(
                "resuming %s: the later %s, of a run that went on from an earlier step, %s replaced as "
                "this run reaches %s step and %s not count for --keep_last",
                where(self.store, tag), ", ".join(later), *(("is", "its", "does") if len(later) == 1 else
                                                           ("are", "their", "do")),
            )  # fmt: skip
        return set(later)

    def save(self, engine: Any, step: int, client_state: dict[str, Any], files: dict[str, str]) -> str:
        """Save ``engine`` at ``step`` (``files``: text files beside its states, covered by the marker);
        returns its tag. In the background, the step waits while the tensors are copied, the files are
        written and kept meanwhile, and :meth:`settle` waits for them; else the save is whole when this
        returns."""
        self.settle()  # the last save is whole before this one's files are written
        tag = tag_for(step)
        if self.holds(tag):  # saved at this step already (an improvement, then the end)
            log.info("%s is already saved and intact; kept as it is", where(self.store, tag))
            if self.rank == 0 and self.published != tag:
                # Whole, but `latest` was never moved to it (a run stopped between the two): now it is.
                self.store.write(LATEST, tag)
                self.published = tag
            return tag
        writes = ds_checkpoint.QueuedWrites.install(engine) if self.background else None
        try:
            ds_checkpoint.write(engine, self.store.local, tag, client_state, files)
        except Exception as exc:
            if (full := self._no_room(tag, exc)) is None:
                raise
            raise full from None
        if self.background:
            self._pending = tag
            wait = writes.wait if writes is not None else (lambda: None)
            self._thread = threading.Thread(target=self._keep, args=(tag, step, wait), name=f"save {tag}")
            self._thread.start()
            log.info("saving checkpoint %s: writing %s while training goes on", where(self.store, tag),
                     self.store.local / tag)  # fmt: skip
            return tag
        barrier()  # every rank's files are written

        def publish() -> None:
            try:
                self._publish(tag, merged_marker(step, time.time(), [file_digests(self.store.local / tag)]))
            except OSError as exc:  # the disk: every rank stops with it, none waits out --dist_timeout
                raise self._no_room(tag, exc) or CheckpointError(
                    f"saving {where(self.store, tag)} failed: {exc}"
                ) from None

        on_rank0(publish)
        return tag

    def settle(self) -> None:
        """Wait for the last save (every rank: a collective); raise on every rank what failed in any.
        Then, before the next save writes, check that no other run saved here meanwhile."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        errors = gather(self._error)
        self._error = None
        raise_shared(next((e for e in errors if e is not None), None))
        on_rank0(self._check_sole_writer)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # this node's copy keeps what is stored, no more
            drop_local_extras(self.store)

    def holds(self, tag: str) -> bool:
        """Whether ``tag`` is whole and intact in the store (every rank: a collective); where it is not,
        what an attempt that died left of it is deleted first."""

        def held() -> bool:
            if tag in self._left:
                self._left.discard(tag)
                log.info("replacing %s, a step of the run this one rewound", where(self.store, tag))
            elif tag in self.store.tags() and (self.store.staged or damage(self.store.local, tag) is None):
                return True
            for name in (tag, tag + UNIVERSAL):  # a universal form goes with its own
                self.store.delete(name)
            return False

        if on_rank0(held):
            return True
        if self.store.staged:  # every node's copy of it (another node's holds its marker, pulled before)
            on_each_node(lambda: [shutil.rmtree(self.store.local / n, ignore_errors=True)
                                  for n in (tag, tag + UNIVERSAL)])  # fmt: skip
        return False

    def mark_best(self, tag: str) -> None:
        """Point ``best`` at ``tag`` once it is whole (rank 0): now, or by the save still being kept,
        without waiting for it."""
        with self._lock:
            if self._pending == tag:
                self._best = tag
                return
        try:
            self.store.write(BEST, tag)
        except OSError as exc:  # the disk, as a save's
            raise self._no_room(tag, exc) or CheckpointError(
                f"marking {where(self.store, tag)} best failed: {exc}"
            ) from None

    def _keep(self, tag: str, step: int, written: Callable[[], None]) -> None:
        store = self.store
        try:
            written()
            mine = store.put(tag, own_files(store.local / tag, self.rank))
            store.write(self._manifest(tag, self.rank), json.dumps(mine))
            if self.rank == 0:
                self._publish(tag, merged_marker(step, time.time(), self._manifests(tag)))
        except DsGpt2Error as exc:
            self._error = (type(exc).__name__, str(exc))
        except Exception as exc:  # a bug, or the disk: every rank stops
            if (full := self._no_room(tag, exc)) is not None:
                self._error = (type(full).__name__, str(full))
            else:  # its traceback in the log
                log.exception("saving %s failed", where(store, tag))
                self._error = ("CheckpointError", f"saving {where(store, tag)} failed: {exc}")
        if self._error is not None and self.rank != 0:
            # Rank 0 waits for this rank's manifest: told at once that none is coming, and why.
            with contextlib.suppress(Exception):
                store.write(self._manifest(tag, self.rank), json.dumps({_FAILED: self._error[1]}))

    def _no_room(self, tag: str, exc: BaseException) -> NoRoomError | None:
        """The error to raise where saving ``tag`` failed on a full disk; None where the disk is not full."""
        room = out_of_room(self.store.local, exc)
        if room is None:
            return None
        attempt = self.store.local / tag
        if read_marker(self.store.local, tag) is None and attempt.is_dir():  # never marked whole
            for name in own_files(attempt, self.rank):  # this rank's: the others' are theirs to give back
                (attempt / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the last rank out takes the directory
                attempt.rmdir()
        kept = "no checkpoint of this run is whole yet"
        if self.published:
            kept = f"the last whole checkpoint, {where(self.store, self.published)}, is kept"
        return NoRoomError(
            f"saving {where(self.store, tag)} failed: {room}; {kept}: free space there (or keep fewer with "
            "--keep_last) and run the same command to resume"
        )

    @staticmethod
    def _manifest(tag: str, rank: int) -> str:
        return f"{tag}/.rank{rank}.json"

    def _publish(self, tag: str, marker: dict[str, Any]) -> None:
        """Mark ``tag`` whole, move ``latest`` (and ``best``, marked meanwhile), prune (rank 0)."""
        store = self.store
        store.complete(tag, marker)
        store.write(LATEST, tag)
        self.published = tag
        with self._lock:
            self._pending, best, self._best = None, self._best, None
        if best is not None:
            store.write(BEST, best)
        if store.staged:  # this node's copy marked as the stored one is (pull() brings the other ranks')
            ds_checkpoint.complete(store.local, tag, marker)
        self._prune(tag)
        log.info("%s checkpoint %s", "stored" if store.staged else "saved", where(store, tag))

    def _manifests(self, tag: str) -> list[dict[str, Any]]:
        """Every rank's manifest of its files of ``tag``, waited for up to ``wait_s``."""
        names = [self._manifest(tag, r) for r in range(self.world)]
        deadline = time.monotonic() + self.wait_s
        while True:
            texts = [self.store.read(n) for n in names]
            if all(t is not None for t in texts):
                manifests = [json.loads(t) for t in texts]  # type: ignore[arg-type]
                failed = [(r, m[_FAILED]) for r, m in enumerate(manifests) if _FAILED in m]
                if failed:
                    rank, why = failed[0]
                    raise CheckpointError(f"rank {rank} could not save {where(self.store, tag)}: {why}")
                return manifests
            if time.monotonic() > deadline:
                missing = [r for r, t in enumerate(texts) if t is None]
                raise CheckpointError(
                    f"{where(self.store, tag)}: rank(s) {missing} did not keep their files within "
                    f"{self.wait_s:.0f}s; latest stays {self.published or 'unset'}"
                )
            time.sleep(_POLL_S)

    def _check_sole_writer(self) -> None:
        """Refuse to save where another run saved since this one started (``latest`` is not the one this
        run last saw): two runs sharing a location would write over each other's files."""
        now = _pointer(self.store, LATEST)
        if now != self.published:
            raise CheckpointError(
                f"another run saved {where(self.store, now or '')} since this one started (it saw "
                f"{self.published or 'no checkpoint'}): two runs cannot share a location; give this run "
                "its own --ckpt_dir"
            )

    def _prune(self, saved: str) -> None:
        """Drop what ``--keep_last`` leaves behind, and the saves before this one that never finished (one
        after it, left by a run that died past its resume point, is replaced when the run gets there)."""
        store = self.store
        # A form goes with its own; the run a rewind left is not this one.
        ours = {t: m for t, m in store.tags().items() if not t.endswith(UNIVERSAL) and t not in self._left}
        tags = sorted(ours, key=lambda t: ours[t].get("step", 0))
        best = _pointer(store, BEST)
        if best in self._left:  # the rewound run's finding, not this one's
            store.write(BEST, "")
            best = None
        old = tags[: -self.keep_last] if self.keep_last > 0 else []
        # Only a checkpoint's own folder: the location may hold others (a tokenizer, a nested run's).
        died = [t for t in store.started() if _CHECKPOINT.fullmatch(t) and _step(t) < _step(saved)]
        for tag in [*old, *died]:
            if tag not in (saved, best):
                store.delete(tag)
                store.delete(tag + UNIVERSAL)
                if tag in old:
                    log.info("removed old checkpoint %s (keeping the last %d)", tag, self.keep_last)


def _step(tag: str) -> int:
    found = _CHECKPOINT.fullmatch(tag.split(".")[0])
    return int(found.group(1)) if found else -1


def _saved_before(marker: dict[str, Any], at: Any) -> bool:
    """Whether the checkpoint of ``marker`` was marked whole before the time ``at`` (False where either
    time is unknown)."""
    when = marker.get("time")
    return isinstance(when, (int, float)) and isinstance(at, (int, float)) and when < at


def _pointer(store: Store, name: str) -> str | None:
    text = store.read(name)
    tag = (text or "").strip()
    return tag or None


def stage(ckpt: Any, store: Store, *, rank: int, world: int, wait_s: float) -> Publisher:
    """The publisher of the run whose ``--ckpt_dir`` is ``store`` (``ckpt``: its checkpoint options), the
    checkpoint a resume would take brought to each node's copy by the node's first rank where the store
    keeps copies. ``wait_s``: how long rank 0 waits for the other ranks' files of a save (the run's
    ``--dist_timeout``).

    Raises:
        ConfigError: a ``--load_dir`` that is not ``--ckpt_dir`` where either is kept in a store with
            copies (a run resumes from such a store only where it saves).
    """
    loading = split_location(ckpt.load_dir, CHECKPOINTS)
    if (
        ckpt.load_dir is not None
        and (loading is not None or store.staged)
        and loading != split_location(ckpt.ckpt_dir, CHECKPOINTS)
    ):
        raise ConfigError(
            f"--load_dir {ckpt.load_dir} with --ckpt_dir {ckpt.ckpt_dir}: a run resumes from a stored "
            "location only where it saves, and saves only where it resumes from one: leave out --load_dir "
            "(--ckpt_id picks a checkpoint of --ckpt_dir), or name the stored location as --ckpt_dir"
        )
    if not store.staged and world > 1:
        check_shared(store.local, rank)
    on_each_node(lambda: pull_resumable(store, ckpt.ckpt_id))
    return Publisher(store, ckpt.keep_last, rank=rank, world=world, wait_s=wait_s)


def check_shared(directory: Path, rank: int) -> None:
    """Refuse a checkpoint directory that the ranks do not share (each node naming its own disk): rank 0
    would mark a checkpoint whole with the files it sees, its own, while the other nodes' shards lie on
    their disks, and no node could resume it. Found out as the token cache's sharing is: rank 0 leaves a
    file named for this call there and every rank looks it up by name (every rank: a collective).

    Raises:
        ConfigError: naming the ranks that do not see rank 0's file, and the two ways out.
    """
    probe = directory / f".ranks-{on_rank0(lambda: uuid.uuid4().hex)}"
    made = False
    if rank == 0:
        try:
            made = not directory.exists()
            directory.mkdir(parents=True, exist_ok=True)
            probe.touch()
        except OSError:
            made = False  # an unwritable --ckpt_dir is said where the run first writes there
    barrier()  # the file is there before any rank looks
    seen = gather(probe.exists())
    if rank == 0:
        probe.unlink(missing_ok=True)
        if made:
            with contextlib.suppress(OSError):
                directory.rmdir()
    blind = [str(r) for r, s in enumerate(seen) if not s]
    if seen[0] and blind:
        raise ConfigError(
            f"--ckpt_dir {directory} is not shared by every node: rank(s) {', '.join(blind)} do not see the "
            "files rank 0 writes there, and a checkpoint is whole only where every rank's files are; name a "
            "directory every node sees (a shared file system), or keep the checkpoints in the database "
            "(--ckpt_dir gridfs:RUN)"
        )
