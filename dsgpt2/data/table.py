"""The chunk table: which documents a run trains on, cut into chunks, as the corpus grows. Pure.

A collection's trained range is ``[0, mark)``, its high-water mark in meta_info. The run starts with
one segment per collection, ``[0, mark)`` (generation 0); documents that arrive later form new
segments (generation 1, 2, ... one per growth the run takes in), appended to the table, so the
chunk ids and the order of everything already there never change. A chunk is ``chunk_docs``
consecutive documents of one segment (the last one of a segment may be shorter); its id is its
place in the table. Only ids, bounds and marks are kept: a table of 100M documents is a few
integers per collection and growth.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Segment:
    """Documents ``[lo, hi)`` of one collection, cut into chunks from ``first_chunk`` on."""

    collection: int  # place of the collection in the config's list
    lo: int
    hi: int
    generation: int
    first_chunk: int
    first_epoch: int = 0  # the first epoch whose order holds these chunks

    def chunks(self, chunk_docs: int) -> int:
        return -(-(self.hi - self.lo) // chunk_docs)


@dataclass(frozen=True)
class ChunkTable:
    """Every chunk a run knows, in segments; see the module docstring."""

    names: tuple[str, ...]
    chunk_docs: int
    segments: tuple[Segment, ...]

    @classmethod
    def initial(
        cls,
        names: Sequence[str],
        counts: Sequence[int],
        chunk_docs: int,
        window: tuple[int, int] | None = None,
    ) -> ChunkTable:
        """Generation 0: each collection's ``[0, count)``; ``window`` keeps only the indices
        ``[start, stop)`` of the collections laid end to end in config order."""
        segments: list[Segment] = []
        offset = first = 0
        for c, count in enumerate(counts):
            lo, hi = 0, count
            if window is not None:
                lo, hi = max(0, window[0] - offset), min(count, window[1] - offset)
            offset += count
            if hi > lo:
                seg = Segment(c, lo, hi, 0, first)
                segments.append(seg)
                first += seg.chunks(chunk_docs)
        return cls(tuple(names), chunk_docs, tuple(segments))

    @property
    def n_chunks(self) -> int:
        if not self.segments:
            return 0
        last = self.segments[-1]
        return last.first_chunk + last.chunks(self.chunk_docs)

    @property
    def generations(self) -> int:
        return 1 + max((s.generation for s in self.segments), default=0)

    @property
    def marks(self) -> tuple[int, ...]:
        """Per collection, the end of what the table holds (0 for none)."""
        out = [0] * len(self.names)
        for s in self.segments:
            out[s.collection] = max(out[s.collection], s.hi)
        return tuple(out)

    def _starts(self) -> list[int]:
        return [s.first_chunk for s in self.segments]

    def locate(self, chunk: int) -> tuple[int, int, int]:
        """(collection, lo, hi): the documents of ``chunk``, local to its collection."""
        if not 0 <= chunk < self.n_chunks:
            raise IndexError(f"chunk {chunk} is outside the table's {self.n_chunks} chunks")
        seg = self.segments[bisect_right(self._starts(), chunk) - 1]
        lo = seg.lo + (chunk - seg.first_chunk) * self.chunk_docs
        return seg.collection, lo, min(lo + self.chunk_docs, seg.hi)

    def chunk_of(self, collection: int, idx: int) -> int | None:
        """The chunk holding document ``idx`` of ``collection``; None when the table lacks it."""
        for s in self.segments:
            if s.collection == collection and s.lo <= idx < s.hi:
                return s.first_chunk + (idx - s.lo) // self.chunk_docs
        return None

    def collection_of(self, chunks: np.ndarray) -> np.ndarray:
        """The collection of each chunk id."""
        where = np.searchsorted(np.array(self._starts()), chunks, side="right") - 1
        return np.array([s.collection for s in self.segments], dtype=np.int64)[where]

    def chunks_of(self, generation: int, collections: Sequence[int] | None = None) -> np.ndarray:
        """The chunk ids of ``generation`` (of ``collections`` only, when given), ascending."""
        parts = [
            np.arange(s.first_chunk, s.first_chunk + s.chunks(self.chunk_docs), dtype=np.int64)
            for s in self.segments
            if s.generation == generation and (collections is None or s.collection in collections)
        ]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def first_epoch(self, generation: int, collections: Sequence[int]) -> int | None:
        for s in self.segments:
            if s.generation == generation and s.collection in collections:
                return s.first_epoch
        return None

    def growth(self, marks: Sequence[int]) -> list[tuple[int, int, int]]:
        """(collection, lo, hi) of the whole chunks that ``marks`` add beyond the table.

        Raises:
            ValueError: a mark below the table's (the collection shrank).
        """
        out = []
        for c, (mine, now) in enumerate(zip(self.marks, marks, strict=True)):
            if now < mine:
                raise ValueError(f"{self.names[c]}: {now} documents, fewer than the {mine} trained on")
            whole = (now - mine) // self.chunk_docs * self.chunk_docs
            if whole:
                out.append((c, mine, mine + whole))
        return out

    def grow(self, added: Sequence[tuple[int, int, int]], first_epochs: dict[int, int]) -> ChunkTable:
        """This table with ``added`` ((collection, lo, hi), see :meth:`growth`) as a new generation;
        ``first_epochs`` gives each collection's first epoch holding them (default 0)."""
        if not added:
            return self
        gen, first = self.generations, self.n_chunks
        segments = list(self.segments)
        for c, lo, hi in added:
            seg = Segment(c, lo, hi, gen, first, first_epochs.get(c, 0))
            segments.append(seg)
            first += seg.chunks(self.chunk_docs)
        return ChunkTable(self.names, self.chunk_docs, tuple(segments))

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "chunk_docs": self.chunk_docs,
            "segments": [asdict(s) for s in self.segments],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkTable:
        segments = tuple(Segment(**{k: int(v) for k, v in s.items()}) for s in data["segments"])
        return cls(tuple(data["names"]), int(data["chunk_docs"]), segments)
