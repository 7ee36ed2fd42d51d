"""Training data: chunks of documents from MongoDB → packed blocks → micro-batches.

A chunk (``chunk_docs`` consecutive documents, see :mod:`dsgpt2.schedule`) is
the unit of work: a DataLoader worker fetches it with one query per
collection, keeps the documents of the requested split, tokenizes and packs
them. Two sources give the same blocks for the same chunk:

- :class:`StreamingChunks` reads MongoDB on the fly (the default: training
  starts within seconds);
- :class:`CachedChunks` reads blocks that ``dsgpt2 tokenize`` wrote to
  memory-mapped files, checked against a fingerprint of the corpus,
  tokenizer and split.

:class:`BlockStream` deals each rank its chunks in the epoch's order and
turns them into micro-batches, keeping the small :class:`Position` that
makes resuming exact.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dsgpt2.config import MongoConfig
from dsgpt2.errors import CorpusError
from dsgpt2.packing import labels_and_mask, pack, pack_with_loss
from dsgpt2.schedule import Position, chunk_range, eval_chunks, num_chunks, rank_chunks, split_mask

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
TASKS = ("lm", "conversation")


@dataclass(frozen=True)
class DataSpec:
    """What decides the blocks: change any of it and the batches change."""

    context: int
    chunk_docs: int
    tr_ratio: float
    seed: int
    eot: int
    pad: int
    task: str = "lm"  # "conversation": the documents' turns, loss on the replies only
    reply_speakers: str = "bot"  # comma-separated; used by the conversation task

    @property
    def replies(self) -> frozenset[str]:
        return frozenset(s for s in self.reply_speakers.split(",") if s)


def make_spec(
    tokenizer_dir: Path,
    context: int,
    chunk_docs: int,
    tr_ratio: float,
    seed: int,
    task: str = "lm",
    reply_speakers: str = "bot",
) -> DataSpec:
    """The data spec of a run, with end-of-text and pad ids read from the tokenizer.

    Raises:
        CorpusError: the tokenizer lacks end-of-text, or a reply speaker has no token.
    """
    from dsgpt2.vocab import EOT, PAD

    tok = load_tokenizer(tokenizer_dir)
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    if eot is None:
        raise CorpusError(
            f"{tokenizer_dir}: the tokenizer has no {EOT} token; train it with dsgpt2 vocab train"
        )
    if task == "conversation":
        from dsgpt2.conversation import speaker_ids

        known = speaker_ids(tok)
        missing = [s for s in reply_speakers.split(",") if s and s not in known]
        if missing or not reply_speakers.strip(","):
            raise CorpusError(
                f"reply speaker(s) {missing or [reply_speakers]} have no <|speaker|> token in "
                f"{tokenizer_dir} (it knows {sorted(known)}); pick among those or retrain the vocabulary "
                "with `dsgpt2 vocab train --speakers ...`"
            )
    return DataSpec(
        context, chunk_docs, tr_ratio, seed, eot, eot if pad is None else pad, task, reply_speakers
    )


def tokenizer_digest(tokenizer_dir: Path) -> str:
    """A hash of the tokenizer (its tokenizer.json): part of the data fingerprint."""
    return hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]


def fingerprint(
    config: MongoConfig, counts: tuple[int, ...], tokenizer_dir: Path, spec: DataSpec
) -> dict[str, Any]:
    """Everything the batches depend on; a checkpoint or cache made under another one is stale."""
    return {
        "db": config.db,
        "collections": list(config.collections),
        "counts": list(counts),
        "text_field": config.text_field,
        "tokenizer": tokenizer_digest(tokenizer_dir),
        **asdict(spec),
    }


def load_tokenizer(tokenizer_dir: Path) -> Any:
    """The fast tokenizer of ``tokenizer_dir``, reading special-token text as plain text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    # A document that contains the text "<|endoftext|>" must not inject the real token.
    tok.encode_special_tokens = True
    return tok


@dataclass
class Chunk:
    """The packed blocks of one chunk of one split."""

    chunk: int
    blocks: np.ndarray  # (n, T) int32
    last: int  # real tokens in the last block
    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    loss: np.ndarray | None = None  # (n, T) bool: tokens the loss covers (None: all real ones)

    @property
    def valid(self) -> np.ndarray:
        """Real tokens per block: all of them but in the last."""
        v = np.full(len(self.blocks), self.blocks.shape[1], dtype=np.int64)
        if len(v):
            v[-1] = self.last
        return v


class StreamingChunks(Dataset):
    """Chunk ``i`` of a split, read from MongoDB and tokenized on demand (in a DataLoader worker).

    The wrapper and tokenizer are made lazily in the process that uses them.

    Args:
        split: ``train``, ``val``, or ``all`` (every document, for evaluation).
        window: only the unified indices ``[lo, hi)``; chunks then count from ``lo``.
    """

    def __init__(
        self,
        config: MongoConfig,
        counts: tuple[int, ...],
        tokenizer_dir: Path,
        spec: DataSpec,
        split: str,
        window: tuple[int, int] | None = None,
    ) -> None:
        self.config = config
        self.counts = counts
        self.tokenizer_dir = tokenizer_dir
        self.spec = spec
        self.split = split
        self.lo, self.hi = window if window is not None else (0, sum(counts))
        self.total = self.hi - self.lo
        self._wrapper: Any = None
        self._tokenizer: Any = None
        self._speakers: dict[str, int] = {}
        self._pid = -1

    def __len__(self) -> int:
        return num_chunks(self.total, self.spec.chunk_docs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_wrapper": None, "_tokenizer": None, "_pid": -1}

    def _ready(self) -> None:
        if self._pid != os.getpid():
            from dsgpt2.mongo import MongoWrapper

            if torch.utils.data.get_worker_info() is not None:
                # Each worker tokenizes one chunk at a time on one thread: several workers with a
                # thread pool each would fight the training step for the cores.
                os.environ["TOKENIZERS_PARALLELISM"] = "false"

            conversations = self.spec.task == "conversation"
            self._wrapper = MongoWrapper(self.config, counts=self.counts, conversations=conversations)
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
            if conversations:
                from dsgpt2.conversation import speaker_ids

                self._speakers = speaker_ids(self._tokenizer)
            self._pid = os.getpid()

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast: no character offsets, which packing never needs.
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def __getitem__(self, chunk: int) -> Chunk:
        self._ready()
        lo, hi = chunk_range(chunk, self.total, self.spec.chunk_docs)
        lo, hi = lo + self.lo, hi + self.lo
        indices = np.arange(lo, hi)
        if self.split == "all":
            wanted = indices
        else:
            train = split_mask(indices, self.spec.tr_ratio, self.spec.seed)
            wanted = indices[train] if self.split == "train" else indices[~train]
        before = dict(self._wrapper.skipped)
        if len(wanted) == 0:
            docs = []
        elif len(wanted) > (hi - lo) // 2:
            keep = set(wanted.tolist())
            docs = [d for d in self._wrapper.get_range(lo, hi) if d.index in keep]
        else:
            docs = self._wrapper.get_many(wanted.tolist())
        skipped = {k: v - before.get(k, 0) for k, v in self._wrapper.skipped.items() if v - before.get(k, 0)}
        if self.spec.task != "conversation":
            blocks, last = pack(self._encode([d.text for d in docs]), self.spec.context, *self._ids())
            return Chunk(chunk, blocks, last, len(docs), skipped)
        from dsgpt2.conversation import encode_conversations

        ids, flags, unknown = encode_conversations(
            [d.text for d in docs], self._encode, self._speakers, self.spec.replies
        )
        if unknown:
            skipped["unknown_speaker"] = unknown
        blocks, loss, last = pack_with_loss(ids, flags, self.spec.context, *self._ids())
        return Chunk(chunk, blocks, last, len(ids), skipped, loss)

    def _ids(self) -> tuple[int, int]:
        return self.spec.eot, self.spec.pad


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
            loader = _loader(source, range(len(source)), workers)
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
    from dsgpt2.mongo import MongoWrapper
    from dsgpt2.vocab import load_vocab_size

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


def _collate(item: Chunk) -> Chunk:
    return item


def _init_worker(rank_pid: int, worker_id: int) -> None:
    # A SIGTERM sent to a whole process group (a pipeline stopping, a job scheduler) must let the
    # rank finish its step and save: a worker dying first would fail that step instead. Workers
    # stop when their rank shuts the loader down, or exits (see _kill_workers_at_exit), or dies.
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Started with SIGTERM held (see _loader); one that came meanwhile is dropped, now ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    die_with_parent(rank_pid)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies, even by SIGKILL (Linux).

    The parent is the thread that forked it: loaders are made on their rank's main thread.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: nothing would send the signal
        os._exit(1)


_exit_hook = False


def _kill_workers_at_exit() -> None:
    """Kill the loader workers still alive when this process exits.

    multiprocessing ends daemonic children with SIGTERM and then waits for them, which workers
    that ignore SIGTERM would never answer. Registered after multiprocessing's own exit hook,
    this one runs first.
    """
    import multiprocessing
    import signal

    # torch's SIGCHLD handler would report each killed worker as a failure.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(5)


def _loader(dataset: Dataset, order: Any, workers: int, prefetch: int = 4) -> Iterator[Any]:
    """The items of ``dataset`` in ``order``, read by ``workers`` processes (started already)."""
    import signal

    loader = _make_loader(dataset, order, workers, prefetch)
    if workers == 0 or threading.current_thread() is not threading.main_thread():
        return iter(loader)
    # A SIGTERM to the process group while workers start would reach one before it can ignore
    # it (torch's worker handler dies on it): hold it until they are running; the rank then gets it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _make_loader(dataset: Dataset, order: Any, workers: int, prefetch: int) -> DataLoader:
    global _exit_hook
    extra: dict[str, Any] = {}
    if workers > 0:
        if not _exit_hook:
            import atexit

            atexit.register(_kill_workers_at_exit)
            _exit_hook = True
        extra = {
            "multiprocessing_context": "fork",
            "prefetch_factor": prefetch,
            "worker_init_fn": functools.partial(_init_worker, os.getpid()),
        }
    # A generator of its own: the loader must not draw from torch's global RNG, whose state
    # is part of a checkpoint (dropout) and would otherwise depend on when loaders are made.
    return DataLoader(
        dataset,
        batch_size=None,
        sampler=list(order),
        num_workers=workers,
        collate_fn=_collate,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )


@dataclass
class Batch:
    """One micro-batch, and where its blocks came from."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 on padding
    attention_mask: torch.Tensor  # (B, T)
    block_ids: list[tuple[int, int, int]]  # (epoch, chunk, block in chunk)
    tokens: int  # real tokens


class _Rows:
    """Blocks gathered for the next micro-batch."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.valid: list[int] = []
        self.ids: list[tuple[int, int, int]] = []
        self.loss: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, item: Chunk, b: int, valid: int, block_id: tuple[int, int, int]) -> None:
        self.rows.append(item.blocks[b])
        self.valid.append(valid)
        self.ids.append(block_id)
        if item.loss is not None:
            self.loss.append(item.loss[b])

    def batch(self) -> Batch:
        return _make_batch(self.rows, self.valid, self.ids, self.loss or None)


def _make_batch(
    rows: list[np.ndarray],
    valid: list[int],
    ids: list[tuple[int, int, int]],
    loss: list[np.ndarray] | None = None,
) -> Batch:
    blocks = np.stack(rows)
    labels, mask = labels_and_mask(blocks, np.array(valid), np.stack(loss) if loss else None)
    return Batch(
        torch.from_numpy(blocks.astype(np.int64)),
        torch.from_numpy(labels),
        torch.from_numpy(mask),
        ids,
        int(sum(valid)),
    )


class BlockStream:
    """Micro-batches of training blocks for one rank, endless over epochs, resumable exactly.

    ``position`` always names the next block not yet handed out, so that a
    checkpoint taken between two batches resumes with the very next one.
    """

    def __init__(
        self,
        dataset: Dataset,
        seed: int,
        rank: int,
        world: int,
        micro_batch: int,
        position: Position | None = None,
        workers: int = 2,
    ) -> None:
        self.dataset = dataset
        self.n_chunks = len(dataset)
        self.seed = seed
        self.rank = rank
        self.world = world
        self.micro_batch = micro_batch
        self.position = position or Position()
        self.workers = workers
        self.documents = 0
        self.skipped: dict[str, int] = {}

    def _take(self, item: Chunk) -> None:
        self.documents += item.documents
        for reason, n in item.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n

    def __iter__(self) -> Iterator[Batch]:
        pos = self.position
        rows = _Rows()
        # First what a run on another number of ranks left over (see schedule.redeal).
        queue = list(pos.queue)
        for i, item in enumerate(_loader(self.dataset, [c for _, c, _ in queue], self.workers)):
            self._take(item)
            e, c, first = queue[i]
            v = item.valid
            for b in range(first, len(item.blocks)):
                rows.add(item, b, int(v[b]), (e, c, b))
                if len(rows) == self.micro_batch:
                    batch = rows.batch()
                    rows = _Rows()
                    rest = [(e, c, b + 1)] if b + 1 < len(item.blocks) else []
                    self.position = Position(pos.epoch, pos.chunk, pos.block, rest + queue[i + 1 :])
                    yield batch
        epoch, start, skip = pos.epoch, pos.chunk, pos.block
        while True:
            order = rank_chunks(self.n_chunks, self.seed, epoch, self.rank, self.world)
            produced = False
            for k, item in enumerate(_loader(self.dataset, order[start:], self.workers), start=start):
                self._take(item)
                v = item.valid
                for b in range(skip, len(item.blocks)):
                    produced = True
                    rows.add(item, b, int(v[b]), (epoch, int(item.chunk), b))
                    if len(rows) == self.micro_batch:
                        batch = rows.batch()
                        rows = _Rows()
                        # The next block is b + 1 of this chunk (possibly past its end).
                        self.position = _normalize(Position(epoch, k, b + 1), len(item.blocks))
                        yield batch
                skip = 0
            if not produced and start == 0:
                raise CorpusError(
                    f"rank {self.rank} has no training block in a whole epoch: the split is empty "
                    "(too few documents, or --tr_ratio leaves none for training)"
                )
            epoch, start = epoch + 1, 0


def _normalize(pos: Position, blocks_in_chunk: int) -> Position:
    if pos.block >= blocks_in_chunk:
        return Position(pos.epoch, pos.chunk + 1, 0)
    return pos


def eval_batches(
    dataset: Dataset, rank: int, world: int, micro_batch: int, limit: int, workers: int = 0
) -> list[Batch]:
    """The first ``limit`` validation micro-batches of this rank: the same at every evaluation."""
    out: list[Batch] = []
    for batch in iter_eval_batches(dataset, rank, world, micro_batch, workers):
        out.append(batch)
        if len(out) >= limit:
            break
    return out


def iter_eval_batches(
    dataset: Dataset, rank: int, world: int, micro_batch: int, workers: int = 0, stats: Any = None
) -> Iterator[Batch]:
    """Every block of this rank's evaluation chunks, in micro-batches, in a fixed order.

    ``stats`` (a dict), when given, gathers ``chunks``, ``documents`` and ``skipped`` as chunks arrive.
    """
    rows = _Rows()
    for item in _loader(dataset, eval_chunks(len(dataset), rank, world), workers):
        if stats is not None:
            stats["chunks"] = stats.get("chunks", 0) + 1
            stats["documents"] = stats.get("documents", 0) + item.documents
            skipped = stats.setdefault("skipped", {})
            for reason, n in item.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        v = item.valid
        for b in range(len(item.blocks)):
            rows.add(item, b, int(v[b]), (0, int(item.chunk), b))
            if len(rows) == micro_batch:
                yield rows.batch()
                rows = _Rows()
    if len(rows):
        yield rows.batch()
