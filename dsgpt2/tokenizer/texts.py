"""The vocabulary: export a text corpus from MongoDB to shards, train a byte-level BPE on it.

``download`` cuts the unified index into contiguous shards and writes each in
a worker process with its own MongoDB client, reading ranges in batches. A
shard is written to a temporary file and renamed when complete, and
``manifest.json`` records the finished ones, so a re-run redoes only what
was not finished. ``train`` streams texts from the shards or straight from
MongoDB into ``ByteLevelBPETokenizer.train_from_iterator``: nothing holds
the whole corpus in memory.

Special tokens take the first ids, in a fixed order, whatever the corpus:
``<|endoftext|>`` 0, ``<|pad|>`` 1, one ``<|SPEAKER|>`` per conversation
speaker, then ``<unused0>``... reserved for later use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from dsgpt2.corpus.draws import select
from dsgpt2.db.client import require_collections
from dsgpt2.db.config import MongoConfig
from dsgpt2.db.wrapper import MongoWrapper, require_nonempty
from dsgpt2.documents import SkipTally, text_problem, utf8_length
from dsgpt2.errors import (
    ConfigError,
    DiskFullError,
    DsGpt2Error,
    MongoUnavailableError,
    NoRoomError,
    ServerLostError,
    first_line,
)
from dsgpt2.files import (
    atomic_write_text,
    atomic_writer,
    check_room,
    check_writable_dir,
    not_a_directory,
    out_of_room,
)
from dsgpt2.progress import progress as progress_display
from dsgpt2.ranges import even_ranges
from dsgpt2.settings.options import NON_NEGATIVE_INT, POSITIVE_INT, RATIO, Checked, option

log = logging.getLogger(__name__)
T = TypeVar("T")

MANIFEST = "manifest.json"
_SHARD_DOCS = 50_000


@dataclass(frozen=True)
class Draw(Checked):
    """Which documents a vocabulary corpus holds: every one, or a seeded sample, each field a flag."""

    # Checked on construction (a plain float flag): `--fraction must be in (0, 1]`.
    fraction: float | None = option(
        None, "draw this fraction of the documents, in (0, 1]", type=float, check=RATIO
    )
    count: int | None = option(None, "draw about this many documents", check=POSITIVE_INT)
    seed: int = option(0, "seed of the draw", check=NON_NEGATIVE_INT)

    def check(self) -> None:
        if self.fraction is not None and self.count is not None:
            raise ConfigError("give --fraction or --count, not both")

    @property
    def sampled(self) -> bool:
        return self.fraction is not None or self.count is not None

    def probability(self, total: int) -> float:
        """The per-document probability that draws ``fraction`` of, or about ``count`` of, ``total``."""
        if self.fraction is not None:
            return self.fraction
        if self.count is not None:
            return min(1.0, self.count / total) if total else 1.0
        return 1.0


@dataclass(frozen=True)
class DownloadSettings(Checked):
    """How ``vocab download`` splits and runs its work, each field a flag."""

    workers: int = option(2, "worker processes", check=POSITIVE_INT)
    shards: int | None = option(
        None, "number of shards (default: one per 50,000 documents)", check=POSITIVE_INT
    )
    chunk: int = option(1000, "documents per query", check=POSITIVE_INT)
    overwrite: bool = option(False, "replace shards of a different download in --out")


# ---------------------------------------------------------------- download


@dataclass
class DownloadReport:
    """What ``download`` wrote."""

    out: Path
    shards: int
    written: int = 0
    already_done: int = 0
    documents: int = 0
    bytes: int = 0
    skipped: SkipTally = field(default_factory=SkipTally)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return [
            f"{self.out}: {self.shards} shards "
            f"({self.written} written now, {self.already_done} already done)",
            f"documents: {self.documents}, {self.bytes / 1e6:.2f} MB, {self.skipped.summary()} "
            f"({self.seconds:.1f}s)",
        ]


# What a download directory holds: shards, their manifest, a killed worker's temporary shard (and the lock
# file older versions made).
_SHARD_FILE = re.compile(rf"shard-\d+\.jsonl|\.shard-.*|\.lock|{re.escape(MANIFEST)}")


def _shard_path(out: Path, k: int) -> Path:
    return out / f"shard-{k:05d}.jsonl"


def download(
    config: MongoConfig,
    out: Path,
    fraction: float | None = None,
    count: int | None = None,
    seed: int = 0,
    *,
    workers: int = 2,
    shards: int | None = None,
    chunk: int = 1000,
    overwrite: bool = False,
    progress: bool = True,
) -> DownloadReport:
    """Export the (sampled) corpus to ``out/shard-NNNNN.jsonl`` files, ``{"idx", "text"}`` per line.

    Raises:
        ConfigError: bad options, or ``out`` holds a different download and ``overwrite`` is off.
    """
    draw = Draw(fraction, count, seed)
    DownloadSettings(workers, shards, chunk, overwrite)
    _check_out_dir(out)
    started = time.monotonic()
    wrapper = MongoWrapper(config)
    require_collections(wrapper.connection)
    require_nonempty(wrapper)
    total = len(wrapper)
    p = draw.probability(total)
    ranges = even_ranges(0, total, shards or max(workers, -(-total // _SHARD_DOCS)))
    plan = {
        "db": config.db,
        "collections": list(config.collections),
        "counts": list(wrapper.counts),
        "text_field": config.text_field,
        **({"filter": config.filter} if config.filter else {}),
        "fraction": p,
        "seed": seed,
        "shards": [list(r) for r in ranges],
    }
    if out.is_dir():
        _check_foreign(out, _read_manifest(out))  # before the lock is taken
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot make the shard directory there ({exc.strerror})") from None
    with _exclusive(out), _told_full(out, made):
        # Nobody else writes here (we hold the lock): a temporary shard is a worker killed mid-write.
        for stale in out.glob(".shard-*"):
            stale.unlink(missing_ok=True)
        manifest = _read_manifest(out)
        _check_foreign(out, manifest)
        if manifest and manifest.get("plan") != plan:
            if not overwrite:
                raise ConfigError(
                    f"{out} holds shards of a different download (other collections, counts, FILTER, "
                    f"sample or shard layout); pass --overwrite to replace them, or choose another --out"
                )
            for old in out.glob("shard-*.jsonl"):
                old.unlink()
            manifest = None
        manifest = manifest or {"plan": plan, "done": {}}
        report = DownloadReport(out, len(ranges))
        pending = []
        for k, (start, stop) in enumerate(ranges):
            done = manifest["done"].get(str(k))
            if done and not shard_intact(_shard_path(out, k), done):
                log.warning("%s is missing, truncated or changed: writing it again", _shard_path(out, k))
                del manifest["done"][str(k)]
                done = None
            if done:
                report.already_done += 1
                report.documents += done["documents"]
                report.bytes += done["bytes"]
                report.skipped.update(done["skipped"])
            else:
                path = str(_shard_path(out, k))
                pending.append((config, wrapper.counts, k, start, stop, p, seed, path, chunk))
        bar = progress_display("vocab download", "doc", total=total, enabled=progress)
        bar.update(sum(stop - start for k, (start, stop) in enumerate(ranges) if str(k) in manifest["done"]))
        try:
            with contextlib.closing(_run(pending, workers)) as results:  # the pool ends with it
                for k, stats in results:
                    manifest["done"][str(k)] = stats
                    _write_json(out / MANIFEST, manifest)
                    report.written += 1
                    report.documents += stats["documents"]
                    report.bytes += stats["bytes"]
                    report.skipped.update(stats["skipped"])
                    bar.update(ranges[k][1] - ranges[k][0])
        except MongoUnavailableError as exc:
            if isinstance(exc, (ServerLostError, DiskFullError)):
                raise
            # The server answered when the download began: lost on the way (exit 3), not misnamed.
            raise ServerLostError(
                f"{exc}; {len(manifest['done'])} whole shard(s) kept: re-run the same command to resume"
            ) from None
        finally:
            bar.close()
        report.seconds = time.monotonic() - started
        return report


def _check_foreign(out: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse a directory that holds files of its own: nothing of them is ours to replace."""
    foreign = [p.name for p in out.iterdir() if not _SHARD_FILE.fullmatch(p.name)]
    if manifest is None and foreign:
        raise ConfigError(
            f"--out {out} holds files that are not a vocabulary download "
            f"({', '.join(sorted(foreign)[:3])}); give an empty or new directory"
        )


def _check_out_dir(out: Path) -> None:
    """Refuse, before any query, an ``--out`` that cannot hold the shards (a file, under one, or where
    nothing can be written, or its disk is full)."""
    check_writable_dir(out, "--out")
    check_room(out, "--out")


@contextlib.contextmanager
def _told_full(out: Path, made: bool) -> Iterator[None]:
    """A disk that fills during the download told in one line: the shards whole so far are kept (the
    manifest lists them), the temporary ones of the workers stopped are removed, and a directory this run
    made and filled with nothing goes too.

    Raises:
        NoRoomError: the disk filled.
    """
    try:
        yield
    except Exception as exc:
        room = None if isinstance(exc, DsGpt2Error) else out_of_room(out, exc)
        if room is None:
            raise
        for stale in out.glob(".shard-*"):  # the workers were stopped mid-write
            stale.unlink(missing_ok=True)
        done = len((_read_manifest(out) or {}).get("done", {}))
        if made and not any(out.iterdir()):
            out.rmdir()
        raise NoRoomError(
            f"--out {out}: the download stopped, {room}; {done} whole shard(s) kept: free space there and "
            "re-run the same command to resume"
        ) from None


def _run(tasks: list[tuple[Any, ...]], workers: int) -> Iterator[tuple[int, dict[str, Any]]]:
    if workers == 1 or len(tasks) <= 1:
        yield from map(_download_shard, tasks)
        return
    # Each worker makes its own client (Connection is fork-safe).
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(workers, len(tasks))) as pool:
        yield from pool.imap_unordered(_download_shard, tasks)


def _download_shard(task: tuple[Any, ...]) -> tuple[int, dict[str, Any]]:
    config, counts, k, start, stop, fraction, seed, path, chunk = task
    wrapper = MongoWrapper(config, counts=counts)
    documents = size = 0
    digest = hashlib.sha256()
    try:
        with atomic_writer(path, "wb", prefix=".shard-") as f:
            for lo in range(start, stop, chunk):
                hi = min(lo + chunk, stop)
                wanted = select(lo, hi, fraction, seed)
                docs = (
                    wrapper.get_range(lo, hi) if len(wanted) == hi - lo else wrapper.get_many(wanted.tolist())
                )
                for d in docs:
                    line = json.dumps({"idx": d.index, "text": d.text}, ensure_ascii=False) + "\n"
                    data = line.encode("utf-8")
                    f.write(data)
                    digest.update(data)
                    documents += 1
                    size += utf8_length(d.text)
    finally:
        wrapper.connection.close()
    stats = {"documents": documents, "bytes": size, "skipped": dict(wrapper.skipped)}
    return k, {**stats, "file_bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def shard_intact(path: Path, done: dict[str, Any]) -> bool:
    """Whether the shard at ``path`` is the one the manifest entry ``done`` recorded."""
    try:
        if path.stat().st_size != done.get("file_bytes"):
            return False
    except FileNotFoundError:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest() == done.get("sha256")


@contextlib.contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """Hold the download lock of ``out``, the directory itself (no file to leave behind): one download at
    a time writes a shard directory."""
    import fcntl

    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another `vocab download` is writing to {out}; wait for it to end") from None
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _load_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest of a download directory; None where it has none.

    Raises:
        ValueError: it is damaged (what is wrong with it).
    """
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(first_line(exc)) from None
    plan = manifest.get("plan") if isinstance(manifest, dict) else None
    if not (isinstance(plan, dict) and isinstance(plan.get("shards"), list)
            and isinstance(manifest.get("done"), dict)):  # fmt: skip
        raise ValueError("not the manifest `dsgpt2 vocab download` writes")
    return manifest


def _read_manifest(out: Path) -> dict[str, Any] | None:
    """The manifest a download goes on from; a damaged one, none (the download starts over)."""
    try:
        return _load_manifest(out)
    except ValueError as exc:
        log.warning("%s is damaged (%s); starting the download over", out / MANIFEST, exc)
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


# ---------------------------------------------------------------- texts


class TextStream:
    """Texts on their way to the trainer, counted (documents, bytes) and handed over in batches.

    The BPE trainer accepts lists of strings: one list per 1,000 texts costs
    the Python side one hand-over instead of a thousand.
    """

    def __init__(self, texts: Iterable[str], batch: int = 1000) -> None:
        self._texts = texts
        self._batch = batch
        self.documents = 0
        self.bytes = 0

    def __iter__(self) -> Iterator[list[str]]:
        buf: list[str] = []
        for text in self._texts:
            buf.append(text)
            if len(buf) >= self._batch:
                yield self._count(buf)
                buf = []
        if buf:
            yield self._count(buf)

    def _count(self, buf: list[str]) -> list[str]:
        self.documents += len(buf)
        self.bytes += sum(map(utf8_length, buf))
        return buf


def shard_texts(
    directory: Path, max_chars: int = 2_000_000, skipped: SkipTally | None = None
) -> Iterator[str]:
    """The texts of every shard in ``directory``, in shard order, one line at a time.

    Raises:
        ConfigError: ``directory`` is not one (a file, a named pipe) or holds no shard, the shards of an
            unfinished download, or one that is not what its download wrote (size and SHA-256 in the
            manifest), before any text is read.
    """
    why = not_a_directory(directory) if directory.exists() else None
    if why is not None:
        raise ConfigError(f"{directory}: {why}; give the shard directory `dsgpt2 vocab download` wrote")
    if not directory.exists():
        raise ConfigError(f"{directory}: not found; give the shard directory `dsgpt2 vocab download` wrote")
    files = sorted(directory.glob("shard-*.jsonl"))
    if not files:
        raise ConfigError(f"no shard-*.jsonl files in {directory}; run `dsgpt2 vocab download` first")
    _check_download(directory)
    skipped = SkipTally() if skipped is None else skipped
    for path in files:
        # Bytes that are not UTF-8 (shards written by another tool) come through as surrogates, and
        # the line is skipped as invalid text, as one from the database is.
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    skipped["bad_json"] += 1
                    continue
                reason = text_problem(text, max_chars)
                if reason:
                    skipped[reason] += 1
                    continue
                yield text


def _check_download(directory: Path) -> None:
    """Refuse shards of an unfinished download, or ones cut short, damaged or edited since (the sizes and
    SHA-256 the manifest records).

    Every shard is hashed here, before the first text goes to the trainer (a second sequential read, about
    as cheap as hashing the lines as they are parsed): a damaged shard is refused at once, not after the
    trainer has counted the words of the shards before it."""
    rerun = "re-run `dsgpt2 vocab download` with the same options to finish it"
    try:
        manifest = _load_manifest(directory)
    except ValueError as exc:
        raise ConfigError(
            f"{directory / MANIFEST} is damaged ({exc}): whether every shard is whole cannot be checked; "
            f"{rerun} (it starts over), or remove {MANIFEST} to train on the shards as they are"
        ) from None
    if manifest is None:
        return
    planned, done = len(manifest["plan"]["shards"]), manifest["done"]
    if len(done) < planned:
        raise ConfigError(f"{directory}: the download is unfinished ({len(done)}/{planned} shards); {rerun}")
    for k, entry in done.items():
        path = _shard_path(directory, int(k))
        size = path.stat().st_size if path.exists() else None
        if size != entry.get("file_bytes", size):
            raise ConfigError(f"{path} is missing or not the size the download wrote; {rerun}")
        if "sha256" in entry and not shard_intact(path, entry):
            raise ConfigError(
                f"{path} is not the shard the download wrote (damaged or edited since: its SHA-256 is not "
                f"the one in {MANIFEST}); re-run `dsgpt2 vocab download` with the same options and "
                f"--out {directory}: it writes that shard again"
            )


def mongo_texts(
    config: MongoConfig,
    fraction: float | None = None,
    count: int | None = None,
    seed: int = 0,
    chunk: int = 1000,
) -> tuple[Iterator[str], MongoWrapper]:
    """Texts streamed from the collections (sampled like ``download``), and the wrapper reading them.

    A background thread fetches the next chunks while the trainer consumes
    the current one, so that server round trips overlap with training.
    """
    draw = Draw(fraction, count, seed)
    wrapper = MongoWrapper(config)
    require_collections(wrapper.connection)
    require_nonempty(wrapper)
    p = draw.probability(len(wrapper))

    def chunks() -> Iterator[list[str]]:
        for lo in range(0, len(wrapper), chunk):
            hi = min(lo + chunk, len(wrapper))
            wanted = select(lo, hi, p, seed)
            docs = wrapper.get_range(lo, hi) if len(wanted) == hi - lo else wrapper.get_many(wanted.tolist())
            yield [d.text for d in docs]

    def texts() -> Iterator[str]:
        for batch in prefetch(chunks(), depth=2):
            yield from batch

    return texts(), wrapper


def prefetch(items: Iterator[T], depth: int) -> Iterator[T]:
    """Iterate ``items`` in a background thread, keeping up to ``depth`` of them ready.

    Errors raised by the producer are re-raised in the consumer.
    """
    q: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put((True, item))
            q.put((False, None))
        except BaseException as exc:
            q.put((False, exc))

    thread = threading.Thread(target=produce, name="dsgpt2-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)


# ---------------------------------------------------------------- train
