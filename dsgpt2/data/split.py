"""Which documents train, which validate, and in what order each rank reads them. Pure functions.

The corpus (the unified index 0..N-1) is cut into chunks of ``chunk_docs``
consecutive documents. A document belongs to the training split when its
split draw is below ``tr_ratio``; the rest validate, and never train. Each
epoch, the chunks are shuffled from (seed, epoch), and rank r reads every
world-th chunk of that order: ranks read disjoint shards whose union is the
whole split, and the same seed gives the same batches. A reader's place is
three integers (epoch, chunks done, blocks taken from the current chunk). A run
resumed on another number of ranks first reads, dealt anew, what the ranks
before it left of their epochs (:func:`redeal`).
"""

from __future__ import annotations

import numpy as np

from dsgpt2.corpus.draws import uniform


def split_mask(indices: np.ndarray, tr_ratio: float, seed: int) -> np.ndarray:
    """True for the indices of the training split; the others validate."""
    if tr_ratio >= 1.0:
        return np.ones(len(indices), dtype=bool)
    return uniform(indices, seed, salt="split") < tr_ratio


def num_chunks(total: int, chunk_docs: int) -> int:
    return -(-total // chunk_docs)


def chunk_range(chunk: int, total: int, chunk_docs: int) -> tuple[int, int]:
    """The unified indices ``[lo, hi)`` of ``chunk``."""
    lo = chunk * chunk_docs
    return lo, min(lo + chunk_docs, total)
