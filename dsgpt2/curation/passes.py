"""A pass over a collection's documents in idx order, in batches, writing fields back with bulk
writes: the shape of every curation pass (hashes, quality signals).

Resumable by its query: a pass selects the documents still without its result, so a pass killed
and run again continues with those, and ends as a straight one.

Split by idx ranges: each collection's idx range is cut into contiguous ranges, one per worker
process (``--workers``), after this machine's share of them (``--part R/M``). Contiguous idx ranges
keep a worker's reads on one shard of a collection sharded by idx range, and on one stretch of the
idx index anywhere else.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from dsgpt2.db.client import ASCENDING, Connection, DatabaseError, OperationFailure, UpdateOne, with_retries
from dsgpt2.db.idx import idx_edge
from dsgpt2.errors import CorpusError
from dsgpt2.progress import progress as progress_display

log = logging.getLogger(__name__)


def require_present(conn: Connection, names: Sequence[str], what: str) -> None:
    """Raises CorpusError naming those of ``names`` the database does not hold."""
    present = with_retries(conn.db.list_collection_names, conn.config, f"{what}: collections")
    missing = [n for n in names if n not in present]
    if missing:
        raise CorpusError(
            f"collection(s) {', '.join(map(repr, missing))} not found in database {conn.config.db!r}"
        )


def ensure_index(conn: Connection, name: str, field: str) -> None:
    """An ascending index on ``field`` of ``name`` (named ``field_1``); a refusal is a CorpusError."""
    try:
        conn.db[name].create_index([(field, ASCENDING)], name=f"{field}_1")
    except (OperationFailure, DatabaseError) as exc:
        raise CorpusError(
            f"cannot create the {field} index on {name!r}: {conn.config.scrub(str(exc))}"
        ) from None


def each_batch(
    conn: Connection,
    name: str,
    query: dict[str, Any],
    fields: dict[str, int],
    batch_size: int,
    *,
    desc: str,
    progress: bool = False,
    span: tuple[int, int] | None = None,
) -> Iterator[list[dict[str, Any]]]:
    """The numbered documents of ``name`` matching ``query``, in idx order, with ``_id``, ``idx`` and
    ``fields``: each batch one window of ``batch_size`` idx values on the idx index (fewer documents
    when ``query`` leaves some out; windows with none are not yielded); only those of idx in
    ``[start, stop)`` when ``span`` is given, otherwise to the largest idx, including documents added
    while the pass runs."""
    coll = conn.db[name]
    wanted = {"_id": 1, "idx": 1, **fields}

    def edge(guess: int | None) -> int:
        top = with_retries(lambda: idx_edge(coll, -1, guess=guess), conn.config, f"{desc}: reading {name}")
        return -1 if top is None else int(top)

    lo, stop = (0, edge(None) + 1) if span is None else span
    bar = progress_display(desc, "doc", enabled=progress)
    try:
        while lo < stop:
            end = min(lo + batch_size, stop)
            q = {**query, "idx": {"$gte": lo, "$lt": end}}
            batch = with_retries(lambda q=q: list(coll.find(q, wanted).sort("idx", 1)),
                                 conn.config, f"{desc}: reading {name}")  # fmt: skip
            lo = end
            if span is None and lo >= stop:
                stop = edge(stop - 1) + 1
            if batch:
                yield batch
                bar.update(len(batch))
    finally:
        bar.close()


def set_fields(conn: Connection, name: str, updates: list[tuple[Any, dict[str, Any]]], what: str) -> None:
    """``$set`` each ``(_id, fields)`` of ``updates`` on ``name``: one unordered bulk write."""
    coll = conn.db[name]

    def write() -> None:
        coll.bulk_write([UpdateOne({"_id": _id}, {"$set": f}) for _id, f in updates], ordered=False)

    if updates:
        with_retries(write, conn.config, f"{what}: writing {name}")


def idx_bounds(conn: Connection, name: str) -> tuple[int, int] | None:
    """The smallest and largest idx of ``name`` (a few reads on the idx index); None when it has none."""
    coll = conn.db[name]
    lo = with_retries(lambda: idx_edge(coll, 1), conn.config, f"reading the idx range of {name}")
    hi = with_retries(lambda: idx_edge(coll, -1), conn.config, f"reading the idx range of {name}")
    return None if lo is None or hi is None else (int(lo), int(hi))


def spans(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi]`` cut into ``parts`` contiguous ``[start, stop)`` ranges as even as integers allow
    (fewer when there are fewer idx values than parts)."""
    n = hi - lo + 1
    parts = max(1, min(parts, n))
    cuts = [lo + n * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


@dataclass(frozen=True)
class Split:
    """How a pass's per-document work is split: ``workers`` processes here, and this machine's
    ``part`` (0-based) of ``parts`` idx ranges of each collection."""

    workers: int = 1
    part: int = 0
    parts: int = 1

    def ranges(self, bounds: tuple[int, int]) -> list[tuple[int, int]]:
        mine = spans(*bounds, self.parts)
        if self.part >= len(mine):  # more machines than idx values: nothing here
            return []
        start, stop = mine[self.part]
        return spans(start, stop - 1, self.workers)


WHOLE = Split()


def run_split(conn: Connection, name: str, work: Callable[..., int], split: Split, what: str) -> int:
    """``work(conn, name, span=(start, stop))`` over this machine's idx ranges of ``name``, one range per
    worker process; returns the sum of what the calls return.

    ``work`` must be picklable (a module-level function, or a ``functools.partial`` of one): each
    worker process opens its own connection from the config.
    """
    bounds = idx_bounds(conn, name)
    if bounds is None:
        return 0
    ranges = split.ranges(bounds)
    if split.workers == 1 or len(ranges) == 1:
        return sum(work(conn, name, span=r) for r in ranges)
    log.info("%s %s: idx ranges %s in %d worker processes", what, name, ranges, len(ranges))
    with ProcessPoolExecutor(len(ranges), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_work, work, conn.config, name, r) for r in ranges]
        return sum(f.result() for f in futures)


def _work(work: Callable[..., int], config: Any, name: str, span: tuple[int, int]) -> int:
    logging.basicConfig(level=logging.WARNING)
    conn = Connection(config)
    try:
        return work(conn, name, span=span)
    finally:
        conn.close()
