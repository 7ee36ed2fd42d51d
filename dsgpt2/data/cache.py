"""The token cache: every chunk's blocks, tokenized once, in memory-mapped files.

``dsgpt2 tokenize`` (or the first ``--data_mode cached`` run) writes them with worker processes;
:class:`CachedChunks` reads them at memory speed and gives the same blocks as
:class:`~dsgpt2.data.sources.StreamingChunks` for the same chunk. Chunks are filed under the
documents they hold (collection, lo, hi), so when the corpus grows only the new chunks are
tokenized and appended; another tokenizer, collection list or data setting rebuilds the cache.
``cache.json``, written last, says how many chunks are complete: a crash while appending leaves
the cache as it was before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from dsgpt2.corpus.config import MongoConfig
from dsgpt2.data.loader import start_loader
from dsgpt2.data.sources import SPLITS, Chunk, DataSpec, StreamingChunks, fingerprint
from dsgpt2.data.table import ChunkTable
from dsgpt2.files import atomic_write_text, atomic_writer


def _meta(cache_dir: Path) -> dict[str, Any] | None:
    path = cache_dir / "cache.json"
    return json.loads(path.read_text()) if path.exists() else None


class CachedChunks(Dataset):
    """Chunk ``i`` of a split, read from the memory-mapped files of ``dsgpt2 tokenize``.

    Args:
        table: the run's chunk table; chunk ids are its ids.

    Raises:
        KeyError: (on access) a chunk of ``table`` that the cache does not hold.
    """

    def __init__(self, cache_dir: Path, split: str, table: ChunkTable) -> None:
        self.cache_dir = cache_dir
        self.split = split
        self.table = table
        meta = _meta(cache_dir) or {}
        k = int(meta["chunks"])
        self.context = meta["fingerprint"]["context"]
        self.dtype = np.dtype(meta["dtype"])
        self.offsets = np.load(cache_dir / f"{split}.offsets.npy")[: k + 1]
        self.lasts = np.load(cache_dir / f"{split}.last.npy")[:k]
        self.rows = {tuple(r): i for i, r in enumerate(np.load(cache_dir / "chunks.npy")[:k].tolist())}
        self.has_loss = meta["fingerprint"].get("task", "lm") == "conversation"
        self._blocks: np.memmap | None = None
        self._loss: np.memmap | None = None

    def __len__(self) -> int:
        return self.table.n_chunks

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_blocks": None, "_loss": None}

    def grown(self, table: ChunkTable) -> CachedChunks:
        """The cache (appended to since) read through ``table``."""
        return CachedChunks(self.cache_dir, self.split, table)

    def _map(self, suffix: str, dtype: Any) -> np.ndarray:
        n = int(self.offsets[-1])
        if not n:
            return np.empty((0, self.context), dtype=dtype)
        path = self.cache_dir / f"{self.split}{suffix}"
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, self.context))

    def __getitem__(self, chunk: int) -> Chunk:
        if self._blocks is None:
            self._blocks = self._map(".bin", self.dtype)
            if self.has_loss:
                self._loss = self._map(".loss.bin", np.bool_)
        row = self.rows[self.table.locate(chunk)]
        lo, hi = int(self.offsets[row]), int(self.offsets[row + 1])
        loss = np.asarray(self._loss[lo:hi]) if self._loss is not None else None
        blocks = np.asarray(self._blocks[lo:hi], dtype=np.int32)
        return Chunk(chunk, blocks, int(self.lasts[row]), loss=loss)


def build_cache(
    sources: dict[str, StreamingChunks],
    cache_dir: Path,
    fp: dict[str, Any],
    vocab_size: int,
    workers: int = 2,
    tick: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Tokenize every chunk of each split's table into ``cache_dir``: the chunks it already holds
    under the same fingerprint are kept, the others appended. Return the blocks per split.
    ``tick``: called after each chunk (a training run's other ranks wait meanwhile)."""
    from tqdm import tqdm

    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = _meta(cache_dir)
    if meta is None or meta["fingerprint"] != fp:
        (cache_dir / "cache.json").unlink(missing_ok=True)
        meta = {"fingerprint": fp, "dtype": "uint16" if vocab_size <= 2**16 else "uint32", "chunks": 0}
    dtype, k = np.dtype(meta["dtype"]), int(meta["chunks"])
    table = next(iter(sources.values())).table
    rows = np.load(cache_dir / "chunks.npy")[:k] if k else np.empty((0, 3), dtype=np.int64)
    have = {tuple(r) for r in rows.tolist()}
    todo = [c for c in range(table.n_chunks) if table.locate(c) not in have]
    if k and not todo:
        return dict(meta["blocks"])  # up to date: the files are left untouched
    totals = {}
    for split, source in sources.items():
        offsets = np.load(cache_dir / f"{split}.offsets.npy")[: k + 1] if k else np.zeros(1, dtype=np.int64)
        lasts = list(np.load(cache_dir / f"{split}.last.npy")[:k]) if k else []
        offsets = list(offsets)
        files = [(".bin", dtype, "blocks")]
        if source.spec.task == "conversation":
            files.append((".loss.bin", np.dtype(np.bool_), "loss"))
        handles = {}
        for suffix, dt, name in files:
            path = cache_dir / f"{split}{suffix}"
            f = open(path, "r+b" if path.exists() and k else "wb")  # noqa: SIM115
            f.truncate(int(offsets[-1]) * source.spec.context * dt.itemsize)  # a crash's leftovers
            f.seek(0, 2)
            handles[name] = (f, dt)
        try:
            loader = start_loader(source, todo, workers) if todo else iter(())
            for item in tqdm(loader, total=len(todo), desc=f"tokenize {split}", unit="chunk", disable=None):
                handles["blocks"][0].write(item.blocks.astype(dtype).tobytes())
                if "loss" in handles and item.loss is not None:
                    handles["loss"][0].write(item.loss.astype(np.bool_).tobytes())
                offsets.append(offsets[-1] + len(item.blocks))
                lasts.append(item.last)
                if tick is not None:
                    tick()
        finally:
            for f, _ in handles.values():
                f.close()
        _save(cache_dir / f"{split}.offsets.npy", np.array(offsets, dtype=np.int64))
        _save(cache_dir / f"{split}.last.npy", np.array(lasts, dtype=np.int64))
        totals[split] = int(offsets[-1])
    added = np.array([table.locate(c) for c in todo], dtype=np.int64).reshape(-1, 3)
    _save(cache_dir / "chunks.npy", np.concatenate([rows, added]))
    meta = {**meta, "chunks": k + len(todo), "blocks": totals}
    atomic_write_text(cache_dir / "cache.json", json.dumps(meta, indent=1) + "\n")
    return totals


def _save(path: Path, array: np.ndarray) -> None:
    with atomic_writer(path, "wb") as f:
        np.save(f, array)


def prepare_cache(
    config: MongoConfig,
    tokenizer_dir: Path,
    spec: DataSpec,
    cache_dir: Path,
    workers: int = 2,
    force: bool = False,
    table: ChunkTable | None = None,
    tick: Callable[[], None] | None = None,
) -> tuple[dict[str, Any], int]:
    """Make the token cache hold every chunk of ``table`` (default: the corpus as it is now);
    ``tick``: see :func:`build_cache`.

    Returns:
        (the cache's meta, how many chunks were tokenized now: 0 when it was up to date).
    """
    from dsgpt2.corpus.mongo import MongoWrapper
    from dsgpt2.tokenizer.bpe import load_vocab_size

    if table is None:
        table = ChunkTable.initial(config.collections, MongoWrapper(config).counts, spec.chunk_docs)
    fp = fingerprint(config, tokenizer_dir, spec)
    if force:
        (cache_dir / "cache.json").unlink(missing_ok=True)
    before = (_meta(cache_dir) or {}).get("chunks", 0) if cache_fingerprint(cache_dir) == fp else 0
    sources = {split: StreamingChunks(config, table, tokenizer_dir, spec, split) for split in SPLITS}
    build_cache(sources, cache_dir, fp, load_vocab_size(tokenizer_dir), workers=workers, tick=tick)
    meta = _meta(cache_dir) or {}
    return meta, int(meta["chunks"]) - int(before)


def cache_fingerprint(cache_dir: Path) -> dict[str, Any] | None:
    """The fingerprint of a complete cache in ``cache_dir``, or None."""
    meta = _meta(cache_dir)
    return meta["fingerprint"] if meta else None
