"""In what order each rank reads the chunks, and where a reader is. Pure functions.

Each epoch, the chunks are shuffled from (seed, epoch), and rank r reads every world-th chunk of
that order: ranks read disjoint shards whose union is the whole split, and the same seed gives the
same batches. A reader's place is three integers (epoch, chunks done, blocks taken from the current
chunk). A run resumed on another number of ranks first reads, dealt anew, what the ranks before it
left of their epochs (:func:`redeal`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


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
    # Read first: (epoch, chunk, blocks to skip) left over by a run with another number of ranks.
    queue: list[tuple[int, int, int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Position:
        queue = [(int(e), int(c), int(s)) for e, c, s in data.get("queue", [])]
        return cls(int(data["epoch"]), int(data["chunk"]), int(data["block"]), queue)


def redeal(positions: Sequence[Position], n_chunks: int, seed: int, world: int) -> list[Position]:
    """Positions for ``world`` ranks that finish what ``positions`` (one per rank of the run that
    saved them) left unread: every unread block exactly once, none read again.

    The leftovers of the epochs those ranks were in (whole chunks, and the rest of the chunks they
    were inside) are dealt round robin in the epochs' order; whole epochs follow, dealt to
    ``world`` ranks as usual.
    """
    old_world = len(positions)
    orders: dict[int, np.ndarray] = {}

    def order(epoch: int) -> np.ndarray:
        if epoch not in orders:
            orders[epoch] = epoch_order(n_chunks, seed, epoch)
        return orders[epoch]

    left: list[tuple[int, int, int, int]] = []  # (epoch, place in the epoch's order, chunk, skip)
    for p in positions:
        for e, c, skip in p.queue:
            left.append((e, int(np.flatnonzero(order(e) == c)[0]), c, skip))
    first, last = min(p.epoch for p in positions), max(p.epoch for p in positions)
    for e in range(first, last + 1):
        for r, p in enumerate(positions):
            if p.epoch > e:
                continue  # this rank read all of its share of epoch e
            mine = order(e)[r::old_world]
            start = p.chunk if p.epoch == e else 0
            for k in range(start, len(mine)):
                skip = p.block if p.epoch == e and k == p.chunk else 0
                left.append((e, r + k * old_world, int(mine[k]), skip))
    left.sort()
    shares = [left[rank::world] for rank in range(world)]
    return [Position(last + 1, 0, 0, [(e, c, skip) for e, _, c, skip in share]) for share in shares]
