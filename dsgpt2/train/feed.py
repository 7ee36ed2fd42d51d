"""The run's data feed: which chunks it trains on, in what order, and how it takes in growth.

The feed holds the chunk table (:mod:`dsgpt2.data.table`), the schedule over its streams, the
datasets, and this rank's :class:`~dsgpt2.data.dealing.ReadState`. A fresh run starts at the
collections' marks; a resumed one from its checkpoint's table, after checking that the prefix it
trained on still holds. Documents past the table's marks are taken in at resume (from the next
epoch, or at once with ``--follow``) and, with ``--follow N``, every N steps while training.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.collective import Rounds, barrier, gather, on_rank0, raise_shared
from dsgpt2.data.cache import CachedChunks, prepare_cache
from dsgpt2.data.dealing import ChunkOrders, ReadState, Stream, redeal_states, take_in
from dsgpt2.data.mixture import Stage, mixture_stages
from dsgpt2.data.ramp import BatchRamp
from dsgpt2.data.sources import SPLITS, DataSpec, StreamingChunks
from dsgpt2.data.table import ChunkTable
from dsgpt2.db.client import Connection
from dsgpt2.db.config import MongoConfig
from dsgpt2.errors import ConfigError, CorpusError, DsGpt2Error
from dsgpt2.train.config import DataOptions

log = logging.getLogger("dsgpt2.train.feed")


def corpus_marks(
    mongo: MongoConfig, conn: Connection, allow_problems: bool, full_check: bool = False
) -> tuple[int, ...]:
    """The documents of each collection a run may read, once the corpus passed its check (unless
    ``allow_problems``): the quick one (index and meta_info), or every document with
    ``full_check``. Read on rank 0, whose verdict and counts every rank takes."""
    from dsgpt2.db.client import require_collections
    from dsgpt2.db.validate import require_valid
    from dsgpt2.db.wrapper import MongoWrapper

    if allow_problems:
        require_collections(conn)  # absent is no problem to train past: there would be nothing to read
    else:
        try:
            anyway = ", or train on it anyway with --allow_corpus_problems (the bad documents are skipped)"
            require_valid(conn, full=full_check, override=anyway)
        except CorpusError:
            # A missing collection reads as an empty one: its own answer, asked only when one is wrong
            # (start-up asks the server nothing more than the check's indexes and meta_info).
            require_collections(conn)
            raise
    return tuple(MongoWrapper(mongo, connection=conn).counts)


def streams_of(n_collections: int, stages: list[Stage]) -> list[Stream]:
    """One pooled stream, or one per collection when the run has mixture weights."""
    return [(c,) for c in range(n_collections)] if stages else [tuple(range(n_collections))]


@dataclass(frozen=True)
class FeedSettings:
    """What the feed is told of the run: its data options, and the few other settings it reads."""

    data: DataOptions
    vocab_dir: Path  # the tokenizer as this node reads it (its copy of one kept in a store)
    cache_dir: Path  # the token cache of --data_mode cached (--cache_dir, else WORKSPACE/cache)
    ckpt_dir: Path  # named in meta_info's note of how far the run has read
    # --dist_timeout: ranks waiting for the token cache's builders check on them well within it.
    dist_timeout: int = 600


class Feed:
    """See the module docstring. Build with :meth:`start` (every rank, the same arguments).

    Args:
        settings: the run's data options and what else the feed reads (:class:`FeedSettings`).
        mongo, conn: the corpus's connection config, and a connection to it.
        spec: the blocks the run reads (the data fingerprint's settings).
        rank, world: this rank among the run's ranks.
    """

    def __init__(
        self,
        settings: FeedSettings,
        mongo: MongoConfig,
        conn: Connection,
        spec: DataSpec,
        *,
        rank: int,
        world: int,
    ) -> None:
        self.settings = settings
        self.mongo = mongo
        self.conn = conn
        self.spec = spec
        self.rank = rank
        self.world = world
        self.stages = mixture_stages(mongo.weights, settings.data.mixture, mongo.collections)
        self.streams = streams_of(len(mongo.collections), self.stages)
        self._prefix: tuple[tuple[int, ...], dict[str, Any]] | None = None
        # Every growth the run took in: {"step", "added": {collection: documents}, "at": resume|follow}.
        self.growth: list[dict[str, Any]] = []
        # The table's marks before and after the growth taken in at resume; None when none came.
        self.resume_growth: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        # The launches that led to this run's checkpoints, and the micro-batches skipped as non-finite:
        # with the growth, all a replay of the run's reading needs (dsgpt2 lineage).
        self.launches: list[dict[str, Any]] = []
        self.skipped_micro: list[int] = []

    def start(self, marks: tuple[int, ...], saved: dict[str, Any] | None) -> None:
        """The table, schedule, datasets and this rank's state: fresh at ``marks``, or from the
        checkpoint's ``saved`` data state with what came since taken in."""
        seed, names = self.settings.data.seed, self.mongo.collections
        if saved is None:
            self.schedule = ChunkOrders(
                ChunkTable.initial(names, marks, self.spec.chunk_docs), self.streams, seed
            )
            states = [ReadState.start(len(self.streams)) for _ in range(self.world)]
        else:
            self.schedule = ChunkOrders(ChunkTable.from_dict(saved["table"]), self.streams, seed)
            self.growth = list(saved.get("growth", []))
            self.launches = list(saved.get("launches", []))
            self.skipped_micro = list(saved.get("skipped_micro", []))
            states = [ReadState.from_dict(d) for d in saved["ranks"]]
            if len(states) != self.world:
                states = redeal_states(self.schedule, states, self.world)
            added = self.schedule.table.growth(marks)
            if added:
                table, dealt = take_in(self.schedule, states, added, deal=self.settings.data.follow > 0)
                for state, mine in zip(states, dealt, strict=True):
                    for s, items in mine.items():
                        state.streams[s].queue.extend(items)
                before = self.schedule.table.marks
                self.schedule = ChunkOrders(table, self.streams, seed)
                self.resume_growth = (before, self.schedule.table.marks)
                self._log_growth(added, "now" if self.settings.data.follow else "from the next epoch")
        self._check_enough_chunks()
        self.state = states[self.rank]
        self.train_data, self.val_data = self._datasets()
        self._note_prefix()

    def _check_enough_chunks(self) -> None:
        """Every rank reads whole chunks of every stream each epoch: a stream needs one per rank."""
        table = self.schedule.table
        for members in self.streams:
            n = sum(len(table.chunks_of(g, members)) for g in range(table.generations))
            if n < self.world:
                docs = sum(table.marks[c] for c in members)
                what = ", ".join(self.mongo.collections[c] for c in members)
                if not docs:
                    name = what if len(members) == 1 else "NAME"
                    raise ConfigError(
                        f"{what}: no document to train on; ingest some first (dsgpt2 ingest --collection "
                        f"{name} FILE...), or leave it out of the connection config's COLLECTIONS"
                    )
                size = self.spec.chunk_docs
                raise ConfigError(
                    f"{what}: {docs} documents make {n} chunk(s) of --chunk_docs {size}, fewer than the "
                    f"{self.world} ranks that each read one per epoch; lower --chunk_docs (at most "
                    f"{max(1, docs // self.world)})"
                    + (" or drop the collection's weight" if self.stages else "")
                )

    def _datasets(self) -> tuple[Any, Any]:
        d, table = self.settings.data, self.schedule.table
        if d.data_mode == "streaming":
            return tuple(
                StreamingChunks(
                    self.mongo, table, self.settings.vocab_dir, self.spec, s, streams=self.streams
                )
                for s in SPLITS
            )
        cache_dir = self.settings.cache_dir
        self._prepare_caches(cache_dir, table)
        return tuple(CachedChunks(cache_dir, s, table, self.streams, self.spec.packing) for s in SPLITS)

    def _prepare_caches(self, cache_dir: Path, table: ChunkTable) -> None:
        """Make every rank's ``cache_dir`` hold the table's chunks: one builder per directory,
        whether the nodes share it or each has its own (node-local disks); every rank waits.

        Which ranks share a directory is found out, not assumed from the launch: each rank leaves a
        file named for this call and its rank there, then looks each rank's name up (a lookup by
        name, which a network file system answers from the server); the lowest rank that sees its
        own builds. A builder's user error is raised on every rank. While builders work, every
        rank stays in touch (:class:`Rounds`): a builder that dies is noticed within --dist_timeout.
        """
        d = self.settings.data
        call = on_rank0(lambda: uuid.uuid4().hex)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            probe = cache_dir / f".rank-{call}-{self.rank}"
            probe.touch()
        except OSError as exc:
            raise ConfigError(f"--cache_dir {cache_dir}: cannot write there ({exc.strerror})") from None
        barrier()
        sharing = [r for r in range(self.world) if (cache_dir / f".rank-{call}-{r}").exists()]
        outcome: tuple[str, str] | str | None = None
        rounds = Rounds(every=min(5.0, self.settings.dist_timeout / 4))
        if sharing[0] == self.rank:
            try:
                meta, added = prepare_cache(
                    self.mongo, self.settings.vocab_dir, self.spec, cache_dir, d.num_workers,
                    table=table, tick=rounds.tick,
                )  # fmt: skip
                state = f"{added} chunk(s) tokenized and added" if added else "up to date, reused"
                outcome = f"{state} ({meta['chunks']} chunks)"
            except DsGpt2Error as exc:
                outcome = (type(exc).__name__, str(exc))
        outcomes = rounds.finish(outcome)
        probe.unlink(missing_ok=True)
        raise_shared(next((o for o in outcomes if isinstance(o, tuple)), None))
        builders = [r for r, o in enumerate(outcomes) if o is not None]
        log.info(
            "token cache %s: %s; %d cache director%s, built by rank%s %s",
            cache_dir, outcomes[0], len(builders), "y" if len(builders) == 1 else "ies",
            "" if len(builders) == 1 else "s", ", ".join(map(str, builders)),
        )  # fmt: skip

    def follow(self, marks: tuple[int, ...], states: list[ReadState]) -> dict[int, list[Any]] | None:
        """Take in what ``marks`` add (whole chunks), dealt at once; ``states``: every rank's, now.
        Returns this rank's dealt chunks per stream, or None when nothing came."""
        try:
            added = self.schedule.table.growth(marks)
        except ValueError as exc:
            log.warning("not taking in new documents: %s", exc)
            return None
        if not added:
            return None
        table, dealt = take_in(self.schedule, states, added, deal=True)
        self.schedule = ChunkOrders(table, self.streams, self.settings.data.seed)
        self._log_growth(added, "now")
        self._note_prefix()
        if self.settings.data.data_mode == "streaming":
            self.train_data = self.train_data.grown(table)
        else:
            self.train_data, _ = self._datasets()
        return dealt[self.rank]

    def note_launch(self, step: int, micro: int, micro_batch: int, ramp: BatchRamp) -> None:
        """Record in the run's history (kept in every checkpoint after) that a launch of ``world``
        ranks starts at ``step``, how it reads (``ramp``: its micro-batches per step), and whether it
        deals growth at once."""
        self.launches.append({
            "step": step, "micro": micro, "world": self.world, "micro_batch": micro_batch,
            "grad_accum": ramp.grad_accum, "stages": [[s.step, list(s.weights)] for s in self.stages],
            "follow": self.settings.data.follow,
            **({"batch_ramp": ramp.steps} if ramp.ramping else {}),
        })  # fmt: skip

    def record_growth(
        self, step: int, before: tuple[int, ...], after: tuple[int, ...], at: str
    ) -> dict[str, Any]:
        """Note in the run's history (kept in every checkpoint after) the documents the marks
        ``before`` → ``after`` added at ``step``; returns the record."""
        names = self.mongo.collections
        added = {n: a - b for n, a, b in zip(names, after, before, strict=True) if a > b}
        record = {"step": step, "added": added, "at": at}
        self.growth.append(record)
        return record

    def _log_growth(self, added: list[tuple[int, int, int]], when: str) -> None:
        parts = [f"{self.mongo.collections[c]} {lo}..{hi}" for c, lo, hi in added]
        log.info("taking in new documents (%s) %s", ", ".join(parts), when)

    def _note_prefix(self) -> None:
        """Rank 0 hashes a sample of the table's prefix now, while the database answers, for the
        checkpoints to come (a checkpoint may be saved because the database went away)."""
        if self.rank != 0:
            return
        from dsgpt2.corpus.marks import prefix_record

        marks = self.schedule.table.marks
        self._prefix = (marks, prefix_record(self.conn, marks, self.settings.data.seed))
        self.note_trained(None)

    def note_trained(self, step: int | None) -> None:
        """Rank 0 notes in meta_info how far this run has read each collection, and its last
        checkpoint's step (None: none written since the start), for ``dsgpt2 info``."""
        if self.rank != 0:
            return
        from dsgpt2.corpus.marks import record_trained

        record_trained(self.conn, self.schedule.table.marks, str(self.settings.ckpt_dir), step)

    def state_dict(self, state: ReadState) -> dict[str, Any]:
        """What a checkpoint keeps of the data (a collective: every rank calls it)."""
        return {
            "table": self.schedule.table.to_dict(),
            "streams": [list(s) for s in self.streams],
            "prefix": self._prefix[1] if self._prefix else None,
            "growth": self.growth,
            "launches": self.launches,
            "skipped_micro": self.skipped_micro,
            "ranks": gather(state.to_dict()),
        }

    def poll(self, step: int) -> tuple[int, ...] | None:
        """With ``--follow N``, every N steps: the marks, read by rank 0 (a collective)."""
        n = self.settings.data.follow
        if not n or step % n:
            return None
        from dsgpt2.corpus.marks import read_marks

        return tuple(on_rank0(lambda: read_marks(self.conn)))
