"""One kind of pass over a collection's documents, and the one driver that runs every kind: idx-ordered
windows, bulk writes, resume, worker processes and machine parts, retries, progress and the report.

A :class:`~dsgpt2.curation.steps.Step` says what it does to a document and nothing else: ``key()``
(what makes a document's mark current), ``todo()`` (the documents whose mark is not: by default those
whose ``mark`` field is not ``key()``), ``apply(doc)`` (the fields to set on one of them), what it counts
once a collection is done, and the work over every collection at once (``conclude``). :func:`run_pass`
does the rest for every step (curate, langid, redact, decontaminate, and the hashing and signing stages
of dedup).

Resumable by its query: a pass selects the documents still without its current mark, so a pass killed
and run again continues with those, and ends as a straight one.

Split by idx ranges: each collection's idx range is cut into contiguous ranges, one per worker
process (``--workers``), after this machine's share of them (``--part R/M``). Contiguous idx ranges
keep a worker's reads on one shard of a collection sharded by idx range, and on one stretch of the
idx index anywhere else.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from dsgpt2.curation.steps import Split, Step
from dsgpt2.db.client import (
    ASCENDING,
    Connection,
    DatabaseError,
    patiently,
    require_collections,
    with_retries,
)
from dsgpt2.db.filters import conjoin
from dsgpt2.db.idx import idx_edge
from dsgpt2.errors import CorpusError
from dsgpt2.progress import progress as progress_display
from dsgpt2.settings.argtypes import part_of
from dsgpt2.settings.options import POSITIVE_INT, Checked, option

log = logging.getLogger(__name__)
NUMBERED = {"idx": {"$exists": True}}  # the documents of the corpus (a collection may hold others)


def ensure_index(conn: Connection, name: str, field: str, what: str) -> None:
    """An ascending index on ``field`` of ``name`` (named ``field_1``), built however long it takes
    (:func:`patiently`); a refusal is a CorpusError."""
    try:
        patiently(conn, lambda db: db[name].create_index([(field, ASCENDING)], name=f"{field}_1"), what)
    except DatabaseError as exc:  # OperationFailure among them
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
            q = conjoin({"idx": {"$gte": lo, "$lt": end}}, query)
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


def write_ops(conn: Connection, name: str, ops: list[Any], what: str) -> None:
    """``ops`` (pymongo write operations) on ``name``: one unordered bulk write (one transaction on the
    embedded engine: :meth:`Connection.bulk_write`), retried as a whole (each operation sets values, so
    a retry after a partial write ends where one write would)."""
    if ops:
        with_retries(lambda: conn.bulk_write(name, ops), conn.config, f"{what}: writing {name}")


def idx_bounds(conn: Connection, name: str) -> tuple[int, int] | None:
    """The smallest and largest idx of ``name`` (a few reads on the idx index); None when it has none."""
    coll = conn.db[name]
    lo = with_retries(lambda: idx_edge(coll, 1), conn.config, f"reading the idx range of {name}")
    hi = with_retries(lambda: idx_edge(coll, -1), conn.config, f"reading the idx range of {name}")
    return None if lo is None or hi is None else (int(lo), int(hi))


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


# ---------------------------------------------------------------- the passes and their driver


@dataclass(frozen=True, kw_only=True)
class PassSettings(Checked):
    """The options every pass over the collections takes (dedup, curate, langid, redact,
    decontaminate)."""

    collection: tuple[str, ...] | None = option(
        None, "only these collections (repeatable; default: the config's)", repeat=True
    )
    batch_size: int = option(1000, "documents per read and bulk write", check=POSITIVE_INT)
    workers: int = option(
        1, "processes for the per-document work, each on its own idx range", check=POSITIVE_INT
    )
    part: tuple[int, int] | None = option(
        None,
        "only the R-th of M idx ranges of each collection: machine R of M runs its part",
        type=part_of,
        metavar="R/M",
    )
    no_progress: bool = option(False, "no progress bar")

    @property
    def split(self) -> Split:
        """The worker processes and the share of the idx ranges this run does."""
        part, parts = self.part or (1, 1)
        return Split(workers=self.workers, part=part - 1, parts=parts)


def walk(
    conn: Connection,
    name: str,
    span: tuple[int, int] | None = None,
    *,
    step: Step,
    batch_size: int = 1000,
    progress: bool = False,
) -> int:
    """Process the documents of ``name`` (of idx in ``span``) that ``step`` has still to; returns how
    many it processed."""
    text_field = conn.config.text_field
    done = 0
    batches = each_batch(conn, name, step.todo(), step.fields(text_field), batch_size,
                         desc=f"{step.verb} {name}", progress=progress, span=span)  # fmt: skip
    for read in batches:
        if batch := [d for d in read if step.pending(d)]:
            write_ops(conn, name, step.process(batch, text_field), step.writing)
            done += len(batch)
    return done


def run_pass(
    conn: Connection,
    names: Sequence[str],
    step: Step,
    *,
    batch_size: int = 1000,
    progress: bool = False,
    split: Split = WHOLE,
) -> Any:
    """Run ``step`` over this machine's idx ranges of each of ``names`` in turn, then count.

    Raises:
        CorpusError: a collection is missing, or the step refuses (:meth:`Step.check`).
    """
    started = time.monotonic()
    require_collections(conn, names)
    step.check(conn, names)
    parts = []
    for name in names:
        here = step.start(conn, name)
        work = partial(walk, step=here, batch_size=batch_size, progress=progress and split.workers == 1)
        parts.append(here.finish(conn, name, run_split(conn, name, work, split, step.verb), split))
    report = step.report(parts)
    step.conclude(conn, names, report, split)
    report.seconds = time.monotonic() - started
    return report


def part_line(step: Step, split: Split) -> list[str]:
    """The report's last line on a run of ``step`` over part of the idx ranges: what is left to another
    run."""
    if split.parts == 1 or step.part_note is None:
        return []
    return [f"part {split.part + 1}/{split.parts} done: {step.part_note}"]
