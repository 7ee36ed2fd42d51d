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
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum())
    if total == 0:
        return np.empty((0, context), dtype=np.int32), 0
    n = -(-total // context)
    flat = np.full(n * context, pad, dtype=np.int32)
    pos = 0
    for d in docs:
        k = len(d)
        flat[pos : pos + k] = d
        flat[pos + k] = eot
        pos += k + 1
    last = total - (n - 1) * context
    return flat.reshape(n, context), last


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
