"""Training data sources: what a chunk of documents becomes, and the fingerprint of the data.

A chunk (``chunk_docs`` consecutive documents of the unified index, see :mod:`dsgpt2.data.split`)
is the unit of work. :class:`StreamingChunks` fetches one with one query per collection, keeps
the documents of the requested split, tokenizes and packs them into blocks. :class:`DataSpec`
holds every setting that shapes the blocks; :func:`fingerprint` (of the collections, the tokenizer
and the spec) is what a checkpoint or a token cache is checked against.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dsgpt2.corpus.config import MongoConfig
from dsgpt2.data.packing import pack, pack_with_loss
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable
from dsgpt2.errors import CorpusError
from dsgpt2.tokenizer.bpe import load_tokenizer

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
    *,
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
    from dsgpt2.tokenizer.bpe import EOT, PAD

    tok = load_tokenizer(tokenizer_dir)
    eot, pad = tok.token_to_id(EOT), tok.token_to_id(PAD)
    if eot is None:
        raise CorpusError(
            f"{tokenizer_dir}: the tokenizer has no {EOT} token; train it with dsgpt2 vocab train"
        )
    if task == "conversation":
        from dsgpt2.data.conversation import speaker_ids

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


LAYOUT = 2  # how documents become chunks; another layout gives other batches


def fingerprint(config: MongoConfig, tokenizer_dir: Path, spec: DataSpec) -> dict[str, Any]:
    """What the batches depend on besides the corpus's size, which may grow (see
    :mod:`dsgpt2.data.table`); a checkpoint or cache made under another one is stale."""
    return {
        "layout": LAYOUT,
        "db": config.db,
        "collections": list(config.collections),
        "text_field": config.text_field,
        "tokenizer": tokenizer_digest(tokenizer_dir),
        **asdict(spec),
        # Only when set: the fingerprints of runs without a FILTER stay what they were.
        **({"filter": config.filter} if config.filter else {}),
    }


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
        corpus: the chunk table to read, or per-collection counts (then each collection's
            ``[0, count)``, see :meth:`ChunkTable.initial`).
        split: ``train``, ``val``, or ``all`` (every document, for evaluation).
        window: with counts, only the indices ``[lo, hi)`` of the collections laid end to end.
    """

    def __init__(
        self,
        config: MongoConfig,
        corpus: ChunkTable | Sequence[int],
        tokenizer_dir: Path,
        spec: DataSpec,
        split: str,
        window: tuple[int, int] | None = None,
    ) -> None:
        self.config = config
        if not isinstance(corpus, ChunkTable):
            corpus = ChunkTable.initial(config.collections, corpus, spec.chunk_docs, window)
        self.table = corpus
        self.tokenizer_dir = tokenizer_dir
        self.spec = spec
        self.split = split
        self._wrapper: Any = None
        self._tokenizer: Any = None
        self._speakers: dict[str, int] = {}
        self._pid = -1

    def __len__(self) -> int:
        return self.table.n_chunks

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_wrapper": None, "_tokenizer": None, "_pid": -1}

    def grown(self, table: ChunkTable) -> StreamingChunks:
        """This source over ``table`` (the same chunks and more)."""
        return StreamingChunks(self.config, table, self.tokenizer_dir, self.spec, self.split)

    def _ready(self) -> None:
        if self._pid != os.getpid():
            from dsgpt2.corpus.mongo import MongoWrapper

            if torch.utils.data.get_worker_info() is not None:
                # Each worker tokenizes one chunk at a time on one thread: several workers with a
                # thread pool each would fight the training step for the cores.
                os.environ["TOKENIZERS_PARALLELISM"] = "false"

            conversations = self.spec.task == "conversation"
            marks = self.table.marks
            self._wrapper = MongoWrapper(self.config, counts=marks, conversations=conversations)
            self._tokenizer = load_tokenizer(self.tokenizer_dir)
            if conversations:
                from dsgpt2.data.conversation import speaker_ids

                self._speakers = speaker_ids(self._tokenizer)
            self._pid = os.getpid()

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast: no character offsets, which packing never needs.
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def _documents(self, chunk: int) -> tuple[list[Any], dict[str, int]]:
        """The documents of ``chunk`` in this split, in idx order, and what was skipped (reason → n)."""
        self._ready()
        c, lo, hi = self.table.locate(chunk)
        local = np.arange(lo, hi)
        if self.split == "all":
            wanted = local
        else:
            train = split_mask(local, self.spec.tr_ratio, self.spec.seed, self.config.collections[c])
            wanted = local[train] if self.split == "train" else local[~train]
        # The wrapper indexes the collections laid end to end.
        offset = self._wrapper.offsets[c]
        lo, hi, wanted = lo + offset, hi + offset, wanted + offset
        before = dict(self._wrapper.skipped)
        if len(wanted) == 0:
            docs = []
        elif len(wanted) > (hi - lo) // 2:
            keep = set(wanted.tolist())
            docs = [d for d in self._wrapper.get_range(lo, hi) if d.index in keep]
        else:
            docs = self._wrapper.get_many(wanted.tolist())
        skipped = {k: v - before.get(k, 0) for k, v in self._wrapper.skipped.items() if v - before.get(k, 0)}
        return docs, skipped

    def __getitem__(self, chunk: int) -> Chunk:
        docs, skipped = self._documents(chunk)
        if self.spec.task != "conversation":
            blocks, last = pack(self._encode([d.text for d in docs]), self.spec.context, *self._ids())
            return Chunk(chunk, blocks, last, len(docs), skipped)
        from dsgpt2.data.conversation import encode_conversations

        ids, flags, unknown = encode_conversations(
            [d.text for d in docs], self._encode, self._speakers, self.spec.replies
        )
        if unknown:
            skipped["unknown_speaker"] = unknown
        blocks, loss, last = pack_with_loss(ids, flags, self.spec.context, *self._ids())
        return Chunk(chunk, blocks, last, len(ids), skipped, loss)

    def layout(self, chunk: int) -> dict[int, tuple[int, int]]:
        """Where each document packed into ``chunk`` lies in it: idx (local to its collection) →
        (first token, end) of its tokens and end-of-text in the chunk's blocks laid end to end.
        Documents of another split, left out or without usable text are absent."""
        docs, _ = self._documents(chunk)
        offset = self._wrapper.offsets[self.table.locate(chunk)[0]]
        if self.spec.task != "conversation":
            lengths = [len(ids) + 1 for ids in self._encode([d.text for d in docs])]
        else:
            from dsgpt2.data.conversation import encode_conversations

            lengths = []
            for d in docs:  # one at a time: a conversation with an unknown speaker is left out
                ids, _, _ = encode_conversations([d.text], self._encode, self._speakers, self.spec.replies)
                lengths.append(len(ids[0]) + 1 if ids else 0)
        out, at = {}, 0
        for d, n in zip(docs, lengths, strict=True):
            if n:
                out[d.index - offset] = (at, at + n)
                at += n
        return out

    def _ids(self) -> tuple[int, int]:
        return self.spec.eot, self.spec.pad
