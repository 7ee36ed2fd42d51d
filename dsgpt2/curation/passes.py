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
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from dsgpt2.curation.steps import Split, Step
from dsgpt2.db.bulk import write_ops
from dsgpt2.db.client import Connection, require_collections
from dsgpt2.db.idx import idx_bounds, numbered_batches
from dsgpt2.progress import progress as progress_display
from dsgpt2.settings.argtypes import part_of
from dsgpt2.settings.options import POSITIVE_INT, Checked, option

log = logging.getLogger(__name__)
NUMBERED = {"idx": {"$exists": True}}  # the documents of the corpus (a collection may hold others)


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
    what = f"{step.verb} {name}"
    bar = progress_display(what, "doc", enabled=progress)
    try:
        batches = numbered_batches(conn, name, step.todo(), step.fields(text_field), batch_size,
                                   what=what, span=span)  # fmt: skip
        for read in batches:
            if batch := [d for d in read if step.pending(d)]:
                write_ops(conn, name, step.process(batch, text_field), step.writing)
                done += len(batch)
            bar.update(len(read))
    finally:
        bar.close()
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
