"""Packing documents into fixed-length training blocks. Pure numpy: no torch, no database.

A chunk's documents are concatenated end to end, each followed by the
end-of-text token, and cut into blocks of ``context`` tokens. A long document
runs on into the next blocks (nothing is truncated) and short ones share a
block. Only the last block of a chunk can be short; it is padded, and its
padding is masked out of the loss and the attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

IGNORE = -100  # the label value the loss skips (transformers' convention)


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
    pos = 0
    for d, flags in zip(docs, loss, strict=True):
        if len(flags) != len(d) + 1:
            raise ValueError(f"loss flags: expected {len(d) + 1}, got {len(flags)}")
        flat[pos : pos + len(flags)] = flags
        pos += len(flags)
    return blocks, flat.reshape(blocks.shape), last


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
