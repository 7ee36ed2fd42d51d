"""Which documents a training chunk holds in an epoch, and in what order its blocks go out. Pure.

A corpus is stored in the order it arrived (dump after dump, source after source), so neighbouring
documents are alike. Reading chunks of consecutive documents gives every step a few neighbours and
hundreds of steps in a row the same region of the corpus, which trains a worse model than the same
documents read in a random order. So under the ``spread`` order (the default), chunk ``c`` of epoch
``e`` holds documents drawn from all over its pool (the documents of its stream's collections that
came in the same generation, see :mod:`dsgpt2.data.table`): the pool's positions permuted by a keyed
pseudorandom permutation of (seed, stream, generation, epoch), cut into as many equal ranges as the
pool has chunks. The permutation is computed, never stored (a Feistel network on the bits of a
power of two under twice the pool; a chunk takes the pool's documents among the images of its range
of positions), so a chunk costs O(its documents) in time and memory at any corpus size, and any
process finds any document's chunk (the network run backwards) without a list.
Reading a chunk is one ``$in`` query per collection it touches (on the embedded engine, short lists:
:meth:`~dsgpt2.db.wrapper.MongoWrapper.get_many`). Its documents are packed in the
permuted order (not idx order, which would put neighbours side by side again), and its blocks are
handed out in a shuffled order of (seed, epoch, chunk), so that a long document's blocks do not fill
a micro-batch. Every document of a pool is in exactly one chunk per epoch: each epoch reads every
training document once, whatever the number of ranks.

The ``ranges`` order is the one before: chunk ``c`` is ``chunk_docs`` consecutive documents, the
same in every epoch, one range query, blocks in their packed order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from dsgpt2.corpus.draws import uniform
from dsgpt2.data.table import ChunkTable, Segment
from dsgpt2.hashing import splitmix64

ORDERS = ("spread", "ranges")
ROUNDS = 4  # Feistel rounds: four make a pseudorandom permutation (Luby and Rackoff)


def _digest(key: tuple[object, ...]) -> int:
    """A 64-bit key of a tuple of ints and names, the same in every process and version."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class Permutation:
    """A keyed pseudorandom permutation of ``[0, 2**bits)``, the smallest power of two holding
    ``[0, n)``: computed on demand, never stored. Read in order and left out where ``>= n``, a range
    of its positions gives values of ``[0, n)``, and its ranges cut ``[0, n)`` into disjoint
    random sets (of sizes within a little of the ranges' share of n: the domain is under 2 n)."""

    n: int
    key: tuple[int, ...]
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    bits: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        keys = [_digest((*self.key, "round", r)) for r in range(ROUNDS)]
        object.__setattr__(self, "_keys", np.array(keys, dtype=np.uint64))
        object.__setattr__(self, "bits", max(2, int(self.n - 1).bit_length()))

    @property
    def domain(self) -> int:
        return 1 << self.bits

    def _rounds(self, x: np.ndarray, forward: bool) -> np.ndarray:
        # An unbalanced Feistel network on exactly `bits` bits: the halves trade widths each round
        # (an even number of rounds gives them back), so no value leaves the domain.
        wide = [self.bits // 2, self.bits - self.bits // 2]  # (left, right) widths
        left, right = x >> np.uint64(wide[1]), x & np.uint64((1 << wide[1]) - 1)
        keys = self._keys if forward else self._keys[::-1]
        with np.errstate(over="ignore"):
            for k in keys:
                if forward:  # (L, R) -> (R, L ^ F(R)): L's width moves right
                    mask = np.uint64((1 << wide[0]) - 1)
                    left, right = right, left ^ (splitmix64(right ^ k) & mask)
                else:  # undo: (L', R') = (R, L ^ F(R)) -> (R' ^ F(L'), L')
                    mask = np.uint64((1 << wide[1]) - 1)
                    left, right = right ^ (splitmix64(left ^ k) & mask), left
                wide.reverse()
        return (left << np.uint64(wide[1])) | right

    def take(self, lo: int, hi: int) -> np.ndarray:
        """The values of ``[0, n)`` at positions ``[lo, hi)`` of the permutation, in order."""
        images = self._rounds(np.arange(lo, hi, dtype=np.uint64), True).astype(np.int64)
        return images[images < self.n]

    def position(self, values: np.ndarray) -> np.ndarray:
        """Where each of ``values`` (in ``[0, n)``) lies in the permutation."""
        return self._rounds(np.asarray(values, dtype=np.uint64), False).astype(np.int64)


@dataclass(frozen=True)
class Pool:
    """The documents one stream took in with one generation: its segments laid end to end."""

    segments: tuple[Segment, ...]
    chunks: np.ndarray  # their chunk ids, ascending
    key: tuple[int, ...]  # (stream, generation): with the seed and the epoch, the permutation's key

    @property
    def size(self) -> int:
        return sum(s.hi - s.lo for s in self.segments)

    def bounds(self, domain: int) -> np.ndarray:
        """Where each chunk's range of a permutation of ``domain`` positions starts (and the end)."""
        n = len(self.chunks)
        return np.arange(n + 1, dtype=np.int64) * domain // n

    def documents(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(collection, idx) of each pool position."""
        if len(self.segments) == 1:
            seg = self.segments[0]
            return np.full(len(positions), seg.collection, dtype=np.int64), seg.lo + positions
        sizes = np.array([s.hi - s.lo for s in self.segments], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        where = np.searchsorted(starts, positions, side="right") - 1
        los = np.array([s.lo for s in self.segments], dtype=np.int64)
        colls = np.array([s.collection for s in self.segments], dtype=np.int64)
        return colls[where], los[where] + positions - starts[where]

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
        self._perms: dict[tuple[int, ...], Permutation] = {}

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
        key = (self.seed, *pool.key, epoch)
        if key not in self._perms:
            if len(self._perms) >= 64:  # a reader is in one or two epochs at a time
                self._perms.clear()
            self._perms[key] = Permutation(pool.size, key)
        return self._perms[key]

    def documents(self, epoch: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(collection, idx) of the documents ``chunk`` holds in ``epoch``, in reading order."""
        if self.order == "ranges":
            c, lo, hi = self.table.locate(chunk)
            return np.full(hi - lo, c, dtype=np.int64), np.arange(lo, hi, dtype=np.int64)
        pool = self.pool(chunk)
        j = int(np.searchsorted(pool.chunks, chunk))
        perm = self.permutation(pool, epoch)
        bounds = pool.bounds(perm.domain)
        return pool.documents(perm.take(int(bounds[j]), int(bounds[j + 1])))

    def chunk_of(self, epoch: int, collection: int, idx: int) -> int | None:
        """The chunk holding document ``idx`` of ``collection`` in ``epoch``; None when the table lacks it."""
        natural = self.table.chunk_of(collection, idx)
        if natural is None or self.order == "ranges":
            return natural
        pool = self.pool(natural)
        perm = self.permutation(pool, epoch)
        at = perm.position(np.array([pool.position(collection, idx)]))
        j = int(np.searchsorted(pool.bounds(perm.domain), at[0], side="right")) - 1
        return int(pool.chunks[j])

    def block_order(self, epoch: int, chunk: int, blocks: int) -> np.ndarray | None:
        """The order in which a chunk's ``blocks`` go out (None: as packed)."""
        if self.order == "ranges" or blocks < 2:
            return None
        return np.argsort(
            uniform(np.arange(blocks), _digest((self.seed, epoch, chunk)), "blocks"), kind="stable"
        )
