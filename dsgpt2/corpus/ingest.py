"""Ingest: text files or the built-in sample corpus → documents in a collection.

Each source record becomes a document of the fields :data:`dsgpt2.documents.INGEST_FIELDS` names,
with its hash (conversations also keep ``turns``): ``idx`` continues after the collection's largest
one, ``form`` is the original text, ``filt_text`` its cleaned form and ``text_hash`` the hash of the
text training reads (:mod:`dsgpt2.curation.dedup`).

Exactly once, even when killed: before its first insert a source is recorded
in meta_info; each batch is inserted in order and then meta_info records how
far the source has been read. A re-run skips finished sources and resumes an
unfinished one after the last record that reached the collection, read back
from the documents themselves (``source``/``source_pos``), so a batch that was
inserted but not yet recorded is neither lost nor duplicated.

One writer per source: an ingest holds each source it writes (a lease in meta_info,
:mod:`dsgpt2.db.leases`), and a second ingest of the same source while the first
lives is refused; a holder that died (its process gone on this machine, or no
heartbeat for ``LEASE_SECONDS``) is taken over by the re-run. Different sources
may go into one collection at once: the unique idx index numbers them apart.

Every skipped record is located (file and 1-based line, or Parquet row group and
row): the first few in the log, all of them in the ``--report`` file.

The records come from :mod:`dsgpt2.corpus.readers`; what a run did is told by
:mod:`dsgpt2.corpus.ingest_report`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from dsgpt2.corpus.cleaning import CLEANER_VERSION
from dsgpt2.corpus.ingest_report import IngestReport, MissingField, SkipLog, SourceReport
from dsgpt2.corpus.readers import DAMAGED_INPUT
from dsgpt2.corpus.records import BadRecord, Source, located
from dsgpt2.db.client import Connection, database_errors, existing_collections
from dsgpt2.db.idx import ensure_idx_index, ensure_index, insert_batch, largest_idx
from dsgpt2.db.leases import LEASE_SECONDS, Lease
from dsgpt2.db.meta import drop_collection, read_meta
from dsgpt2.db.summaries import count_where, last_numbered
from dsgpt2.documents import HASH, ID, IDX, SOURCE, SOURCE_POS, document_hash
from dsgpt2.errors import BadDocumentError, CorpusError, IngestError, LeaseContested, LeaseHeld, LeaseLost
from dsgpt2.progress import progress as progress_display
from dsgpt2.settings.options import POSITIVE_INT

log = logging.getLogger(__name__)

# A source held by an ingest whose heartbeat is older than this (on another machine) is taken over.
# Records read without the text field, none with it, before the log says the field may be wrong.
NO_FIELD_WARNING = 1000


class Step(Protocol):
    """What ingest asks of a curation step it runs on each document (a
    :class:`dsgpt2.curation.steps.Step` is one): corpus/ names the calls, curation/ answers them."""

    skip_reason: str  # what a document it does not admit is counted as (empty: it admits every one)

    def opened(self, conn: Connection, collection: str) -> Step: ...

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any] | None: ...

    def admit(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]: ...

    def stored(self, collection: str, docs: list[dict[str, Any]]) -> int: ...


def ingest(
    conn: Connection,
    collection: str,
    sources: list[Source],
    batch_size: int = 1000,
    strict: bool = False,
    *,
    progress: bool = False,
    steps: Sequence[Step] = (),
    report_file: str | os.PathLike[str] | None = None,
) -> IngestReport:
    """Append every record of ``sources`` to ``collection`` exactly once (see module doc), each document
    through ``steps`` in order (:mod:`dsgpt2.curation.steps`): each one's ``apply`` on the document
    before it is hashed, its ``admit`` on a batch before it is numbered (what it leaves out is skipped
    and counted under its ``skip_reason``, ``duplicate`` for ``--dedup``), its ``stored`` once numbered.
    ``report_file``: a JSON lines file that lists where each record this run skipped is, and why.

    Raises:
        IngestError: bad options or unreadable input, or no record of a source has its text field.
        BadDocumentError: a record is unusable and ``strict`` is on.
        CorpusError: the collection's idx is broken, or another ingest is writing the same source.
    """
    POSITIVE_INT.check("--batch_size", batch_size)  # for a caller of the function; the flag's own check
    started = time.monotonic()
    skips = SkipLog(report_file)
    try:
        with database_errors(conn.config, f"ingest into {collection!r}", "re-run the same command to resume"):
            made = collection not in existing_collections(conn)
            ensure_idx_index(conn, collection, f"indexing {collection}")
            # Built here, not only by `dedup --exact`: `ingest --dedup` asks it of every batch.
            ensure_index(conn, collection, HASH, f"indexing {collection}")
            opened = [step.opened(conn, collection) for step in steps]
            reports = []
            try:
                for source in sources:
                    with _held(conn, collection, source) as lease:
                        report = _write_source(
                            conn, collection, source, batch_size, strict, progress=progress, steps=opened,
                            skips=skips, lease=lease,
                        )  # fmt: skip
                        reports.append(report)
            except IngestError:  # an input refused (nothing of it stored): no collection left for it
                _drop_if_unused(conn, collection, made)
                raise
            top = _drop_if_unused(conn, collection, made)
    finally:
        skips.close()
    count = 0 if top is None else top + 1
    return IngestReport(collection, reports, count, time.monotonic() - started)


def _drop_if_unused(conn: Connection, collection: str, made: bool) -> int | None:
    """Drop ``collection`` where this run made it and no ingest stores in it; its last idx."""
    top = largest_idx(conn, collection, f"reading {collection}: last idx")
    if made and top is None and not read_meta(conn, [collection]).get(collection, {}).get("sources"):
        drop_collection(conn, collection)
    return top


@contextlib.contextmanager
def _held(conn: Connection, collection: str, source: Source) -> Iterator[Lease]:
    """One source held (see module doc) while this process writes it."""
    lease = _claim(conn, collection, source)
    try:
        yield lease
    finally:
        lease.release()


def _write_source(
    conn: Connection,
    collection: str,
    source: Source,
    batch_size: int,
    strict: bool,
    *,
    progress: bool,
    steps: Sequence[Step],
    skips: SkipLog,
    lease: Lease,
) -> SourceReport:
    report = SourceReport(source.label, decoding=source.decoding)
    sources = read_meta(conn, [collection]).get(collection, {}).get("sources", {})
    state = sources.get(source.key)
    _check_input(source, state, sources, collection)
    top = largest_idx(conn, collection, f"reading {collection}: last idx")
    next_idx = 0 if top is None else top + 1
    if state and state.get("complete"):
        _check_read_alike(source, state, collection)
        report.already_done = True
        log.info("%s: already ingested into %s", source.label, collection)
        return report
    start = _starting_point(conn, collection, source, report, state, next_idx=next_idx, lease=lease)
    batch: list[dict[str, Any]] = []
    places: list[dict[str, Any]] = []  # where each document of batch is
    missing = MissingField()
    beat = time.monotonic()
    pos = -1
    damage: BaseException | None = None
    bar = progress_display(source.label[:40], "doc", initial=start, enabled=progress)
    records = enumerate(source.read_from(start), start) if source.read_from else enumerate(source.read())
    try:
        while True:
            try:
                pos, record = next(records)
            except StopIteration:
                break
            except DAMAGED_INPUT as exc:
                damage = exc  # what was read before it still lands, below
                break
            if pos % 1024 == 0 and time.monotonic() - beat > LEASE_SECONDS / 4:
                # Reading up to a resume point, or a long run of skipped records, inserts nothing: the
                # heartbeat goes on all the same.
                _held_update(lease, source, {"$set": {f"{lease.path}.heartbeat": time.time()}})
                beat = time.monotonic()
            if pos < start:
                continue
            report.read += 1
            bar.update(1)
            if isinstance(record, BadRecord) and record.reason == "no_field":
                missing.add(record.keys)
                if missing.records == NO_FIELD_WARNING and not missing.with_field:
                    log.warning("%s: the first %d records have no %s; %s", source.label,
                                NO_FIELD_WARNING, source.flag, missing.advice(source))  # fmt: skip
            elif not (isinstance(record, BadRecord) and record.reason == "bad_json"):
                missing.with_field += 1
            doc = record.document()
            if isinstance(doc, dict):
                for step in steps:
                    doc.update(step.apply(doc, conn.config.text_field) or {})
            if isinstance(doc, str):
                report.skipped[doc] += 1
                where = source.locate(pos)
                if strict:
                    raise BadDocumentError(
                        f"{source.label}: {located(where)} is unusable ({doc}); fix it, or run without "
                        "--strict"
                    )
                skips.add(source, where, doc)
                continue
            doc[HASH] = document_hash(doc, conn.config.text_field)
            batch.append({**doc, SOURCE: source.key, SOURCE_POS: pos})
            places.append(source.locate(pos))
            if len(batch) >= batch_size:
                next_idx = _flush(conn, collection, source, report, batch=batch, records=pos + 1,
                                  next_idx=next_idx, steps=steps, lease=lease, places=places,
                                  skips=skips)  # fmt: skip
                batch, places, beat = [], [], time.monotonic()
        next_idx = _flush(conn, collection, source, report, batch=batch, records=max(pos + 1, start),
                          next_idx=next_idx, steps=steps, lease=lease, places=places,
                          skips=skips)  # fmt: skip
        admitted_by_steps = {step.skip_reason for step in steps if step.skip_reason}
        unusable = sum(n for reason, n in report.skipped.items() if reason not in admitted_by_steps)
        if damage is None and _forgotten(source, report, missing, skips, lease, begun=start > 0,
                                         unusable=unusable):  # fmt: skip
            return report
        skips.end_source(source)
        if damage is not None:
            raise IngestError(
                f"{source.label}: the file is damaged after record {pos + 1} "
                f"({type(damage).__name__}: {str(damage).strip() or 'no detail'}); the records before it "
                "are ingested; repair or replace the file and re-run the same command to resume"
            )
        _record(conn, collection, source, report, records=max(pos + 1, start), idx_end=next_idx,
                complete=True, lease=lease)  # fmt: skip
    finally:
        bar.close()
    return report


def _forgotten(
    source: Source,
    report: SourceReport,
    missing: MissingField,
    skips: SkipLog,
    lease: Lease,
    *,
    begun: bool,
    unusable: int = 0,
) -> bool:
    """Forget a source that stored nothing, as if never given, so that a run with the right input or
    field starts clean: an empty input (True: the command says so), or one whose records all lack the
    field or are all unusable (``unusable`` of them: bad JSON, no text; refused). False: the source
    stored something, or its records were all left out by a step (duplicates of stored ones).

    Raises:
        IngestError: no record has the text field, or none is usable.
    """
    unfielded = missing.records and not missing.with_field and not report.inserted
    none_usable = bool(report.read) and not begun and not report.inserted and unusable == report.read
    if not unfielded and not none_usable and (report.read or begun):
        return False
    skips.end_source(source, quiet=True)
    _forget(lease, source)
    if unfielded:
        raise IngestError(
            f"{source.label}: none of its {missing.records} record(s) has the field named by "
            f"{source.flag}; nothing was stored; {missing.advice(source)}"
        )
    if none_usable:
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(report.skipped.items()))
        raise IngestError(
            f"{source.label}: none of its {report.read} record(s) is usable ({why}); nothing was stored; "
            "fix the input (its format: --format), or see which records and why with --report"
        )
    return True


def _check_input(
    source: Source, state: dict[str, Any] | None, sources: dict[str, Any], collection: str
) -> None:
    """Refuse to ingest what would land twice or mixed: a file that changed size since it was ingested
    (its documents there are the old file's; a resume would mix the two), or a built-in sample already in
    the collection under another --limit or version (their documents are the same); a file read before
    with other options is said in a warning (another text field makes other documents).

    Raises:
        IngestError: naming the two and the ways on.
    """
    ways = (
        "ingest it into a fresh collection (--collection NEW), or drop this one first (dsgpt2 drop "
        f"--collection {collection})"
    )
    was, now = (state or {}).get("stamp") or {}, source.stamp
    if was and now and was.get("size") != now.get("size"):
        raise IngestError(
            f"{source.label}: the file changed since it was ingested into {collection!r} "
            f"({was.get('size'):,} bytes then, {now['size']:,} now): the documents there are the old "
            f"file's; {ways}"
        )
    if was and now and was.get("mtime_ns") != now.get("mtime_ns") and (state or {}).get("complete"):
        log.warning("%s: modified since it was ingested into %s (the same size): its documents there are "
                    "as it was then; if its text changed, %s", source.label, collection, ways)  # fmt: skip
    same = [s for k, s in sources.items() if k != source.key and s.get("origin") == source.origin]
    if (state or {}).get("label") or not source.origin or not same:  # read before (or nothing to compare)
        return
    earlier = same[0].get("label")
    if source.origin.startswith("sample:"):
        raise IngestError(
            f"{source.label}: {collection!r} already holds {earlier}; ingesting this too would store the "
            f"documents they share twice: {ways}"
        )
    log.warning("%s: %r already holds this file as %s: the texts the two readings share are stored "
                "twice (dsgpt2 dedup --exact finds them)", source.label, collection, earlier)  # fmt: skip


def _check_read_alike(source: Source, state: dict[str, Any], collection: str) -> None:
    """Refuse to call ``source`` ingested when it was read in another encoding than the one asked now
    (the hint after replaced bytes, followed into the same collection).

    Raises:
        IngestError: naming both encodings and the two ways on.
    """
    asked = source.decoding.encoding if source.decoding is not None else None
    if asked and state.get("encoding", asked) != asked:
        raise IngestError(
            f"{source.label}: already ingested into {collection!r}, read as {state['encoding']}; reading it "
            f"again as {asked} would store each of its documents twice: ingest it into a fresh collection "
            f"(--collection NEW), or drop this one first (dsgpt2 drop --collection {collection})"
        )


def _starting_point(
    conn: Connection,
    collection: str,
    source: Source,
    report: SourceReport,
    state: dict[str, Any] | None,
    *,
    next_idx: int,
    lease: Lease,
) -> int:
    """The first record of ``source`` this run reads: after what an earlier run stored (its counts
    taken into ``report``), or 0 for a source begun now (recorded as begun)."""
    if not (state and "records" in state):
        _record(conn, collection, source, report, records=0, idx_end=next_idx, complete=False, lease=lease)
        return 0
    # More than this run's claim: an earlier run started it.
    start = int(state.get("records", 0))
    # Documents inserted after meta_info was last updated: the batch in flight at a crash.
    since = {SOURCE: source.key, IDX: {"$gte": int(state.get("idx_end", 0))}}
    lag = last_numbered(conn, collection, since, {ID: 0, SOURCE_POS: 1}, f"resuming {source.label}")
    if lag is not None:
        start = int(lag[SOURCE_POS]) + 1
    report.resumed_at = start
    report.skipped.update(state.get("skipped", {}))
    report.inserted = int(state.get("inserted", 0))
    if lag is not None:
        report.inserted += count_where(conn, collection, since, f"resuming {source.label}")
    log.info("%s: resuming after record %d", source.label, start)
    return start


def _flush(
    conn: Connection,
    collection: str,
    source: Source,
    report: SourceReport,
    *,
    batch: list[dict[str, Any]],
    records: int,
    next_idx: int,
    steps: Sequence[Step],
    lease: Lease,
    places: list[dict[str, Any]],
    skips: SkipLog,
) -> int:
    """Number and insert ``batch`` (less what a step does not admit, each located by ``places`` in
    ``skips``), record how far the source is read; returns the next idx."""
    for step in steps:
        if not step.skip_reason:  # admits every document
            continue
        admitted = step.admit(batch)
        report.skipped[step.skip_reason] += len(batch) - len(admitted)
        if len(admitted) < len(batch):
            kept = {id(doc) for doc in admitted}
            for doc, where in zip(batch, places, strict=True):
                if id(doc) not in kept:
                    skips.add(source, where, step.skip_reason)
            places = [where for doc, where in zip(batch, places, strict=True) if id(doc) in kept]
            batch = admitted
    if batch:
        numbered = [{"idx": next_idx + i, **doc} for i, doc in enumerate(batch)]
        for step in steps:
            report.near_duplicates += step.stored(collection, numbered)
        next_idx = insert_batch(conn, collection, numbered)
        report.inserted += len(batch)
    _record(conn, collection, source, report, records=records, idx_end=next_idx, complete=False, lease=lease)
    return next_idx


def _record(
    conn: Connection,
    collection: str,
    source: Source,
    report: SourceReport,
    *,
    records: int,
    idx_end: int,
    complete: bool,
    lease: Lease,
) -> None:
    """Record in meta_info how far ``source`` is read, as long as this run holds it (``lease``)."""
    state = {
        "label": source.label,
        "kind": source.kind,
        "records": records,
        "inserted": report.inserted,
        "skipped": dict(report.skipped),
        "idx_end": idx_end,
        "complete": complete,
        "heartbeat": time.time(),
    }
    if source.decoding is not None:
        state["encoding"] = source.decoding.encoding
    if source.origin:
        state |= {"origin": source.origin, "stamp": source.stamp}
    fields = {f"sources.{source.key}.{k}": v for k, v in state.items()}
    _held_update(lease, source, {
        "$set": {"cleaner_version": CLEANER_VERSION, **fields, "updated_at": time.time()},
        "$max": {"count": idx_end},  # never lowered: another source may have gone further
    })  # fmt: skip


# ---------------------------------------------------------------- one writer per source


def _held_update(lease: Lease, source: Source, update: dict[str, Any]) -> None:
    """Apply ``update`` to the collection's meta_info entry while this run holds ``source``.

    Raises:
        CorpusError: another ingest took the source over (this one was silent past the lease).
    """
    try:
        lease.update(update)
    except LeaseLost:
        raise CorpusError(
            f"{source.label}: another dsgpt2 ingest took over writing it into {lease.collection!r} (this "
            f"one gave no sign of life for {LEASE_SECONDS:.0f}s); this run stops, the other goes on"
        ) from None


def _claim(conn: Connection, collection: str, source: Source) -> Lease:
    """Hold ``source`` for this run.

    Raises:
        CorpusError: a live ingest holds it.
    """
    try:
        lease = Lease.take(conn, collection, f"sources.{source.key}")
    except LeaseHeld as held:
        raise CorpusError(
            f"{source.label}: another dsgpt2 ingest ({held.holder}) is writing it into {collection!r} "
            "now, and one source has one writer; this run stops here; wait for that ingest to end, "
            "then re-run this command (what either has stored is not stored again)"
        ) from None
    except LeaseContested:
        raise CorpusError(
            f"{source.label}: other ingests keep taking it in {collection!r}; run one ingest of it at a time"
        ) from None
    if lease.taken_from:
        log.info("%s: taking over from %s, which stopped", source.label, lease.taken_from)
    return lease


def _forget(lease: Lease, source: Source) -> None:
    """Remove ``source`` from meta_info: it stored nothing."""
    _held_update(lease, source, {"$unset": {lease.path: ""}})
