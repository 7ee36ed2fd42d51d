"""Training data sources: what a chunk of documents becomes, and the fingerprint of the data.

A chunk (``chunk_docs`` consecutive documents of the unified index, see :mod:`dsgpt2.data.split`)
is the unit of work. :class:`StreamingChunks` fetches one with one query per collection, keeps
the documents of the requested split, tokenizes and packs them into blocks. :class:`DataSpec`
holds every setting that shapes the blocks; :func:`fingerprint` (of the collections, the tokenizer
and the spec) is what a checkpoint or a token cache is checked against.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dsgpt2.data.order import ReadOrder
from dsgpt2.data.packing import (
    aligned_spans,
    lay_end_to_end,
    loss_flags,
    pack_flat,
    place_in_blocks,
    tokens_in_spans,
    tokens_per_block,
)
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.config import MongoConfig
from dsgpt2.errors import CorpusError
from dsgpt2.tokenizer.bpe import load_tokenizer, tokenizer_digest

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
    order: str = "spread"  # which documents a training chunk holds: see dsgpt2.data.order
    packing: str = "end_to_end"  # how training blocks are packed: see dsgpt2.data.packing

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
    order: str = "spread",
    packing: str = "end_to_end",
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
        context, chunk_docs, tr_ratio, seed, eot, eot if pad is None else pad, task, reply_speakers, order,
        packing,
    )  # fmt: skip


# How documents become chunks, per reading order: another layout gives other batches. Layout 2 is
# the ranges order, the only one before spread reading; its fingerprints are unchanged.
LAYOUTS = {"ranges": 2, "spread": 3}


def fingerprint(config: MongoConfig, tokenizer_dir: Path, spec: DataSpec) -> dict[str, Any]:
    """What the batches depend on besides the corpus's size, which may grow (see
    :mod:`dsgpt2.data.table`); a checkpoint or cache made under another one is stale."""
    settings = asdict(spec)
    order = settings.pop("order")  # said by the layout
    packing = settings.pop("packing")  # said only where it is not the default (and earlier runs')
    return {
        "layout": LAYOUTS[order],
        "db": config.db,
        "collections": list(config.collections),
        "text_field": config.text_field,
        "tokenizer": tokenizer_digest(tokenizer_dir),
        **settings,
        # Only when set: the fingerprints of runs without a FILTER stay what they were.
        **({"filter": config.filter} if config.filter else {}),
        **({"packing": packing} if packing != "end_to_end" else {}),
    }


def order_of(fp: dict[str, Any]) -> str | None:
    """The reading order a fingerprint records; None for a layout this version does not read."""
    return next((o for o, n in LAYOUTS.items() if n == fp.get("layout")), None)


def spec_of(fp: dict[str, Any]) -> DataSpec:
    """The data spec a fingerprint records."""
    from dataclasses import fields

    settings = {f.name: fp[f.name] for f in fields(DataSpec) if f.name in fp}
    return DataSpec(**settings, order=order_of(fp) or "spread")


@dataclass
class Chunk:
    """The packed blocks of one chunk of one split."""

    chunk: int
    blocks: np.ndarray  # (n, T) int32
    last: int  # real tokens in the last block
    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    loss: np.ndarray | None = None  # (n, T) bool: tokens the loss covers (None: all real ones)
    order: np.ndarray | None = None  # the order its blocks go out in training (None: as packed)
    shares: np.ndarray | None = None  # (n, C) real tokens of each collection in each block
    real: np.ndarray | None = None  # (n,) real tokens of each block, where others than the last have padding

    @property
    def valid(self) -> np.ndarray:
        """Real tokens per block: all of them but in the last (end to end), or as packed (``real``)."""
        if self.real is not None:
            return self.real
        v = np.full(len(self.blocks), self.blocks.shape[1], dtype=np.int64)
        if len(v):
            v[-1] = self.last
        return v


Key = int | tuple[int, int]  # a chunk of the table as it lies (evaluation, caching), or (epoch, chunk)


class Chunks:
    """Which documents a key names, of which split, in what order: what the streaming and cached
    sources share. A plain chunk id reads the chunk as it lies (consecutive documents, evaluation
    and caching); ``(epoch, chunk)`` reads it as training does in that epoch (:mod:`dsgpt2.data.order`)."""

    def __init__(self, table: ChunkTable, names: Sequence[str], spec: DataSpec, split: str,
                 streams: Sequence[Sequence[int]] | None) -> None:  # fmt: skip
        self.table = table
        self.names = tuple(names)
        self.spec = spec
        self.split = split
        self.streams = [tuple(s) for s in streams] if streams is not None else [tuple(range(len(names)))]
        self.reading = ReadOrder(table, self.streams, spec.seed, spec.order)

    def __len__(self) -> int:
        return self.table.n_chunks

    def spread(self, key: Key) -> bool:
        """Whether ``key`` reads documents from all over its pool (else a range of one collection)."""
        return isinstance(key, tuple) and self.spec.order == "spread"

    def chunk_id(self, key: Key) -> int:
        return int(key[1]) if isinstance(key, tuple) else int(key)

    @property
    def aligned(self) -> bool:
        """Whether blocks are packed BOS-aligned (``--packing bos``: training's; validation reads its
        blocks end to end whatever the packing, so that runs of either validate alike)."""
        return self.spec.packing == "bos" and self.split == "train"

    def pack(
        self, flat: np.ndarray, lengths: np.ndarray, loss: np.ndarray | None = None
    ) -> tuple[Chunk, Any]:
        """The blocks of documents of ``lengths`` (end-of-text included) laid end to end in ``flat`` (and
        their loss flags, ``loss``), as this split packs them: a :class:`Chunk` without its chunk id, and
        the documents' spans in them (None: end to end)."""
        context, pad = self.spec.context, self.spec.pad
        if not self.aligned:
            blocks, last = pack_flat(flat, context, pad)
            flags = None
            if loss is not None:
                flags = np.zeros(blocks.size, dtype=bool)
                flags[: len(loss)] = loss
                flags = flags.reshape(blocks.shape)
            return Chunk(-1, blocks, last, loss=flags), None
        spans, n = aligned_spans(lengths, context)
        blocks = place_in_blocks(flat, lengths, spans, n, context, fill=pad)
        flags = place_in_blocks(loss, lengths, spans, n, context, fill=False) if loss is not None else None
        real = tokens_in_spans(spans, np.zeros(len(spans), dtype=np.int64), context, n, 1)[:, 0]
        return Chunk(-1, blocks, int(real[-1]) if n else 0, loss=flags, real=real), spans

    def wanted(self, key: Key) -> tuple[np.ndarray, np.ndarray]:
        """(collection, idx) of the documents of this split that ``key`` reads, in reading order."""
        if self.spread(key):
            colls, idxs = self.reading.documents(*key)  # type: ignore[misc]
        else:
            c, lo, hi = self.table.locate(self.chunk_id(key))
            colls, idxs = np.full(hi - lo, c, dtype=np.int64), np.arange(lo, hi, dtype=np.int64)
        if self.split == "all" or len(idxs) == 0:
            return colls, idxs
        if len(self.names) == 1:
            keep = split_mask(idxs, self.spec.tr_ratio, self.spec.seed, self.names[0])
        else:
            keep = np.zeros(len(idxs), dtype=bool)
            for c in np.unique(colls).tolist():
                at = colls == c
                keep[at] = split_mask(idxs[at], self.spec.tr_ratio, self.spec.seed, self.names[c])
        if self.split == "val":
            keep = ~keep
        return colls[keep], idxs[keep]

    def finish(
        self,
        key: Key,
        item: Chunk,
        lengths: Sequence[int],
        colls: np.ndarray,
        spans: np.ndarray | None = None,
    ) -> Chunk:
        """``item`` with its training block order and its tokens per collection per block, from the
        packed documents' ``lengths`` (end-of-text included) and collections (and their ``spans`` in
        the blocks where they are not end to end)."""
        n = len(item.blocks)
        item.chunk = self.chunk_id(key)
        if isinstance(key, tuple):
            item.order = self.reading.block_order(int(key[0]), int(key[1]), n)
        if len(self.names) == 1:
            item.shares = item.valid[:, None]
        elif spans is not None:
            item.shares = tokens_in_spans(spans, colls, item.blocks.shape[1], n, len(self.names))
        else:
            item.shares = tokens_per_block(np.asarray(lengths, dtype=np.int64), colls, item.blocks.shape[1],
                                           len(self.names))  # fmt: skip
        return item


class ChunkSource(Dataset):
    """What the streaming and cached sources are alike in: items by chunk key, as many as the chunk
    table of their :class:`Chunks` has chunks."""

    chunks: Chunks

    @property
    def table(self) -> ChunkTable:
        return self.chunks.table

    def __len__(self) -> int:
        return self.table.n_chunks


class StreamingChunks(ChunkSource):
    """Chunks of a split, read from MongoDB and tokenized on demand (in a DataLoader worker).

    The wrapper and tokenizer are made lazily in the process that uses them. Items are asked by
    :data:`Key`: a chunk as it lies, or ``(epoch, chunk)`` as training reads it.

    Args:
        corpus: the chunk table to read, or per-collection counts (then each collection's
            ``[0, count)``, see :meth:`ChunkTable.initial`).
        split: ``train``, ``val``, or ``all`` (every document, for evaluation).
        window: with counts, only the indices ``[lo, hi)`` of the collections laid end to end.
        streams: the collections read as one pool (default: all of them).
    """

    def __init__(
        self,
        config: MongoConfig,
        corpus: ChunkTable | Sequence[int],
        tokenizer_dir: Path,
        spec: DataSpec,
        split: str,
        *,
        window: tuple[int, int] | None = None,
        streams: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.config = config
        if not isinstance(corpus, ChunkTable):
            corpus = ChunkTable.initial(config.collections, corpus, spec.chunk_docs, window)
        self.chunks = Chunks(corpus, config.collections, spec, split, streams)
        self.tokenizer_dir = tokenizer_dir
        self.spec = spec
        self.split = split
        self._wrapper: Any = None
        self._tokenizer: Any = None
        self._speakers: dict[str, int] = {}
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_wrapper": None, "_tokenizer": None, "_pid": -1}

    def grown(self, table: ChunkTable) -> StreamingChunks:
        """This source over ``table`` (the same chunks and more)."""
        return StreamingChunks(
            self.config, table, self.tokenizer_dir, self.spec, self.split, streams=self.chunks.streams
        )

    def close(self) -> None:
        """Close the client this process made (a worker's goes with its process)."""
        if self._wrapper is not None and self._pid == os.getpid():
            self._wrapper.connection.close()
        self._wrapper, self._pid = None, -1

    def _ready(self) -> None:
        if self._pid != os.getpid():
            from dsgpt2.db.wrapper import MongoWrapper

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

    def _documents(self, key: Key) -> tuple[list[Any], np.ndarray, dict[str, int]]:
        """The documents ``key`` reads of this split, in reading order, their collections, and what
        was skipped (reason → n)."""
        self._ready()
        colls, idxs = self.chunks.wanted(key)
        offsets = np.array(self._wrapper.offsets, dtype=np.int64)
        wanted = offsets[colls] + idxs  # the wrapper indexes the collections laid end to end
        before = dict(self._wrapper.skipped)
        if len(wanted) == 0:
            docs = []
        elif self.chunks.spread(key):
            docs = self._wrapper.get_many(wanted.tolist())  # $in per collection, in this order
        else:
            _, lo, hi = self.table.locate(self.chunks.chunk_id(key))
            lo, hi = lo + int(offsets[colls[0]]), hi + int(offsets[colls[0]])
            if len(wanted) > (hi - lo) // 2:
                keep = set(wanted.tolist())
                docs = [d for d in self._wrapper.get_range(lo, hi) if d.index in keep]
            else:
                docs = self._wrapper.get_many(wanted.tolist())
        skipped = {k: v - before.get(k, 0) for k, v in self._wrapper.skipped.items() if v - before.get(k, 0)}
        where = np.searchsorted(offsets, np.array([d.index for d in docs], dtype=np.int64), side="right") - 1
        return docs, where, skipped

    def _conversations(self, docs: list[Any]) -> tuple[list[list[int]], list[list[bool]], list[bool]]:
        """Each conversation's ids and loss flags, and which were kept (one without a speaker token
        is left out)."""
        from dsgpt2.data.conversation import encode_conversations

        ids, flags, _ = encode_conversations([d.text for d in docs], self._encode, self._speakers,
                                             self.spec.replies)  # fmt: skip
        kept = [all(t["speaker"] in self._speakers for t in d.text) for d in docs]
        return ids, flags, kept

    def __getitem__(self, key: Key) -> Chunk:
        docs, colls, skipped = self._documents(key)
        if self.spec.task != "conversation":
            ids = self._encode([d.text for d in docs])
            lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
            item, spans = self.chunks.pack(lay_end_to_end(ids, self.spec.eot), lengths)
            item.documents, item.skipped = len(docs), skipped
            return self.chunks.finish(key, item, lengths, colls, spans)
        ids, flags, kept = self._conversations(docs)
        if len(ids) < len(docs):
            skipped["unknown_speaker"] = len(docs) - len(ids)
        lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
        loss = loss_flags(ids, flags)
        item, spans = self.chunks.pack(lay_end_to_end(ids, self.spec.eot), lengths, loss)
        item.documents, item.skipped = len(ids), skipped
        return self.chunks.finish(key, item, lengths, colls[np.array(kept, dtype=bool)], spans)

    def document_tokens(self, chunk: int) -> DocTokens:
        """Every document of ``chunk`` as it lies (all splits), tokenized with its end-of-text: what
        the token cache files (a document without usable text has none)."""
        self._ready()
        c, lo, hi = self.table.locate(chunk)
        offset = self._wrapper.offsets[c]
        before = dict(self._wrapper.skipped)
        docs = self._wrapper.get_range(lo + offset, hi + offset)
        skipped = {k: v - before.get(k, 0) for k, v in self._wrapper.skipped.items() if v - before.get(k, 0)}
        lengths = np.zeros(hi - lo, dtype=np.int64)
        at = np.array([d.index - offset - lo for d in docs], dtype=np.int64)
        loss = None
        if self.spec.task != "conversation":
            ids = self._encode([d.text for d in docs])
        else:
            ids, flags, kept = self._conversations(docs)
            at = at[np.array(kept, dtype=bool)]
            loss = np.concatenate([np.asarray(f, dtype=bool) for f in flags]) if flags else np.zeros(0, bool)
        lengths[at] = [len(x) + 1 for x in ids]
        return DocTokens(chunk, lengths, lay_end_to_end(ids, self.spec.eot), loss, len(docs), skipped)

    def layout(self, key: Key) -> dict[tuple[int, int], tuple[int, int]]:
        """Where each document packed into ``key``'s chunk lies in it: (collection, idx) → (first
        token, end) of its tokens and end-of-text in the chunk's blocks laid end to end. Documents of
        another split, left out or without usable text are absent."""
        docs, colls, _ = self._documents(key)
        offsets = self._wrapper.offsets
        if self.spec.task != "conversation":
            lengths = [len(ids) + 1 for ids in self._encode([d.text for d in docs])]
        else:
            ids, _, kept = self._conversations(docs)
            it = iter(ids)
            lengths = [len(next(it)) + 1 if k else 0 for k in kept]
        if self.chunks.aligned:
            spans, _ = aligned_spans(np.asarray(lengths, dtype=np.int64), self.spec.context)
            placed = zip(docs, colls.tolist(), lengths, spans.tolist(), strict=True)
            return {(c, d.index - offsets[c]): (first, end) for d, c, n, (first, end) in placed if n}
        out, at = {}, 0
        for d, c, n in zip(docs, colls.tolist(), lengths, strict=True):
            if n:
                out[(c, d.index - offsets[c])] = (at, at + n)
                at += n
        return out

    def _ids(self) -> tuple[int, int]:
        return self.spec.eot, self.spec.pad


@dataclass
class DocTokens:
    """A chunk's documents (as it lies), tokenized for the token cache."""

    chunk: int
    lengths: np.ndarray  # (hi - lo,) tokens of each document, end-of-text included (0: none)
    flat: np.ndarray  # their tokens laid end to end
    loss: np.ndarray | None  # per token, whether the loss covers it (conversations)
    documents: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
