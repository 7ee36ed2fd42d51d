"""The token cache: every document's tokens, tokenized once, in memory-mapped files.

``dsgpt2 tokenize`` (or the first ``--data_mode cached`` run) writes them with worker processes;
:class:`CachedChunks` reads them at memory speed and gives the same blocks as
:class:`~dsgpt2.data.sources.StreamingChunks` for the same key: it gathers the documents a chunk
holds in an epoch (:mod:`dsgpt2.data.order`) from the files and packs them as streaming does.

Files: ``tokens.bin`` holds every document's tokens and end-of-text, both splits, laid end to end
(``loss.bin`` the loss flag of each token, conversations only); ``offsets.bin`` (int64) where each
document starts, the documents of the table's chunks as they lie, one after the other; ``chunks.npy`` those
chunks, filed under the documents they hold (collection, lo, hi), so when the corpus grows only the
new chunks are tokenized and appended. Another tokenizer, collection list or data setting rebuilds
the cache. ``cache.json``, written last, says how many chunks are complete: a crash while appending
leaves the cache as it was before.

``cache.json`` also records, per file, the size and SHA-256 of what the cache holds of it (a prefix:
past it lie only a killed append's leftovers, cut off by the next build). The builder checks them
before it reuses a cache, once per directory and launch (the digest reads every byte: at about
1.5 GB/s, seconds for GBs against hours of training); a damaged cache is built again. A reader
(:class:`CachedChunks`, on every rank) checks the sizes only, and refuses a cache that fails them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from dsgpt2.data.loader import start_loader
from dsgpt2.data.sources import (
    Chunk,
    Chunks,
    ChunkSource,
    DataSpec,
    Key,
    StreamingChunks,
    fingerprint,
    spec_of,
)
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.config import MongoConfig
from dsgpt2.errors import ConfigError, first_line
from dsgpt2.files import atomic_write_text, atomic_writer, check_writable_dir, is_occupied
from dsgpt2.progress import progress as progress_display

log = logging.getLogger(__name__)
_DAMAGED: set[Path] = set()  # cache.json files said to be damaged, once each
FORMAT = 2  # the files' layout: 2 = tokens per document (1 held packed blocks per chunk and split)
_FORMER = ("train.bin", "val.bin", "train.loss.bin", "val.loss.bin", "train.offsets.npy",
           "val.offsets.npy", "train.last.npy", "val.last.npy")  # fmt: skip


_FILES = frozenset({"cache.json", "chunks.npy", "offsets.bin", "tokens.bin", "loss.bin", *_FORMER})
_KEYS = ("fingerprint", "dtype", "chunks", "tokens")  # what every complete cache.json holds
_BLOCK = 1 << 24  # bytes hashed at a time, a builder's tick between them
# Per file, the hash this process last computed or wrote of what the cache holds of it, with the file's
# (inode, size, mtime) then: a file unchanged since is not read again (``--follow`` prepares the cache at
# each growth, and a build's check is followed by its append).
_HASHED: dict[Path, tuple[tuple[int, int, int, int], Any]] = {}


def check_cache_dir(cache_dir: Path, fp: dict[str, Any], overwrite: bool) -> None:
    """Refuse a ``--cache_dir`` that holds something other than this data's token cache: another
    cache unless ``overwrite``, files that are no cache always.

    Raises:
        ConfigError: as above.
    """
    if not is_occupied(cache_dir):
        check_writable_dir(cache_dir, "--cache_dir")
        return
    if not cache_dir.is_dir() or any(
        p.name not in _FILES and not p.name.startswith(".") for p in cache_dir.iterdir()
    ):
        raise ConfigError(
            f"--cache_dir {cache_dir} holds files that are not a token cache; give an empty or new directory"
        )
    meta = _meta(cache_dir)
    if meta is None or meta["fingerprint"] == fp or overwrite:
        return  # a cache cut short, or this one (completed with what it lacks), or replaced
    differ = sorted(k for k in {*fp, *meta["fingerprint"]} if fp.get(k) != meta["fingerprint"].get(k))
    raise ConfigError(
        f"--cache_dir {cache_dir} holds the token cache of other data ({', '.join(differ)} differ); "
        "pass --overwrite to rebuild it for these settings, or give another --cache_dir"
    )


def _meta(cache_dir: Path) -> dict[str, Any] | None:
    path = cache_dir / "cache.json"
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict) or (meta.get("format") == FORMAT and any(k not in meta for k in _KEYS)):
        # Written whole or not at all (atomically): damaged since, it stands for no complete chunk.
        if path not in _DAMAGED:
            _DAMAGED.add(path)
            log.warning("%s is damaged: the cache is built again from its first chunk", path)
        return None
    return meta if meta.get("format") == FORMAT else None


def _stamp(path: Path, size: int) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, size


def _hash_prefix(path: Path, size: int, tick: Callable[[], None] | None = None) -> Any:
    """The SHA-256 (a ``hashlib`` object, to go on with) of the first ``size`` bytes of ``path``;
    not read again while the file is as this process last hashed or wrote it. SHA-256, as the other
    artifacts' digests: in the standard library, as fast as a disk reads, what ``sha256sum`` prints."""
    stamp = _stamp(path, size)
    known = _HASHED.get(path)
    if known is not None and known[0] == stamp:
        return known[1].copy()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = size
        while left > 0 and (block := f.read(min(left, _BLOCK))):
            h.update(block)
            left -= len(block)
            if tick is not None:
                tick()
    _HASHED[path] = (stamp, h.copy())
    return h


def _held(cache_dir: Path, meta: dict[str, Any]) -> tuple[np.ndarray, dict[str, int]]:
    """The complete chunks' rows, and the bytes the cache holds of each data file: as ``cache.json``
    records them, or, in one written before it recorded them, as its chunks and offsets say.

    Raises:
        ValueError: chunks.npy or offsets.bin is unreadable or short (the message names it).
    """
    k = int(meta["chunks"])
    try:
        rows = np.load(cache_dir / "chunks.npy").reshape(-1, 3)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"chunks.npy cannot be read ({first_line(exc)})") from None
    if len(rows) < k:
        raise ValueError(f"chunks.npy holds {len(rows)} chunks, fewer than the {k} of cache.json")
    rows = rows[:k].astype(np.int64)
    if "files" in meta:
        return rows, {n: int(r["size"]) for n, r in meta["files"].items() if n != "chunks.npy"}
    docs = int((rows[:, 2] - rows[:, 1]).sum())
    sizes = {"offsets.bin": (docs + 1) * 8}
    path = cache_dir / "offsets.bin"
    if not path.is_file() or path.stat().st_size < sizes["offsets.bin"]:
        raise ValueError(f"offsets.bin is missing or shorter than the {sizes['offsets.bin']} bytes expected")
    tokens = int(np.memmap(path, dtype=np.int64, mode="r", shape=(docs + 1,))[docs])
    sizes["tokens.bin"] = tokens * np.dtype(meta["dtype"]).itemsize
    if meta["fingerprint"].get("task") == "conversation":
        sizes["loss.bin"] = tokens
    return rows, sizes


def _fault(
    cache_dir: Path, meta: dict[str, Any], tick: Callable[[], None] | None = None, *, digests: bool = True
) -> str | None:
    """What is wrong with the files of the complete cache ``meta`` describes, or None: a file missing or
    shorter than what the cache holds of it, or (``digests``) whose content is not what was written.
    A cache.json without sizes and digests (an earlier dsgpt2's) is checked against its own offsets."""
    try:
        rows, sizes = _held(cache_dir, meta)
    except ValueError as exc:
        return str(exc)
    for name, size in sizes.items():
        path = cache_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:  # longer is a killed append's leftovers
            return f"{name} holds {path.stat().st_size} bytes, fewer than the {size} of cache.json"
    recorded = meta.get("files") if digests else None
    for name, record in (recorded or {}).items():
        if name == "chunks.npy":
            digest = hashlib.sha256(rows.tobytes()).hexdigest()
        else:
            digest = _hash_prefix(cache_dir / name, int(record["size"]), tick).hexdigest()
        if digest != record["sha256"]:
            return f"{name} is not what was written (its SHA-256 differs from cache.json's)"
    return None


def _reusable(
    cache_dir: Path, fp: dict[str, Any], tick: Callable[[], None] | None = None
) -> dict[str, Any] | None:
    """The meta of the complete cache of ``fp`` in ``cache_dir``, its files as it records them; else None.
    A damaged one is said in one line and its cache.json removed: it is built again from its first chunk."""
    meta = _meta(cache_dir)
    if meta is None or meta["fingerprint"] != fp:
        return None
    fault = _fault(cache_dir, meta, tick)
    if fault is None:
        return meta
    log.warning("token cache %s is damaged: %s; it is built again from its first chunk", cache_dir, fault)
    (cache_dir / "cache.json").unlink(missing_ok=True)
    return None


class CachedChunks(ChunkSource):
    """Chunks of a split, gathered from the memory-mapped files of ``dsgpt2 tokenize``.

    Args:
        table: the run's chunk table; chunk ids are its ids.
        streams: the collections read as one pool (default: all of them).

    Raises:
        ConfigError: no complete cache in ``cache_dir``, or one whose files are missing or cut short.
        KeyError: (on access) a document of a chunk the cache does not hold.
    """

    def __init__(
        self,
        cache_dir: Path,
        split: str,
        table: ChunkTable,
        streams: Sequence[Sequence[int]] | None = None,
        packing: str = "end_to_end",
    ) -> None:
        self.cache_dir = cache_dir
        self.split = split
        meta = _meta(cache_dir)
        fault = "it holds no complete token cache" if meta is None else _fault(cache_dir, meta, digests=False)
        if meta is None or fault is not None:
            raise ConfigError(
                f"--cache_dir {cache_dir}: {fault}; build it again with `dsgpt2 tokenize` (the run's data "
                "flags), or delete the directory for the run to build it"
            )
        fp = meta["fingerprint"]
        # The files hold each document's tokens; how they are packed is the reading run's.
        self.spec = replace(spec_of(fp), packing=packing)
        self.chunks = Chunks(table, fp["collections"], self.spec, split, streams)
        self.dtype = np.dtype(meta["dtype"])
        rows = np.load(cache_dir / "chunks.npy")[: int(meta["chunks"])].reshape(-1, 3)
        bases = np.concatenate([[0], np.cumsum(rows[:, 2] - rows[:, 1])])
        self.documents = int(bases[-1])
        # Per collection, its rows by first idx: a document's place in offsets.bin without a scan.
        self._rows: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for c in np.unique(rows[:, 0]).tolist():
            mine = np.flatnonzero(rows[:, 0] == c)
            mine = mine[np.argsort(rows[mine, 1])]
            self._rows[c] = (rows[mine, 1], rows[mine, 2], bases[mine])
        self.has_loss = self.spec.task == "conversation"
        self._offsets: np.ndarray | None = None
        self._tokens: np.ndarray | None = None
        self._loss: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_offsets": None, "_tokens": None, "_loss": None}

    def grown(self, table: ChunkTable) -> CachedChunks:
        """The cache (appended to since) read through ``table``."""
        return CachedChunks(self.cache_dir, self.split, table, self.chunks.streams, self.spec.packing)

    def _map(self, name: str, dtype: Any, n: int) -> np.ndarray:
        if not n:
            return np.empty(0, dtype=dtype)
        # A plain array over the mapped file: a memmap's own indexing costs more than the gather.
        return np.asarray(np.memmap(self.cache_dir / name, dtype=dtype, mode="r", shape=(n,)))

    @property
    def offsets(self) -> np.ndarray:
        """Where each document's tokens start in tokens.bin (and, last, the end)."""
        if self._offsets is None:
            self._offsets = self._map("offsets.bin", np.int64, self.documents + 1)
        return self._offsets

    def _places(self, colls: np.ndarray, idxs: np.ndarray) -> np.ndarray:
        """Each document's place in offsets.bin."""
        out = np.empty(len(idxs), dtype=np.int64)
        for c in self._rows if len(self._rows) == 1 else np.unique(colls).tolist():
            at = slice(None) if len(self._rows) == 1 else colls == c
            los, his, bases = self._rows.get(c, (np.empty(0, np.int64),) * 3)
            r = np.searchsorted(los, idxs[at], side="right") - 1
            if (r < 0).any() or (idxs[at] >= his[np.maximum(r, 0)]).any():
                raise KeyError(f"the token cache {self.cache_dir} lacks documents of collection {c}")
            out[at] = bases[r] + idxs[at] - los[r]
        return out

    def __getitem__(self, key: Key) -> Chunk:
        offsets = self.offsets
        if self._tokens is None:
            self._tokens = self._map("tokens.bin", self.dtype, int(offsets[-1]))
            if self.has_loss:
                self._loss = self._map("loss.bin", np.bool_, int(offsets[-1]))
        colls, idxs = self.chunks.wanted(key)
        places = self._places(colls, idxs)
        starts = offsets[places]
        lengths = offsets[places + 1] - starts
        kept = lengths > 0  # documents without usable text hold no tokens
        starts, lengths, colls = starts[kept], lengths[kept], colls[kept]
        # Every token of the kept documents, in reading order: one gather from the mapped file.
        total = int(lengths.sum())
        first = np.cumsum(lengths) - lengths
        gather = np.repeat(starts - first, lengths) + np.arange(total, dtype=np.int64)
        loss = self._loss[gather] if self._loss is not None else None
        item, spans = self.chunks.pack(self._tokens[gather], lengths, loss)
        return self.chunks.finish(key, item, lengths, colls, spans)


class _DocumentTokens(Dataset):
    """What a cache builder's workers make of a chunk: its documents' tokens (as it lies)."""

    def __init__(self, source: StreamingChunks) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, chunk: int) -> Any:
        return self.source.document_tokens(chunk)


def build_cache(
    source: StreamingChunks,
    cache_dir: Path,
    fp: dict[str, Any],
    vocab_size: int,
    workers: int = 2,
    *,
    tick: Callable[[], None] | None = None,
    progress: bool = True,
) -> dict[str, int]:
    """Tokenize every document of ``source``'s table into ``cache_dir``: the chunks it already holds
    under the same fingerprint are kept (its files checked first: a damaged cache is built again),
    the others appended; each file's size and digest recorded. Return the tokens per split.
    ``tick``: called after each chunk (a training run's other ranks wait meanwhile); ``progress``:
    False for no progress at all."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = _reusable(cache_dir, fp, tick)
    if meta is None:
        (cache_dir / "cache.json").unlink(missing_ok=True)
        for name in _FORMER:
            (cache_dir / name).unlink(missing_ok=True)
        dtype = "uint16" if vocab_size <= 2**16 else "uint32"
        meta = {"format": FORMAT, "fingerprint": fp, "dtype": dtype, "chunks": 0, "tokens": {}}
    dtype, k = np.dtype(meta["dtype"]), int(meta["chunks"])
    table = source.table
    rows = np.load(cache_dir / "chunks.npy")[:k].reshape(-1, 3) if k else np.empty((0, 3), dtype=np.int64)
    have = {tuple(r) for r in rows.tolist()}
    todo = [c for c in range(table.n_chunks) if table.locate(c) not in have]
    if k and not todo and "files" in meta:
        return dict(meta["tokens"])  # up to date: the files are left untouched
    if k and "files" not in meta:
        log.info(
            "token cache %s: its files' sizes and digests recorded (an earlier dsgpt2 wrote it)", cache_dir
        )
    done = int((rows[:, 2] - rows[:, 1]).sum())  # documents the complete chunks hold
    end = int(np.memmap(cache_dir / "offsets.bin", dtype=np.int64, mode="r")[done]) if k else 0
    totals = {"train": 0, "val": 0, **meta["tokens"]}
    files = [("offsets.bin", np.dtype(np.int64), "offsets", done + 1), ("tokens.bin", dtype, "tokens", end)]
    if source.spec.task == "conversation":
        files.append(("loss.bin", np.dtype(np.bool_), "loss", end))
    bar = progress_display("tokenize", "chunk", total=len(todo), enabled=progress)
    handles = {}
    for name, dt, role, keep in files:
        path = cache_dir / name
        # The hash goes on from what the cache holds (checked above) over what is appended.
        h = _hash_prefix(path, keep * dt.itemsize, tick) if k else hashlib.sha256()
        f = open(path, "r+b" if path.exists() and k else "wb")  # noqa: SIM115
        f.truncate(keep * dt.itemsize if k else 0)  # a crash's leftovers
        f.seek(0, 2)
        handles[role] = (f, dt, h)

    def put(role: str, values: np.ndarray) -> None:
        f, dt, h = handles[role]
        data = values.astype(dt).tobytes()
        f.write(data)
        h.update(data)

    if not k:
        put("offsets", np.zeros(1, dtype=np.int64))
    try:
        loader = start_loader(_DocumentTokens(source), todo, workers) if todo else iter(())
        for item in loader:
            put("tokens", item.flat)
            if "loss" in handles and item.loss is not None:
                put("loss", item.loss)
            put("offsets", end + np.cumsum(item.lengths))
            end += int(item.lengths.sum())
            _count(totals, item.lengths, table.locate(item.chunk), source.spec, fp["collections"])
            bar.update(1)
            if tick is not None:
                tick()
    finally:
        bar.close()
        for f, _, _ in handles.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
    added = np.array([table.locate(c) for c in todo], dtype=np.int64).reshape(-1, 3)
    rows = np.concatenate([rows, added]).astype(np.int64)
    _save(cache_dir / "chunks.npy", rows)
    record = {"chunks.npy": {"size": rows.nbytes, "sha256": hashlib.sha256(rows.tobytes()).hexdigest()}}
    for name, _, role, _ in files:
        size, h = (cache_dir / name).stat().st_size, handles[role][2]
        _HASHED[cache_dir / name] = (_stamp(cache_dir / name, size), h.copy())
        record[name] = {"size": size, "sha256": h.hexdigest()}
    meta = {**meta, "chunks": len(rows), "tokens": totals, "files": record}
    atomic_write_text(cache_dir / "cache.json", json.dumps(meta, indent=1) + "\n")
    return totals


def _count(totals: dict[str, int], lengths: np.ndarray, where: tuple[int, int, int], spec: DataSpec,
           names: Sequence[str]) -> None:  # fmt: skip
    c, lo, hi = where
    train = split_mask(np.arange(lo, hi), spec.tr_ratio, spec.seed, names[c])
    totals["train"] += int(lengths[train].sum())
    totals["val"] += int(lengths[~train].sum())


def _save(path: Path, array: np.ndarray) -> None:
    with atomic_writer(path, "wb") as f:
        np.save(f, array)


def prepare_cache(
    config: MongoConfig,
    tokenizer_dir: Path,
    spec: DataSpec,
    cache_dir: Path,
    workers: int = 2,
    *,
    force: bool = False,
    table: ChunkTable | None = None,
    tick: Callable[[], None] | None = None,
    progress: bool = True,
    overwrite: bool | None = None,
) -> tuple[dict[str, Any], int]:
    """Make the token cache hold every chunk of ``table`` (default: the corpus as it is now);
    ``tick``, ``progress``: see :func:`build_cache`. ``overwrite``: None replaces a cache of other
    data (a run's own cache directory); False refuses it (see :func:`check_cache_dir`).

    Returns:
        (the cache's meta, how many chunks were tokenized now: 0 when it was up to date).
    """
    from dsgpt2.db.wrapper import MongoWrapper
    from dsgpt2.tokenizer.bpe import load_vocab_size

    if table is None:
        table = ChunkTable.initial(config.collections, MongoWrapper(config).counts, spec.chunk_docs)
    fp = fingerprint(config, tokenizer_dir, cached_spec(spec))
    if overwrite is not None:
        check_cache_dir(cache_dir, fp, overwrite or force)
    if force:
        (cache_dir / "cache.json").unlink(missing_ok=True)
    before = int((_reusable(cache_dir, fp, tick) or {}).get("chunks", 0))
    source = StreamingChunks(config, table, tokenizer_dir, spec, "all")
    build_cache(source, cache_dir, fp, load_vocab_size(tokenizer_dir), workers=workers, tick=tick,
                progress=progress)  # fmt: skip
    meta = _meta(cache_dir) or {}
    return meta, int(meta["chunks"]) - int(before)


def cached_spec(spec: DataSpec) -> DataSpec:
    """What of ``spec`` a token cache depends on: all but the packing (it holds each document's tokens,
    and packs them as the run that reads it does)."""
    return replace(spec, packing="end_to_end")


def cache_fingerprint(cache_dir: Path) -> dict[str, Any] | None:
    """The fingerprint of a complete cache in ``cache_dir``, or None."""
    meta = _meta(cache_dir)
    return meta["fingerprint"] if meta else None
