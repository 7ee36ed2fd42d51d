"""Which documents train, which validate, and in what order each rank reads them. Pure functions.

The corpus (the unified index 0..N-1) is cut into chunks of ``chunk_docs``
consecutive documents. A document belongs to the training split when its
split draw is below ``tr_ratio``; the rest validate, and never train. Each
epoch, the chunks are shuffled from (seed, epoch), and rank r reads every
world-th chunk of that order: ranks read disjoint shards whose union is the
whole split, and the same seed gives the same batches. A reader's place is
three integers (epoch, chunks done, blocks taken from the current chunk).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dsgpt2.sampling import uniform


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


def epoch_order(n_chunks: int, seed: int, epoch: int) -> np.ndarray:
    """The chunk order of ``epoch``: a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n_chunks)


def rank_chunks(n_chunks: int, seed: int, epoch: int, rank: int, world: int) -> np.ndarray:
    """The chunks rank ``rank`` of ``world`` reads in ``epoch``, in order."""
    return epoch_order(n_chunks, seed, epoch)[rank::world]


def eval_chunks(n_chunks: int, rank: int, world: int) -> np.ndarray:
    """Validation reads chunks in their natural order, dealt round robin to the ranks."""
    return np.arange(n_chunks)[rank::world]


@dataclass
class Position:
    """Where a reader is: resume from here and the next block is the one a straight run reads."""

    epoch: int = 0
    chunk: int = 0  # chunks of this epoch fully consumed
    block: int = 0  # blocks already taken from the chunk at ``chunk``

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
