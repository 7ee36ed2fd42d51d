"""From chunks to micro-batches: the DataLoader workers and the rank's block stream.

Workers (each with its own MongoDB client) turn chunks into blocks; they ignore SIGTERM and SIGINT
so that their rank can finish a step and save, and die with their rank. :class:`BlockStream` reads
the rank's chunks in the epoch's order and cuts them into micro-batches, keeping the small
:class:`~dsgpt2.data.dealing.Position` that makes resuming exact.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dsgpt2.data.dealing import ChunkOrders, Position, ReadState, eval_chunks
from dsgpt2.data.mixture import Stage, pick, stage_at
from dsgpt2.data.packing import labels_and_mask
from dsgpt2.data.ramp import BatchRamp
from dsgpt2.data.sources import Chunk
from dsgpt2.errors import CorpusError

NO_RAMP = BatchRamp(1)  # one micro-batch a step, throughout

log = logging.getLogger(__name__)

_exit_hook = False
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _collate(item: Chunk) -> Chunk:
    return item


def _init_worker(rank_pid: int, worker_id: int) -> None:
    # A SIGTERM sent to a whole process group (a pipeline stopping, a job scheduler), or the SIGINT
    # of Ctrl-C (the terminal sends it to the whole foreground group), must let the rank finish its
    # step and save: a worker dying first would fail that step instead. Workers stop when their
    # rank shuts the loader down, or exits (see _kill_workers_at_exit), or dies.
    import signal

    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    # Started with these held (see start_loader); one that came meanwhile is dropped, now ignored.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_STOP_SIGNALS))
    die_with_parent(rank_pid)


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` dies, even by SIGKILL (Linux).

    The parent is the thread that forked it: loaders are made on their rank's main thread.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request: nothing would send the signal
        os._exit(1)


def _kill_workers_at_exit() -> None:
    """Kill the loader workers still alive when this process exits.

    multiprocessing ends daemonic children with SIGTERM and then waits for them, which workers
    that ignore SIGTERM would never answer. Registered after multiprocessing's own exit hook,
    this one runs first.
    """
    import multiprocessing
    import signal

    # torch's SIGCHLD handler would report each killed worker as a failure.
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(5)


def start_loader(dataset: Dataset, order: Iterable[int], workers: int, prefetch: int = 4) -> Iterator[Any]:
    """The items of ``dataset`` in ``order``, read by ``workers`` processes (started already).

    ``order`` may be an iterator, endless even: the loader draws from it as its workers need
    more, ``prefetch`` items per worker ahead of the one handed out."""
    import signal

    loader = _make_loader(dataset, order, workers, prefetch)
    if workers == 0 or threading.current_thread() is not threading.main_thread():
        return iter(loader)
    # A SIGTERM or SIGINT to the process group while workers start would reach one before it can
    # ignore it (torch's worker handler dies on it): hold them until the workers run; the rank then
    # gets them.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(_STOP_SIGNALS))
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _make_loader(dataset: Dataset, order: Iterable[int], workers: int, prefetch: int) -> DataLoader:
    global _exit_hook
    extra: dict[str, Any] = {}
    if workers > 0:
        if not _exit_hook:
            import atexit

            atexit.register(_kill_workers_at_exit)
            _exit_hook = True
        extra = {
            "multiprocessing_context": "fork",
            "prefetch_factor": prefetch,
            "worker_init_fn": functools.partial(_init_worker, os.getpid()),
        }
    # A generator of its own: the loader must not draw from torch's global RNG, whose state
    # is part of a checkpoint (dropout) and would otherwise depend on when loaders are made.
    return DataLoader(
        dataset,
        batch_size=None,
        sampler=order if isinstance(order, Iterator) else list(order),
        num_workers=workers,
        collate_fn=_collate,
        generator=torch.Generator().manual_seed(0),
        **extra,
    )


@dataclass
class Batch:
    """One micro-batch, and where its blocks came from."""

    input_ids: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 on padding
    attention_mask: torch.Tensor  # (B, T)
    block_ids: list[tuple[int, int, int]]  # (epoch, chunk, block in chunk)
    tokens: int  # real tokens
    by_collection: dict[int, int] = field(default_factory=dict)  # real tokens per collection


class _Rows:
    """Blocks gathered for the next micro-batch."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.valid: list[int] = []
        self.ids: list[tuple[int, int, int]] = []
        self.loss: list[np.ndarray] = []
        self.shares: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, item: Chunk, b: int, valid: int, block_id: tuple[int, int, int]) -> None:
        self.rows.append(item.blocks[b])
        self.valid.append(valid)
        self.ids.append(block_id)
        if item.loss is not None:
            self.loss.append(item.loss[b])
        if item.shares is not None:
            self.shares.append(item.shares[b])

    def batch(self) -> Batch:
        batch = _make_batch(self.rows, self.valid, self.ids, self.loss or None)
        if self.shares:
            tokens = np.sum(self.shares, axis=0)
            batch.by_collection = {int(c): int(tokens[c]) for c in np.flatnonzero(tokens)}
        return batch


def _make_batch(
    rows: list[np.ndarray],
    valid: list[int],
    ids: list[tuple[int, int, int]],
    loss: list[np.ndarray] | None = None,
) -> Batch:
    blocks = np.stack(rows)
    labels, mask = labels_and_mask(blocks, np.array(valid), np.stack(loss) if loss else None)
    return Batch(
        torch.from_numpy(blocks.astype(np.int64)),
        torch.from_numpy(labels),
        torch.from_numpy(mask),
        ids,
        int(sum(valid)),
    )


class BlockStream:
    """Micro-batches of training blocks for one rank, endless over epochs, resumable exactly.

    ``state`` always names the next block of each stream not yet handed out, so that a
    checkpoint taken between two batches resumes with the very next one. With several streams
    (mixture weights), each block comes from the stream :func:`~dsgpt2.data.mixture.pick` names
    under the stage in force at the batch's step (``ramp``'s step of the micro-batches read).

    Args:
        dataset, schedule: the training split's chunks, and the order each epoch deals them.
        rank, world: this rank among the run's ranks.
        micro_batch: blocks per batch.
        state: where the reading resumes (default: the start).
        workers: DataLoader workers, shared among the streams.
        stages, ramp: the mixture's stages, and the micro-batches per step they are counted in.
    """

    def __init__(
        self,
        dataset: Dataset,
        schedule: ChunkOrders,
        rank: int,
        world: int,
        micro_batch: int,
        *,
        state: ReadState | None = None,
        workers: int = 2,
        stages: Sequence[Stage] = (),
        ramp: BatchRamp = NO_RAMP,
    ) -> None:
        self.dataset = dataset
        self.schedule = schedule
        self.rank = rank
        self.world = world
        self.micro_batch = micro_batch
        self.state = state or ReadState.start(len(schedule.streams))
        n = len(schedule.streams)
        self.workers = workers if n == 1 or workers == 0 else max(1, workers // n)
        self.stages = list(stages)
        self.ramp = ramp
        self.documents = 0
        self.skipped: dict[str, int] = {}
        self._readers: list[Any] = []

    def _take(self, item: Chunk) -> None:
        self.documents += item.documents
        for reason, n in item.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n

    def regrow(
        self, dataset: Dataset, schedule: ChunkOrders, dealt: dict[int, list[tuple[int, int, int]]]
    ) -> None:
        """Read ``dataset`` through ``schedule`` (the corpus grew) from the next batch on; ``dealt``
        puts this rank's share of new chunks, per stream, at the head of its reading. Iterate
        anew afterwards."""
        self.close()
        self.dataset, self.schedule = dataset, schedule
        for s, items in dealt.items():
            self.state.streams[s].queue.extend(items)

    def close(self) -> None:
        """Stop the readers (their DataLoader workers) of the last iteration."""
        for reader in self._readers:
            reader.close()
        self._readers = []

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        readers = self._readers = [self._blocks(s) for s in range(len(self.schedule.streams))]
        try:
            yield from self._batches(readers)
        finally:
            # Readers and this stream refer to each other: an iteration dropped without close()
            # would leave its DataLoaders to the cycle collector, which closes their queues before
            # telling their workers to stop (each worker then takes 10 s to be given up on).
            for reader in readers:
                reader.close()

    def _batches(self, readers: list[Iterator[Any]]) -> Iterator[Batch]:
        rows = _Rows()
        context = 0
        while True:
            s = self._choose(context)
            item, b, valid, block_id = next(readers[s])
            context = item.blocks.shape[1]
            rows.add(item, b, valid, block_id)
            self.state.taken[s] += valid
            if len(rows) == self.micro_batch:
                batch = rows.batch()
                for c, n in batch.by_collection.items():
                    self.state.tokens[c] = self.state.tokens.get(c, 0) + n
                rows = _Rows()
                self.state.micro += 1
                yield batch

    def _choose(self, context: int) -> int:
        if len(self.schedule.streams) == 1:
            return 0
        stage = stage_at(self.stages, self.ramp.step_of(self.state.micro))
        if stage != self.state.stage:
            self.state.stage, self.state.taken = stage, [0] * len(self.state.taken)
        return pick(self.state.taken, self.stages[stage].weights, context)

    def _blocks(self, s: int) -> Iterator[tuple[Chunk, int, int, tuple[int, int, int]]]:
        """Stream ``s``'s blocks for this rank: (chunk, block, real tokens, block id). Before each
        one is handed out, ``state.streams[s]`` moves past it.

        One loader reads the whole way, epoch after epoch: its workers start once and run ahead
        across epoch boundaries, so a new epoch's first blocks are ready when its last are taken.
        """
        pos = self.state.streams[s]
        # First what a run on another number of ranks left over (see dealing.redeal), and the
        # chunks dealt when the corpus grew.
        queue = list(pos.queue)
        plan: deque[_Planned] = deque()
        deal, rank, world = self.schedule.rank_chunks, self.rank, self.world
        chunks = _plan(lambda e: deal(s, e, rank, world), pos, plan)
        epoch, whole, produced = -1, False, False
        for item in start_loader(self.dataset, chunks, self.workers):
            p = plan.popleft()  # the loader hands chunks back in the order they were drawn
            self._take(item)
            v = item.valid
            # A position counts the blocks taken from a chunk; they go out in the chunk's order.
            order = item.order if item.order is not None else range(len(item.blocks))
            if p.queued >= 0:
                for i in range(p.first, len(item.blocks)):
                    rest = [(p.epoch, p.chunk, i + 1)] if i + 1 < len(item.blocks) else []
                    tail = rest + queue[p.queued + 1 :]
                    self.state.streams[s] = Position(pos.epoch, pos.chunk, pos.block, tail)
                    b = int(order[i])
                    yield item, b, int(v[b]), (p.epoch, p.chunk, b)
                continue
            if p.epoch != epoch:
                if whole and not produced:
                    raise self._empty(s)
                epoch, whole, produced = p.epoch, p.k == 0, False
            for i in range(p.first, len(item.blocks)):
                produced = True
                # The next block is the (i + 1)-th of this chunk (possibly past its end).
                self.state.streams[s] = _normalize(Position(p.epoch, p.k, i + 1), len(item.blocks))
                b = int(order[i])
                yield item, b, int(v[b]), (p.epoch, p.chunk, b)
        raise self._empty(s)  # the plan stopped at an epoch with no chunk for this rank

    def _empty(self, s: int) -> CorpusError:
        names = [self.schedule.table.names[c] for c in self.schedule.streams[s]]
        # The documents read and set aside say why, where that is the cause (turns not found under
        # --task conversation, say): as `evaluate` says it.
        skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped.items()))
        why = f"; documents skipped: {skipped} (a conversation task on text documents?)" if skipped else ""
        return CorpusError(
            f"rank {self.rank} has no training block of {', '.join(names)} in a whole epoch: the "
            f"split is empty (too few documents, or --tr_ratio leaves none for training){why}"
        )


@dataclass(frozen=True)
class _Planned:
    """A chunk drawn for a reader's loader, and its place in the reading."""

    epoch: int
    k: int  # place in the epoch's order (-1: from the queue)
    chunk: int
    first: int  # blocks of it already taken
    queued: int = -1  # place in the queue (-1: from an epoch's order)


def _plan(
    rank_chunks: Callable[[int], np.ndarray], pos: Position, plan: deque[_Planned]
) -> Iterator[tuple[int, int]]:
    """The chunks a reader at ``pos`` reads, as (epoch, chunk), endlessly: its queue, then each
    epoch's order from ``pos`` on (``rank_chunks(epoch)``: the chunks the epoch deals this reader's
    rank and stream); each one's place is appended to ``plan`` as the loader draws it. Stops at an
    epoch that deals no chunk to this rank (an empty split)."""
    for i, (e, c, first) in enumerate(pos.queue):
        plan.append(_Planned(e, -1, int(c), first, i))
        yield (int(e), int(c))
    epoch, start, skip = pos.epoch, pos.chunk, pos.block
    while True:
        order = rank_chunks(epoch)
        if start == 0 and len(order) == 0:
            return
        for k in range(start, len(order)):
            plan.append(_Planned(epoch, k, int(order[k]), skip))
            skip = 0
            yield (epoch, int(order[k]))
        epoch, start, skip = epoch + 1, 0, 0


def _normalize(pos: Position, blocks_in_chunk: int) -> Position:
    if pos.block >= blocks_in_chunk:
        return Position(pos.epoch, pos.chunk + 1, 0)
    return pos


def eval_batches(
    dataset: Dataset, rank: int, world: int, micro_batch: int, limit: int, *, workers: int = 0
) -> list[Batch]:
    """The first ``limit`` validation micro-batches of this rank: the same at every evaluation."""
    out: list[Batch] = []
    for batch in iter_eval_batches(dataset, rank, world, micro_batch, workers):
        out.append(batch)
        if len(out) >= limit:
            break
    return out


def iter_eval_batches(
    dataset: Dataset, rank: int, world: int, micro_batch: int, workers: int = 0, *, stats: Any = None
) -> Iterator[Batch]:
    """Every block of this rank's evaluation chunks, in micro-batches, in a fixed order.

    ``stats`` (a dict), when given, gathers ``chunks``, ``documents`` and ``skipped`` as chunks arrive.
    """
    rows = _Rows()
    for item in start_loader(dataset, eval_chunks(dataset.table, rank, world), workers):
        if stats is not None:
            stats["chunks"] = stats.get("chunks", 0) + 1
            stats["documents"] = stats.get("documents", 0) + item.documents
            skipped = stats.setdefault("skipped", {})
            for reason, n in item.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        v = item.valid
        for b in range(len(item.blocks)):
            rows.add(item, b, int(v[b]), (0, int(item.chunk), b))
            if len(rows) == micro_batch:
                yield rows.batch()
                rows = _Rows()
    if len(rows):
        yield rows.batch()
