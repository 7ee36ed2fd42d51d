"""Which documents train and which validate, and how the corpus is cut into chunks. Pure functions.

A document belongs to the training split when its split draw (seed, index) is below ``tr_ratio``;
the rest validate, and never train. The unified index 0..N-1 is cut into chunks of ``chunk_docs``
consecutive documents, the unit every reader fetches.
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
