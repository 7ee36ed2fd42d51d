"""The token cache: every chunk's blocks, tokenized once, in memory-mapped files.

``dsgpt2 tokenize`` (or the first ``--data_mode cached`` run) writes them with worker processes;
:class:`CachedChunks` reads them at memory speed and gives the same blocks as
:class:`~dsgpt2.data.sources.StreamingChunks` for the same chunk. The cache is valid only for
the fingerprint it records, and is rebuilt when the data changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from dsgpt2.corpus.config import MongoConfig
from dsgpt2.data.loader import start_loader
from dsgpt2.data.sources import SPLITS, Chunk, DataSpec, StreamingChunks, fingerprint


class CachedChunks(Dataset):
    """Chunk ``i`` of a split, read from the memory-mapped files of ``dsgpt2 tokenize``."""

    def __init__(self, cache_dir: Path, split: str) -> None:
        self.cache_dir = cache_dir
        self.split = split
        meta = json.loads((cache_dir / "cache.json").read_text())
        self.context = meta["fingerprint"]["context"]
        self.dtype = np.dtype(meta["dtype"])
        self.offsets = np.load(cache_dir / f"{split}.offsets.npy")
        self.lasts = np.load(cache_dir / f"{split}.last.npy")
        self.has_loss = meta["fingerprint"].get("task", "lm") == "conversation"
        self._blocks: np.memmap | None = None
        self._loss: np.memmap | None = None

    def __len__(self) -> int:
        return len(self.lasts)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_blocks": None, "_loss": None}

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
        lo, hi = int(self.offsets[chunk]), int(self.offsets[chunk + 1])
        loss = np.asarray(self._loss[lo:hi]) if self._loss is not None else None
        blocks = np.asarray(self._blocks[lo:hi], dtype=np.int32)
        return Chunk(chunk, blocks, int(self.lasts[chunk]), loss=loss)


def build_cache(
    sources: dict[str, StreamingChunks],
    cache_dir: Path,
    fp: dict[str, Any],
    vocab_size: int,
    workers: int = 2,
) -> dict[str, int]:
    """Tokenize every chunk of each split into ``cache_dir`` (one pass); return blocks per split."""
    from tqdm import tqdm

    cache_dir.mkdir(parents=True, exist_ok=True)
    (cache_dir / "cache.json").unlink(missing_ok=True)  # written last: its presence means complete
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    totals = {}
    for split, source in sources.items():
        offsets = [0]
        lasts = []
        conversation = source.spec.task == "conversation"
        loss_file = open(cache_dir / f"{split}.loss.bin", "wb") if conversation else None  # noqa: SIM115
        with open(cache_dir / f"{split}.bin", "wb") as f:
            loader = start_loader(source, range(len(source)), workers)
            for item in tqdm(loader, total=len(source), desc=f"tokenize {split}", unit="chunk", disable=None):
                f.write(item.blocks.astype(dtype).tobytes())
                if loss_file is not None and item.loss is not None:
                    loss_file.write(item.loss.astype(np.bool_).tobytes())
                offsets.append(offsets[-1] + len(item.blocks))
                lasts.append(item.last)
        if loss_file is not None:
            loss_file.close()
        np.save(cache_dir / f"{split}.offsets.npy", np.array(offsets, dtype=np.int64))
        np.save(cache_dir / f"{split}.last.npy", np.array(lasts, dtype=np.int64))
        totals[split] = offsets[-1]
    meta = {"fingerprint": fp, "dtype": np.dtype(dtype).name, "blocks": totals}
    (cache_dir / "cache.json").write_text(json.dumps(meta, indent=1) + "\n")
    return totals


def prepare_cache(
    config: MongoConfig,
    tokenizer_dir: Path,
    spec: DataSpec,
    cache_dir: Path,
    workers: int = 2,
    force: bool = False,
) -> tuple[dict[str, Any], bool]:
    """Build the token cache for ``spec`` unless an up-to-date one exists; return (meta, built)."""
    from dsgpt2.corpus.mongo import MongoWrapper
    from dsgpt2.tokenizer.bpe import load_vocab_size

    counts = MongoWrapper(config).counts
    fp = fingerprint(config, counts, tokenizer_dir, spec)
    if not force and cache_fingerprint(cache_dir) == fp:
        return json.loads((cache_dir / "cache.json").read_text()), False
    sources = {split: StreamingChunks(config, counts, tokenizer_dir, spec, split) for split in SPLITS}
    build_cache(sources, cache_dir, fp, load_vocab_size(tokenizer_dir), workers=workers)
    return json.loads((cache_dir / "cache.json").read_text()), True


def cache_fingerprint(cache_dir: Path) -> dict[str, Any] | None:
    """The fingerprint of a complete cache in ``cache_dir``, or None."""
    path = cache_dir / "cache.json"
    return json.loads(path.read_text())["fingerprint"] if path.exists() else None
