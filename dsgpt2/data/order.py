"""Which documents a training chunk holds in an epoch, and in what order its blocks go out. Pure.

A corpus is stored in the order it arrived (dump after dump, source after source), so neighbouring
documents are alike. Reading chunks of consecutive documents gives every step a few neighbours and
hundreds of steps in a row the same region of the corpus, which trains a worse model than the same
documents read in a random order. So under the ``spread`` order (the default), chunk ``c`` of epoch
``e`` holds documents drawn from all over its pool (the documents of its stream's collections that
came in the same generation, see :mod:`dsgpt2.data.table`): the pool's positions permuted by a keyed
pseudorandom permutation of (seed, stream, generation, epoch), cut into as many equal slices as the
pool has chunks. The permutation is computed, never stored (a Feistel network on the position's
bits, walked until it lands inside the pool), so a chunk costs O(its documents) in time and memory
at any corpus size, and any process finds any document's chunk (its inverse) without a list.
Reading a chunk is one ``$in`` query per collection it touches. Its documents are packed in the
permuted order (not idx order, which would put neighbours side by side again), and its blocks are
handed out in a shuffled order of (seed, epoch, chunk), so that a long document's blocks do not fill
a micro-batch. Every document of a pool is in exactly one chunk per epoch: each epoch reads every
training document once, whatever the number of ranks.

The ``ranges`` order is the one before: chunk ``c`` is ``chunk_docs`` consecutive documents, the
same in every epoch, one range query, blocks in their packed order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dsgpt2.data.table import ChunkTable, Segment

ORDERS = ("spread", "ranges")
ROUNDS = 6  # Feistel rounds: 4 already make a pseudorandom permutation; 6 leave a margin


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 in, out)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Permutation:
    """A keyed pseudorandom permutation of ``[0, n)``, computed on demand; ``inverse`` undoes it."""

    n: int
    key: tuple[int, ...]
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _half: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng([*self.key, 0xFE15])
        object.__setattr__(self, "_keys", rng.integers(0, 2**63, size=ROUNDS, dtype=np.uint64))
        # The network permutes 2 * half bits: the smallest even width holding n - 1, so that cycle
        # walking (re-applying it until the value falls in [0, n)) takes fewer than 4 tries on average.
        bits = max(2, int(self.n - 1).bit_length())
        object.__setattr__(self, "_half", (bits + 1) // 2)

    def _rounds(self, x: np.ndarray, forward: bool) -> np.ndarray:
        half, mask = np.uint64(self._half), np.uint64((1 << self._half) - 1)
        left, right = x >> half, x & mask
        keys = self._keys if forward else self._keys[::-1]
        with np.errstate(over="ignore"):
            for k in keys:
                if forward:
                    left, right = right, left ^ (_mix(right ^ k) & mask)
                else:
                    left, right = right ^ (_mix(left ^ k) & mask), left
        return (left << half) | right

    def _walk(self, x: np.ndarray, forward: bool) -> np.ndarray:
        y = self._rounds(x.astype(np.uint64), forward)
        out = y >= np.uint64(self.n)
        while out.any():
            y[out] = self._rounds(y[out], forward)
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The images of ``positions`` (each in ``[0, n)``)."""
        return self._walk(np.asarray(positions), True) if self.n > 1 else np.asarray(positions, np.int64)

    def inverse(self, images: np.ndarray) -> np.ndarray:
        """The positions whose images are ``images``."""
        return self._walk(np.asarray(images), False) if self.n > 1 else np.asarray(images, np.int64)


@dataclass(frozen=True)
class Pool:
    """The documents one stream took in with one generation: its segments laid end to end."""

    segments: tuple[Segment, ...]
    chunks: np.ndarray  # their chunk ids, ascending
    key: tuple[int, ...]  # (stream, generation): with the seed and the epoch, the permutation's key

    @property
    def size(self) -> int:
        return sum(s.hi - s.lo for s in self.segments)

    def bounds(self) -> np.ndarray:
        """Where each chunk's slice of the permuted pool starts (and, last, the end)."""
        n = len(self.chunks)
        return np.arange(n + 1, dtype=np.int64) * self.size // n

    def documents(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(collection, idx) of each pool position."""
        sizes = np.array([s.hi - s.lo for s in self.segments], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        seg = np.searchsorted(starts, positions, side="right") - 1
        los = np.array([s.lo for s in self.segments], dtype=np.int64)
        colls = np.array([s.collection for s in self.segments], dtype=np.int64)
        return colls[seg], los[seg] + positions - starts[seg]

    def position(self, collection: int, idx: int) -> int | None:
        at = 0
        for s in self.segments:
            if s.collection == collection and s.lo <= idx < s.hi:
                return at + idx - s.lo
            at += s.hi - s.lo
        return None


class ReadOrder:
    """Which documents each chunk of the run's table holds per epoch (see the module docstring).

    Args:
        table: the run's chunk table.
        streams: the collections read as one pool (mixture weights: one stream per collection).
        seed: the run's seed.
        order: ``spread`` or ``ranges``.
    """

    def __init__(self, table: ChunkTable, streams: Sequence[Sequence[int]], seed: int, order: str) -> None:
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: choose from {', '.join(ORDERS)}")
        self.table = table
        self.streams = [tuple(s) for s in streams]
        self.seed = seed
        self.order = order
        self._pools: dict[int, Pool] = {}  # by chunk id: small (a few per collection and growth)

    def _stream_of(self, collection: int) -> int:
        for s, members in enumerate(self.streams):
            if collection in members:
                return s
        raise ValueError(f"collection {collection} belongs to no stream of {self.streams}")

    def pool(self, chunk: int) -> Pool:
        """The pool that ``chunk`` is a slice of."""
        if chunk not in self._pools:
            c, _, _ = self.table.locate(chunk)
            seg = next(s for s in self.table.segments if s.collection == c and s.first_chunk <= chunk
                       < s.first_chunk + s.chunks(self.table.chunk_docs))  # fmt: skip
            s = self._stream_of(c)
            members = self.streams[s]
            segs = tuple(
                x for x in self.table.segments if x.generation == seg.generation and x.collection in members
            )
            pool = Pool(segs, self.table.chunks_of(seg.generation, members), (s, seg.generation))
            for k in pool.chunks.tolist():
                self._pools[k] = pool
        return self._pools[chunk]

    def permutation(self, pool: Pool, epoch: int) -> Permutation:
        return Permutation(pool.size, (self.seed, *pool.key, epoch))

    def documents(self, epoch: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(collection, idx) of the documents ``chunk`` holds in ``epoch``, in reading order."""
        if self.order == "ranges":
            c, lo, hi = self.table.locate(chunk)
            return np.full(hi - lo, c, dtype=np.int64), np.arange(lo, hi, dtype=np.int64)
        pool = self.pool(chunk)
        j = int(np.searchsorted(pool.chunks, chunk))
        bounds = pool.bounds()
        positions = self.permutation(pool, epoch)(np.arange(bounds[j], bounds[j + 1], dtype=np.int64))
        return pool.documents(positions)

    def chunk_of(self, epoch: int, collection: int, idx: int) -> int | None:
        """The chunk holding document ``idx`` of ``collection`` in ``epoch``; None when the table lacks it."""
        natural = self.table.chunk_of(collection, idx)
        if natural is None or self.order == "ranges":
            return natural
        pool = self.pool(natural)
        at = self.permutation(pool, epoch).inverse(np.array([pool.position(collection, idx)]))
        j = int(np.searchsorted(pool.bounds(), at[0], side="right")) - 1
        return int(pool.chunks[j])

    def block_order(self, epoch: int, chunk: int, blocks: int) -> np.ndarray | None:
        """The order in which a chunk's ``blocks`` go out (None: as packed)."""
        if self.order == "ranges" or blocks < 2:
            return None
        return np.random.default_rng([self.seed, epoch, chunk, 0xB10C]).permutation(blocks)
