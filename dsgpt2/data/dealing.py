"""In what order each rank reads the chunks, and where a reader is. Pure functions.

Each epoch of a stream (all collections, or one per collection with mixture weights), its chunks
are shuffled from (seed, epoch, generation), and rank r reads every world-th chunk of that order:
ranks read disjoint shards whose union is the whole split, and the same seed gives the same
batches. A reader's place in a stream is three integers (epoch, chunks done, blocks taken from the
current chunk) and a queue read first: what the ranks of a run with another number of ranks left
of their epochs (:func:`redeal`), and new documents dealt while training (:func:`take_in`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dsgpt2.data.table import ChunkTable

Stream = tuple[int, ...]  # the collections (places in the config's list) read as one pool


class ChunkOrders:
    """The chunk orders of a run: per stream and epoch, the same in every process.

    Without mixture weights all collections form one stream (shares follow their sizes); with
    weights each collection is a stream of its own, read at its weight's pace.
    """

    def __init__(self, table: ChunkTable, streams: Sequence[Stream], seed: int) -> None:
        self.table = table
        self.streams = [tuple(s) for s in streams]
        self.seed = seed
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def order(self, stream: int, epoch: int) -> np.ndarray:
        """The chunk order of ``epoch`` of ``stream``: each generation in its epochs, shuffled from
        (seed, epoch, generation), generations in the order they came."""
        key = (stream, epoch)
        if key not in self._orders:
            members, parts = self.streams[stream], []
            for g in range(self.table.generations):
                first = self.table.first_epoch(g, members)
                if first is None or first > epoch:
                    continue
                ids = self.table.chunks_of(g, members)
                rng = np.random.default_rng([self.seed, epoch, g, stream, 0x5EED])
                parts.append(ids[rng.permutation(len(ids))])
            self._orders[key] = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._orders[key]

    def rank_chunks(self, stream: int, epoch: int, rank: int, world: int) -> np.ndarray:
        """The chunks rank ``rank`` of ``world`` reads in ``epoch`` of ``stream``, in order."""
        return self.order(stream, epoch)[rank::world]

    def dealt(self, stream: int, generation: int) -> np.ndarray:
        """The order in which a generation taken in during the run is dealt to the ranks."""
        ids = self.table.chunks_of(generation, self.streams[stream])
        rng = np.random.default_rng([self.seed, generation, stream, 0xDEA1])
        return ids[rng.permutation(len(ids))]


def eval_chunks(table: ChunkTable, rank: int, world: int) -> np.ndarray:
    """Validation reads the chunks the run started with (generation 0), in their natural order,
    dealt round robin to the ranks: the same set at every evaluation, however the corpus grows."""
    return table.chunks_of(0)[rank::world]


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

    def describe(self) -> str:
        """Where reading goes on, as the log says it: after a resume on another number of ranks, first
        the chunks the saving ranks left unread, then the epoch the position names."""
        at = f"epoch {self.epoch}, chunk {self.chunk}, block {self.block}"
        if not self.queue:
            return at
        epochs = ", ".join(str(e) for e in sorted({e for e, _, _ in self.queue}))
        return f"first {len(self.queue)} chunk(s) of epoch {epochs} left unread, then {at}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Position:
        queue = [(int(e), int(c), int(s)) for e, c, s in data.get("queue", [])]
        return cls(int(data["epoch"]), int(data["chunk"]), int(data["block"]), queue)


def redeal(positions: Sequence[Position], order: Callable[[int], np.ndarray], world: int) -> list[Position]:
    """Positions for ``world`` ranks that finish what ``positions`` (one per rank of the run that
    saved them) left unread: every unread block exactly once, none read again.

    The leftovers of the epochs those ranks were in (whole chunks, and the rest of the chunks they
    were inside) are dealt round robin in the epochs' order; whole epochs follow, dealt to
    ``world`` ranks as usual. ``order(epoch)`` is the chunk order of an epoch of the stream.
    """
    old_world = len(positions)

    def place(epoch: int, chunk: int) -> int:
        found = np.flatnonzero(order(epoch) == chunk)
        # A chunk dealt during the epoch (growth taken in) is not in its order: after the rest.
        return int(found[0]) if len(found) else len(order(epoch)) + chunk

    left: list[tuple[int, int, int, int]] = []  # (epoch, place in the epoch's order, chunk, skip)
    for p in positions:
        for e, c, skip in p.queue:
            left.append((e, place(e, c), c, skip))
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


@dataclass
class ReadState:
    """One rank's place in the training data: what its checkpoint holds, and all it needs.

    ``streams`` has one :class:`Position` per stream; ``taken`` the tokens each stream gave since
    stage ``stage`` began (see :mod:`dsgpt2.data.mixture`); ``micro`` the micro-batches handed out.
    """

    streams: list[Position]
    taken: list[int] = field(default_factory=list)
    stage: int = 0
    micro: int = 0
    tokens: dict[int, int] = field(default_factory=dict)  # real tokens read, per collection

    @classmethod
    def start(cls, n_streams: int) -> ReadState:
        return cls([Position() for _ in range(n_streams)], [0] * n_streams)

    def copy(self) -> ReadState:
        return ReadState.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "streams": [p.to_dict() for p in self.streams],
            "taken": list(self.taken),
            "stage": self.stage,
            "micro": self.micro,
            "tokens": {str(c): n for c, n in self.tokens.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReadState:
        streams = [Position.from_dict(p) for p in data["streams"]]
        tokens = {int(c): int(n) for c, n in data.get("tokens", {}).items()}
        return cls(streams, [int(t) for t in data["taken"]], int(data["stage"]), int(data["micro"]), tokens)


def take_in(
    schedule: ChunkOrders,
    states: Sequence[ReadState],
    added: Sequence[tuple[int, int, int]],
    deal: bool,
) -> tuple[ChunkTable, list[dict[int, list[tuple[int, int, int]]]]]:
    """Take the new documents ``added`` ((collection, lo, hi) of whole chunks) into the run.

    They form the table's next generation, part of every epoch of their stream after the last one
    any rank has begun, so no epoch a rank reads changes. With ``deal``, they are also dealt now:
    shuffled and dealt round robin, each rank's share put at the head of its reading, read once
    in its current epoch.

    Args:
        states: every rank's state, in rank order, at the same step.

    Returns:
        The grown table, and per rank the queue entries ``{stream: [(epoch, chunk, 0), ...]}``.
    """
    table = schedule.table
    generation = table.generations
    first = {}
    for s, members in enumerate(schedule.streams):
        epoch = max(st.streams[s].epoch for st in states) + 1
        first.update({c: epoch for c in members})
    grown = table.grow(added, first)
    dealt: list[dict[int, list[tuple[int, int, int]]]] = [{} for _ in states]
    if deal and grown is not table:
        new = ChunkOrders(grown, schedule.streams, schedule.seed)
        for s in range(len(schedule.streams)):
            order = new.dealt(s, generation)
            for r, st in enumerate(states):
                mine = order[r :: len(states)]
                if len(mine):
                    dealt[r][s] = [(st.streams[s].epoch, int(c), 0) for c in mine]
    return grown, dealt


def redeal_states(schedule: ChunkOrders, states: Sequence[ReadState], world: int) -> list[ReadState]:
    """States for ``world`` ranks that finish, stream by stream, what ``states`` (one per rank of
    the run that saved them) left unread (see :func:`redeal`). The mixture's counters start
    afresh; the tokens read so far go to rank 0, so that their sum stays right."""
    per_stream = [
        redeal([st.streams[s] for st in states], functools.partial(schedule.order, s), world)
        for s in range(len(schedule.streams))
    ]
    tokens: dict[int, int] = {}
    for st in states:
        for c, n in st.tokens.items():
            tokens[c] = tokens.get(c, 0) + n
    return [
        ReadState(
            [per_stream[s][r] for s in range(len(schedule.streams))],
            [0] * len(schedule.streams),
            states[0].stage,
            states[0].micro,
            tokens if r == 0 else {},
        )
        for r in range(world)
    ]
