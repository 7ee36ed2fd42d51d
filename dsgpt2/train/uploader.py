"""A run's checkpoints in the database (``--ckpt_dir gridfs:RUN``, :mod:`dsgpt2.checkpoints.stored`): the
staging directory put in the checkpoint directory's place, the checkpoint to resume downloaded by every
node, and each save uploaded while training goes on.

A save leaves the training step once the tensors are copied (DeepSpeed's checkpoint engine made one
that queues its writes: :class:`dsgpt2.train.ds_checkpoint.QueuedWrites`); a thread of each rank then
waits for its files to be written into this node's staging copy, uploads them and stores a manifest of
them (``.rankN.json``). Rank 0's thread waits for every rank's manifest, stores the complete marker of
them all, and only then moves the stored ``latest``. The next save, and the end of the run, wait for
the last upload first (on every rank, so that an upload that failed stops every rank at once), and each
node's copy then keeps only what is stored. The threads take no collective: the ranks agree through
the database.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsgpt2.checkpoints.format import BEST, UNIVERSAL, best_tag, read_marker
from dsgpt2.checkpoints.stored import StoredCheckpoints, merged_marker, own_files, staging_dir, stored_run
from dsgpt2.errors import CheckpointError, ConfigError, DsGpt2Error
from dsgpt2.train.collective import barrier, gather, on_each_node, on_rank0, raise_shared
from dsgpt2.train.config import CheckpointOptions
from dsgpt2.train.ds_checkpoint import complete

log = logging.getLogger("dsgpt2.train.checkpointer")

_POLL_S = 0.2


def stage(
    ckpt: CheckpointOptions, workspace: Path, conn: Any, *, rank: int, world: int, wait_s: float
) -> Uploader | None:
    """Where ``--ckpt_dir`` (or ``--load_dir``) is ``gridfs:RUN``: the run's uploader, this node's staging
    directory put in the options' place, and the checkpoint a resume would take downloaded by the first
    rank of each node. None for a directory.

    ``wait_s``: how long rank 0 waits for the other ranks' uploads of a save (the run's
    ``--dist_timeout``)."""
    run = stored_run(ckpt.ckpt_dir)
    loading = stored_run(ckpt.load_dir)
    if run is None and loading is None:
        return None
    if loading is not None and loading != run:
        raise ConfigError(
            f"--load_dir {ckpt.load_dir} with --ckpt_dir {ckpt.ckpt_dir}: a run resumes from the database "
            "where it saves there; pass --ckpt_dir gridfs:RUN (and --ckpt_id to pick a checkpoint)"
        )
    assert run is not None
    stored = StoredCheckpoints(conn, run, staging_dir(workspace, run))
    ckpt.ckpt_dir = stored.local
    if ckpt.load_dir is not None:
        ckpt.load_dir = stored.local
    on_each_node(lambda: stored.pull_resumable(ckpt.ckpt_id))
    return Uploader(stored, ckpt.keep_last, rank=rank, world=world, wait_s=wait_s)


class Uploader:
    """Uploads one run's saves (see the module's doc)."""

    def __init__(self, stored: StoredCheckpoints, keep_last: int, *, rank: int, world: int, wait_s: float):
        self.stored, self.keep_last = stored, keep_last
        self.rank, self.world, self.wait_s = rank, world, wait_s
        self.published: str | None = None  # the stored latest as this run last saw it
        self._thread: threading.Thread | None = None
        self._error: tuple[str, str] | None = None
        # A save marked best while its upload runs: the upload points the stored `best` once it is stored.
        self._lock = threading.Lock()
        self._uploading: str | None = None
        self._best: str | None = None

    @property
    def location(self) -> str:
        return self.stored.location

    def fetch(self, found: tuple[Path, str, dict[str, Any]] | None) -> None:
        """After the checkpoint to resume was found: a universal form rank 0 converted it to is stored for
        the other nodes and downloaded by them (the checkpoint itself every node has: :func:`stage`)."""
        self.published = on_rank0(self.stored.latest)
        if found is None or not found[1].endswith(UNIVERSAL):
            return
        tag, stored = found[1], self.stored
        if self.rank == 0 and tag not in stored.tags():
            files = stored.push(tag, own_files(stored.local / tag, 0))
            stored.publish(tag, {**(read_marker(stored.local, tag) or {}), "files": files}, latest=False)
        barrier()
        on_each_node(lambda: (stored.pull_index(), stored.pull(tag)))

    def upload(self, tag: str, step: int, written: Callable[[], None]) -> None:
        """Upload the save ``tag`` in a thread, once ``written()`` says this rank's files of it are written
        (its files; on rank 0 then the marker and ``latest``, stored and here); :meth:`settle` waits for
        it."""
        self._uploading = tag
        self._thread = threading.Thread(target=self._upload, args=(tag, step, written), name=f"upload {tag}")
        self._thread.start()
        log.info("saving checkpoint %s: writing %s and uploading it while training goes on", self.location,
                 self.stored.local / tag)  # fmt: skip

    def settle(self) -> None:
        """Wait for the last upload (every rank: a collective); raise on every rank what failed in any.
        Then, before the next save writes, check that no other run saved here meanwhile."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        errors = gather(self._error)
        self._error = None
        raise_shared(next((e for e in errors if e is not None), None))
        on_rank0(self._check_sole_writer)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # this node's copy keeps what is stored, no more
            self.stored.drop_local_extras()

    def holds(self, tag: str) -> bool:
        """Whether ``tag`` is stored complete (every rank: a collective); where it is not, what an attempt
        that died left of it (its manifests above all) is deleted first."""

        def held() -> bool:
            if tag in self.stored.tags():
                return True
            self.stored.drop(tag)
            return False

        return bool(on_rank0(held))

    def mark_best(self, tag: str) -> None:
        """Point the stored ``best`` at ``tag`` once its upload is stored (rank 0): now, or by the upload
        still running, without waiting for it."""
        with self._lock:
            if self._uploading == tag:
                self._best = tag
                return
        self.stored.point(BEST, tag)

    def _upload(self, tag: str, step: int, written: Callable[[], None]) -> None:
        stored = self.stored
        try:
            written()
            mine = stored.push(tag, own_files(stored.local / tag, self.rank))
            stored.store_json(f"{tag}/.rank{self.rank}.json", mine)
            if self.rank != 0:
                return
            marker = merged_marker(step, time.time(), self._manifests(tag))
            stored.publish(tag, marker)
            self.published = tag
            with self._lock:
                self._uploading, best, self._best = None, self._best, None
            if best is not None:
                stored.point(BEST, best)
            # This node's copy marked as the stored one is (every rank's files: pull() fetches the others').
            complete(stored.local, tag, marker, self.keep_last)
            self._prune(tag)
            log.info("stored checkpoint %s/%s", self.location, tag)
        except DsGpt2Error as exc:
            self._error = (type(exc).__name__, str(exc))
        except Exception as exc:  # a bug, or the disk: its traceback in the log, and every rank stops
            log.exception("uploading %s/%s failed", self.location, tag)
            self._error = ("CheckpointError", f"uploading {self.location}/{tag} failed: {exc}")

    def _manifests(self, tag: str) -> list[dict[str, Any]]:
        """Every rank's manifest of its uploads of ``tag``, waited for up to ``wait_s``."""
        names = [f"{tag}/.rank{r}.json" for r in range(self.world)]
        deadline = time.monotonic() + self.wait_s
        while True:
            texts = [self.stored.load_json(n) for n in names]
            if all(t is not None for t in texts):
                return texts  # type: ignore[return-value]
            if time.monotonic() > deadline:
                missing = [r for r, t in enumerate(texts) if t is None]
                raise CheckpointError(
                    f"{self.location}/{tag}: rank(s) {missing} did not store their files within "
                    f"{self.wait_s:.0f}s; the stored latest stays {self.published or 'unset'}"
                )
            time.sleep(_POLL_S)

    def _check_sole_writer(self) -> None:
        """Refuse to save where another run saved since this one started (the stored ``latest`` is not
        the one this run last saw): two runs sharing a location would write over each other's files."""
        now = self.stored.latest()
        if now != self.published:
            raise CheckpointError(
                f"another run saved {self.location}/{now} since this one started (it saw "
                f"{self.published or 'no checkpoint'}): two runs cannot share a location; give this run "
                "its own --ckpt_dir gridfs:RUN"
            )

    def _prune(self, saved: str) -> None:
        """Drop what ``--keep_last`` leaves behind, and saves that never finished their upload."""
        stored = self.stored
        ours = {
            t: m for t, m in stored.tags().items() if not t.endswith(UNIVERSAL)
        }  # a form goes with its own
        tags = sorted(ours, key=lambda t: ours[t].get("step", 0))
        best = best_tag(stored.local)
        old = tags[: -self.keep_last] if self.keep_last > 0 else []
        for tag in [*old, *stored.unfinished()]:
            if tag not in (saved, best):
                stored.drop(tag)
                stored.drop(tag + UNIVERSAL)
