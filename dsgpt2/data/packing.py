"""Packing documents into fixed-length training blocks. Pure numpy: no torch, no database.

``end_to_end`` (the default): a chunk's documents are concatenated end to end, each followed by the
end-of-text token, and cut into blocks of ``context`` tokens. A long document runs on into the next
blocks (nothing is truncated) and short ones share a block. Only the last block of a chunk can be short;
it is padded, and its padding is masked out of the loss and the attention.

``bos`` (:func:`aligned_spans`, nanochat's BOS-aligned packing without its cropping): every document
starts a block or follows whole documents in one, so the model sees each short document from its first
token. A long document fills whole blocks from its first token, its tail opens the block after them;
the short ones are fitted best-first (the longest first, each into the block with the least room that
holds it) into the room the tails leave, and into new blocks. Nothing is truncated: each block's unused
end is padding, masked out as the last block's is.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

IGNORE = -100  # the label value the loss skips (transformers' convention)
PACKINGS = ("end_to_end", "bos")  # --packing


def aligned_spans(lengths: np.ndarray, context: int) -> tuple[np.ndarray, int]:
    """BOS-aligned places (``bos``: see the module doc) of documents of ``lengths`` (end-of-text
    included; 0: a document without tokens).

    Returns:
        ``(spans, n)``: ``(len(lengths), 2)`` int64, each document's first token and end in the ``n``
        blocks laid end to end (a document of length 0: an empty span), each document's tokens
        contiguous there.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    spans = np.zeros((len(lengths), 2), dtype=np.int64)
    room: list[tuple[int, int]] = []  # (free tokens, block) of the blocks with room, sorted
    n = 0
    for d in np.flatnonzero(lengths >= context).tolist():  # long ones: whole blocks, then the tail
        length = int(lengths[d])
        spans[d] = (n * context, n * context + length)
        n += -(-length // context)
        if length % context:
            bisect.insort(room, (context - length % context, n - 1))
    short = np.flatnonzero((lengths > 0) & (lengths < context))
    for d in short[np.argsort(-lengths[short], kind="stable")].tolist():  # longest first
        length = int(lengths[d])
        at = bisect.bisect_left(room, (length, -1))  # the least room that holds it
        if at < len(room):
            free, block = room.pop(at)
        else:
            free, block, n = context, n, n + 1
        first = block * context + context - free
        spans[d] = (first, first + length)
        if free > length:
            bisect.insort(room, (free - length, block))
    return spans, n


def place_in_blocks(
    flat: np.ndarray, lengths: np.ndarray, spans: np.ndarray, n: int, context: int, *, fill: Any
) -> np.ndarray:
    """``(n, context)``: the documents laid end to end in ``flat`` (each of ``lengths``) put at their
    ``spans`` (:func:`aligned_spans`), ``fill`` elsewhere."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.full(n * context, fill, dtype=flat.dtype)
    starts = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    out[np.repeat(spans[:, 0] - starts, lengths) + np.arange(total, dtype=np.int64)] = flat[:total]
    return out.reshape(n, context)


def tokens_in_spans(spans: np.ndarray, groups: np.ndarray, context: int, n: int, n_groups: int) -> np.ndarray:
    """``(n, n_groups)``: how many of each block's tokens come from documents of each group, for
    documents at ``spans`` (first token, end) in ``n`` blocks laid end to end."""
    out = np.zeros((n + 1, n_groups), dtype=np.int64)
    if n == 0:
        return out[:0]
    first, end = spans[:, 0], spans[:, 1]
    keep = end > first
    first, end, groups = first[keep], end[keep], np.asarray(groups, dtype=np.int64)[keep]
    fb, lb = first // context, (end - 1) // context
    one = fb == lb
    np.add.at(out, (fb[one], groups[one]), (end - first)[one])
    many = ~one
    np.add.at(out, (fb[many], groups[many]), ((fb + 1) * context - first)[many])
    np.add.at(out, (lb[many], groups[many]), (end - lb * context)[many])
    middle = np.zeros_like(out)  # the whole blocks between: +context from fb + 1 up to lb
    np.add.at(middle, (fb[many] + 1, groups[many]), context)
    np.add.at(middle, (lb[many], groups[many]), -context)
    return (out + np.cumsum(middle, axis=0))[:n]


def pack(docs: Sequence[Sequence[int]], context: int, eot: int, pad: int) -> tuple[np.ndarray, int]:
    """Pack tokenized documents into blocks.

    Args:
        docs: token ids of each document, in order.
        context: block length in tokens.
        eot: the end-of-text id appended to every document.
        pad: the id that fills the tail of the last block.

    Returns:
        ``(blocks, last_len)``: an ``(n, context)`` int32 array, and how many tokens of
        the last block are real (``context`` when it is full; 0 when there is no block).
    """
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    return pack_flat(lay_end_to_end(docs, eot), context, pad)


def lay_end_to_end(docs: Sequence[Sequence[int]], eot: int) -> np.ndarray:
    """The documents' tokens one after the other, each followed by ``eot`` (int32)."""
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    flat = np.full(int(lengths.sum()), eot, dtype=np.int32)
    pos = 0
    for d in docs:
        flat[pos : pos + len(d)] = d
        pos += len(d) + 1
    return flat


def pack_flat(flat: np.ndarray, context: int, pad: int) -> tuple[np.ndarray, int]:
    """:func:`pack` of documents already laid end to end, each with its end-of-text (``flat``)."""
    total = len(flat)
    if total == 0:
        return np.empty((0, context), dtype=np.int32), 0
    n = -(-total // context)
    out = np.full(n * context, pad, dtype=np.int32)
    out[:total] = flat
    return out.reshape(n, context), total - (n - 1) * context


def tokens_per_block(lengths: np.ndarray, groups: np.ndarray, context: int, n_groups: int) -> np.ndarray:
    """``(n_blocks, n_groups)``: how many of each block's tokens come from documents of each group
    (a document's collection), for documents of ``lengths`` (end-of-text included) packed in order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    n = -(-total // context)
    if n == 0:
        return np.zeros((0, n_groups), dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # before[k, g]: tokens of group g in the documents before document k.
    before = np.zeros((len(lengths) + 1, n_groups), dtype=np.int64)
    np.add.at(before[1:], (np.arange(len(lengths)), np.asarray(groups, dtype=np.int64)), lengths)
    before = np.cumsum(before, axis=0)
    edges = np.minimum(np.arange(n + 1, dtype=np.int64) * context, total)  # block boundaries
    k = np.searchsorted(ends, edges, side="right")  # documents wholly before each boundary
    upto = before[k].copy()  # tokens of each group in [0, edge)
    inside = k < len(lengths)
    rows = np.flatnonzero(inside)
    part = edges[rows] - starts[k[rows]]
    np.add.at(upto, (rows, np.asarray(groups, dtype=np.int64)[k[rows]]), np.maximum(part, 0))
    return np.diff(upto, axis=0)


def pack_with_loss(
    docs: Sequence[Sequence[int]], loss: Sequence[Sequence[bool]], context: int, eot: int, pad: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`pack`, carrying a per-token loss flag along (``len(loss[i]) == len(docs[i]) + 1``,
    the last flag for the end-of-text token).

    Returns:
        ``(blocks, loss_mask, last_len)``: the mask is ``(n, context)`` bool, False on padding.
    """
    blocks, last = pack(docs, context, eot, pad)
    flat = np.zeros(blocks.size, dtype=bool)
    flags = loss_flags(docs, loss)
    flat[: len(flags)] = flags
    return blocks, flat.reshape(blocks.shape), last


def loss_flags(docs: Sequence[Sequence[int]], loss: Sequence[Sequence[bool]]) -> np.ndarray:
    """The per-token loss flags of ``docs`` laid end to end (``len(loss[i]) == len(docs[i]) + 1``, the
    last flag for the end-of-text token)."""
    for d, flags in zip(docs, loss, strict=True):
        if len(flags) != len(d) + 1:
            raise ValueError(f"loss flags: expected {len(d) + 1}, got {len(flags)}")
    if not loss:
        return np.zeros(0, dtype=bool)
    return np.concatenate([np.asarray(f, dtype=bool) for f in loss])


def labels_and_mask(
    blocks: np.ndarray, valid: np.ndarray, loss: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Labels (input ids, ``IGNORE`` on padding) and attention mask for ``blocks``.

    Args:
        blocks: ``(B, T)`` token ids.
        valid: ``(B,)`` how many leading tokens of each block are real.
        loss: ``(B, T)`` which tokens the loss covers (default: every real one).
    """
    positions = np.arange(blocks.shape[1])[None, :]  # (1, T)
    mask = positions < valid[:, None]  # (B, T)
    labels = np.where(mask if loss is None else mask & loss, blocks, IGNORE)
    return labels.astype(np.int64), mask.astype(np.int64)
