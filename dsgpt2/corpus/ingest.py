"""Ingest: text files or the built-in sample corpus → documents in a collection.

Each source record becomes ``{"idx", "form", "filt_text", "text_hash", "source", "source_pos"}``
(conversations also keep ``turns``): ``idx`` continues after the collection's
largest one, ``form`` is the original text, ``filt_text`` its cleaned form and
``text_hash`` the hash of the text training reads (:mod:`dsgpt2.corpus.dedup`).

Exactly once, even when killed: before its first insert a source is recorded
in meta_info; each batch is inserted in order and then meta_info records how
far the source has been read. A re-run skips finished sources and resumes an
unfinished one after the last record that reached the collection, read back
from the documents themselves (``source``/``source_pos``), so a batch that was
inserted but not yet recorded is neither lost nor duplicated.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import io
import json
import logging
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dsgpt2.corpus.builtin import SAMPLES, sample_version, stdlib_conversations, stdlib_documents
from dsgpt2.corpus.cleaning import CLEANER_VERSION, clean_text
from dsgpt2.corpus.columnar import FORMATS as COLUMNAR
from dsgpt2.corpus.columnar import Row, Table, check_keep_fields, sniff_binary, storable
from dsgpt2.corpus.columnar import detect as detect_columnar
from dsgpt2.corpus.dedup import HASH, SeenTexts, document_hash
from dsgpt2.corpus.documents import SkipTally, utf8_encodable
from dsgpt2.corpus.mongo import (
    Connection,
    database_errors,
    ensure_idx_index,
    insert_batch,
    max_idx,
    read_meta,
    with_retries,
    write_meta,
)
from dsgpt2.errors import BadDocumentError, IngestError
from dsgpt2.progress import progress as progress_display

log = logging.getLogger(__name__)

FORMATS = ("auto", "text", "jsonl", "csv", "conversation", *COLUMNAR)
SPLITS = ("line", "paragraph")
# Speaker names given to query/reply pairs.
QUERY_SPEAKER = "user"
REPLY_SPEAKER = "bot"


class BadRecord:
    """A source record that cannot become a document, and why."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass(frozen=True)
class Source:
    """Where records come from, and the key that makes its ingest resumable."""

    key: str
    label: str
    kind: str  # "text" or "conversation"
    read: Callable[[], Iterator[Any]] = field(repr=False, compare=False)
    decoding: DecodeTally | None = field(default=None, repr=False, compare=False)
    # Sources that can start at a record number without reading the ones before it (columnar files).
    read_from: Callable[[int], Iterator[Any]] | None = field(default=None, repr=False, compare=False)


@dataclass
class DecodeTally:
    """Byte sequences of a file that were not valid in its encoding (each became U+FFFD)."""

    encoding: str = "utf-8"
    replaced: int = 0

    def errors(self) -> str:
        """The name of a codec error handler that replaces and counts."""
        name = f"dsgpt2-count-{id(self)}"

        def replace(exc: UnicodeError) -> tuple[str, int]:
            self.replaced += 1
            return "\ufffd", exc.end  # type: ignore[attr-defined]

        codecs.register_error(name, replace)
        return name


def _key(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format a path implies: ``.jsonl``/``.json`` → jsonl, ``.csv`` → csv, ``.parquet`` → parquet,
    ``.arrow``/``.feather`` → arrow, a ``save_to_disk`` directory → dataset (Parquet and Arrow are also
    known by their first bytes, whatever the name), else text."""
    columnar = detect_columnar(Path(path))
    if columnar:
        return columnar
    name = str(path).lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".csv"):
        return "csv"
    return "text"


def file_source(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    field: str = "text",
    column: str = "text",
    split: str = "line",
    encoding: str = "utf-8",
    keep_fields: tuple[str, ...] = (),
) -> Source:
    """A file (gzip transparently) read as ``fmt`` in ``encoding``; a Parquet or Arrow file, or a
    ``datasets`` directory, read in record batches. ``keep_fields``: columns (jsonl: keys) stored on
    each document beside its text.

    Raises:
        IngestError: the file is missing, binary where text is expected, or the format or its options
            are invalid.
    """
    p = Path(path)
    if not p.is_file() and not (p.is_dir() and fmt in ("auto", "dataset")):
        raise IngestError(f"input file {str(p)!r} not found")
    if fmt not in FORMATS:
        raise IngestError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if split not in SPLITS:
        raise IngestError(f"unknown --split {split!r}; choose one of {', '.join(SPLITS)}")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise IngestError(f"unknown --encoding {encoding!r}; e.g. utf-8, latin-1, cp1252") from None
    check_keep_fields(keep_fields)
    tally = DecodeTally(encoding)
    fmt = detect_format(p) if fmt == "auto" else fmt
    kept = f" +{','.join(keep_fields)}" if keep_fields else ""
    if fmt in COLUMNAR:
        table = Table(p, fmt, field, keep_fields)
        key = _key("file", str(p.resolve()), fmt, field, *keep_fields)
        label = f"{p.name} ({fmt}: {field}{kept})"
        return Source(key, label, "text", table.rows, read_from=table.rows)
    if keep_fields and fmt not in ("jsonl", "csv"):
        raise IngestError(f"--keep_fields goes with jsonl, csv, parquet, arrow and dataset inputs, not {fmt}")
    if codecs.lookup(encoding).name in ("utf-8", "ascii", "latin-1", "cp1252", "iso8859-1"):
        binary = sniff_binary(p)
        if binary:
            raise IngestError(
                f"{p.name} is {binary}, not {fmt} text; nothing was stored. Parquet, Arrow and `datasets` "
                "inputs are read by their own readers (--format parquet|arrow|dataset); convert other "
                "binary files to text first"
            )
    option = {"text": split, "jsonl": field, "csv": column, "conversation": ""}[fmt]
    key = _key("file", str(p.resolve()), fmt, option, *keep_fields)
    label = f"{p.name} ({fmt}{': ' + option if option else ''}{kept})"
    if fmt == "text":
        return Source(key, label, "text", lambda: _read_text(p, split, tally), tally)
    if fmt == "jsonl":
        return Source(key, label, "text", lambda: _read_jsonl(p, field, tally, keep_fields), tally)
    if fmt == "csv":
        _check_csv_header(p, column, tally, keep_fields)
        return Source(key, label, "text", lambda: _read_csv(p, column, tally, keep_fields), tally)
    return Source(key, label, "conversation", lambda: _read_conversations(p, tally), tally)


def builtin_source(name: str = "stdlib", limit: int | None = None) -> Source:
    """A built-in sample (see :mod:`dsgpt2.corpus.builtin`), at most ``limit`` records.

    ``stdlib`` is the pretraining sample; ``stdlib-chat`` its conversation sample.
    """
    if name not in SAMPLES:
        raise IngestError(f"unknown sample {name!r}; the built-in samples are {', '.join(SAMPLES)}")
    if limit is not None and limit <= 0:
        raise IngestError(f"--limit must be a positive number of documents; got {limit}")
    version = sample_version()
    label = f"sample {name} {version}" + (f" (first {limit})" if limit else "")
    if name == "stdlib-chat":
        return Source(
            _key("sample", name, version, str(limit)),
            label,
            "conversation",
            lambda: (normalize_conversation(c) for c in stdlib_conversations(limit)),
        )
    return Source(_key("sample", version, str(limit)), label, "text", lambda: stdlib_documents(limit))


def open_text(path: Path, tally: DecodeTally | None = None) -> TextIO:
    """Open a text file, gunzipping it when it is gzip; undecodable bytes become U+FFFD.

    The encoding is ``tally``'s (UTF-8 by default), which also counts the replaced bytes. In UTF-8
    a byte-order mark at the start is dropped (``utf-8-sig``): spreadsheet programs write one
    before a CSV header.
    """
    tally = tally or DecodeTally()
    encoding = tally.encoding
    if codecs.lookup(encoding).name == "utf-8":
        encoding = "utf-8-sig"
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    try:
        raw = gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise IngestError(f"cannot read {str(path)!r}: {exc}") from None
    return io.TextIOWrapper(raw, encoding=encoding, errors=tally.errors(), newline="")


# What reading a damaged file raises: a truncated gzip (EOFError), a bad CRC or header
# (gzip.BadGzipFile, an OSError), damaged deflate data (zlib.error), a malformed CSV.
DAMAGED_INPUT = (EOFError, OSError, zlib.error, csv.Error)


def _read_text(path: Path, split: str, tally: DecodeTally | None = None) -> Iterator[Any]:
    with open_text(path, tally) as f:
        if split == "line":
            for line in f:
                yield line.rstrip("\r\n")
            return
        para: list[str] = []
        for line in f:
            if line.strip():
                para.append(line)
            elif para:
                yield "".join(para)
                para = []
        if para:
            yield "".join(para)


def _json_lines(path: Path, tally: DecodeTally | None = None) -> Iterator[Any]:
    with open_text(path, tally) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                # RecursionError: nesting deeper than the parser's stack (e.g. 100,000 "[").
                yield BadRecord("bad_json")


def _read_jsonl(
    path: Path, field_name: str, tally: DecodeTally | None = None, keep: tuple[str, ...] = ()
) -> Iterator[Any]:
    for obj in _json_lines(path, tally):
        if isinstance(obj, BadRecord):
            yield obj
        elif not isinstance(obj, dict):
            yield BadRecord("bad_json")
        elif field_name not in obj:
            yield BadRecord("no_field")
        elif keep:
            yield Row(obj[field_name], {k: storable(obj.get(k)) for k in keep})
        else:
            yield obj[field_name]


def _csv_reader(f: TextIO) -> csv.DictReader:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    return csv.DictReader(f)


def _check_csv_header(
    path: Path, column: str, tally: DecodeTally | None = None, keep: tuple[str, ...] = ()
) -> None:
    with open_text(path, DecodeTally(tally.encoding) if tally else None) as f:
        header = _csv_reader(f).fieldnames or []
    for name, flag in [(column, "--column"), *((k, "--keep_fields") for k in keep)]:
        if name not in header:
            raise IngestError(
                f"{path.name} has no column {name!r}; its columns are {header}; pick one with {flag}"
            )


def _read_csv(
    path: Path, column: str, tally: DecodeTally | None = None, keep: tuple[str, ...] = ()
) -> Iterator[Any]:
    with open_text(path, tally) as f:
        for row in _csv_reader(f):
            value = row.get(column)
            if value is None:
                yield BadRecord("no_field")
            else:
                yield Row(value, {k: row.get(k) for k in keep}) if keep else value


def _read_conversations(path: Path, tally: DecodeTally | None = None) -> Iterator[Any]:
    for obj in _json_lines(path, tally):
        yield obj if isinstance(obj, BadRecord) else normalize_conversation(obj)


def normalize_conversation(obj: Any) -> dict[str, Any] | BadRecord:
    """``{"turns": [{speaker, text}, ...]}`` or ``{"query", "reply"}`` → cleaned turns.

    Turns with empty text are dropped; fewer than two turns is not a conversation.
    """
    if not isinstance(obj, dict):
        return BadRecord("bad_conversation")
    if "turns" in obj:
        raw = obj["turns"]
        if not isinstance(raw, list):
            return BadRecord("bad_conversation")
    elif "query" in obj and "reply" in obj:
        raw = [
            {"speaker": QUERY_SPEAKER, "text": obj["query"]},
            {"speaker": REPLY_SPEAKER, "text": obj["reply"]},
        ]
    else:
        return BadRecord("bad_conversation")
    turns = []
    for turn in raw:
        if not isinstance(turn, dict):
            return BadRecord("bad_conversation")
        speaker, text = turn.get("speaker"), turn.get("text")
        if not isinstance(speaker, str) or not speaker.strip() or not isinstance(text, str):
            return BadRecord("bad_conversation")
        text = clean_text(text)
        if text:
            turns.append({"speaker": speaker.strip(), "text": text})
    if len(turns) < 2:
        return BadRecord("empty")
    return {"turns": turns, "form": json.dumps(obj, ensure_ascii=False)}


def make_document(record: Any, kind: str) -> dict[str, Any] | str:
    """The fields of a document for ``record``, or the reason it is skipped."""
    if isinstance(record, BadRecord):
        return record.reason
    if isinstance(record, Row):
        doc = make_document(record.text, kind)
        if isinstance(doc, dict):
            doc.update(record.fields)
        return doc
    if kind == "conversation":
        text = "\n".join(f"{t['speaker']}: {t['text']}" for t in record["turns"])
        return {"form": record["form"], "filt_text": text, "turns": record["turns"]}
    if record is None:
        return "null"
    if not isinstance(record, str):
        return "not_string"
    filt = clean_text(record)
    if not filt:
        return "empty"
    # A real server refuses strings with lone surrogates; keep the original otherwise.
    form = record if utf8_encodable(record) else record.encode("utf-8", "replace").decode("utf-8")
    return {"form": form, "filt_text": filt}


@dataclass
class SourceReport:
    """What one source contributed in one run."""

    label: str
    read: int = 0
    inserted: int = 0
    skipped: SkipTally = field(default_factory=SkipTally)
    resumed_at: int = 0
    already_done: bool = False
    decoding: DecodeTally | None = None
    near_duplicates: int = 0  # inserted marked near_dup_of (ingest --dedup after a dedup --near)


@dataclass
class IngestReport:
    """The outcome of :func:`ingest`."""

    collection: str
    sources: list[SourceReport]
    count: int
    seconds: float

    @property
    def inserted(self) -> int:
        return sum(s.inserted for s in self.sources)

    def lines(self) -> list[str]:
        out = []
        for s in self.sources:
            if s.already_done:
                out.append(f"{s.label}: already ingested, nothing to do")
                continue
            resumed = f", resumed after record {s.resumed_at}" if s.resumed_at else ""
            near = f" ({s.near_duplicates} marked near_dup_of)" if s.near_duplicates else ""
            read = f"{s.label}: {s.read} records read{resumed}"
            out.append(f"{read}, {s.inserted} inserted{near}, {s.skipped.summary()}")
            if s.decoding is not None and s.decoding.replaced:
                out.append(
                    f"{s.label}: {s.decoding.replaced} byte sequence(s) not valid {s.decoding.encoding} "
                    "were replaced by U+FFFD; give the file's encoding with --encoding (e.g. latin-1, "
                    "cp1252) in a fresh collection"
                )
        out.append(f"{self.collection}: {self.count} documents ({self.seconds:.1f}s)")
        return out


def ingest(
    conn: Connection,
    collection: str,
    sources: list[Source],
    batch_size: int = 1000,
    strict: bool = False,
    progress: bool = False,
    dedup: bool = False,
) -> IngestReport:
    """Append every record of ``sources`` to ``collection`` exactly once (see module doc). With
    ``dedup``, a record whose text the corpus already holds (``collection`` and the config's
    collections, by ``text_hash``) is skipped and counted as ``duplicate``.

    Raises:
        IngestError: bad options or unreadable input.
        BadDocumentError: a record is unusable and ``strict`` is on.
        CorpusError: the collection's idx is broken, or another writer interferes.
    """
    if batch_size <= 0:
        raise IngestError(f"--batch_size must be positive; got {batch_size}")
    started = time.monotonic()
    coll = conn.db[collection]
    with database_errors(conn.config, f"ingest into {collection!r}", "re-run the same command to resume"):
        with_retries(lambda: ensure_idx_index(coll), conn.config, f"indexing {collection}")
        seen = SeenTexts.open(conn, [collection, *conn.config.collections]) if dedup else None
        reports = []
        for source in sources:
            reports.append(_ingest_source(conn, collection, source, batch_size, strict, progress, seen))
        top = max_idx(coll)
    count = 0 if top is None else top + 1
    return IngestReport(collection, reports, count, time.monotonic() - started)


def _ingest_source(
    conn: Connection,
    collection: str,
    source: Source,
    batch_size: int,
    strict: bool,
    progress: bool,
    seen: SeenTexts | None = None,
) -> SourceReport:
    coll = conn.db[collection]
    report = SourceReport(source.label, decoding=source.decoding)
    state = read_meta(conn, [collection]).get(collection, {}).get("sources", {}).get(source.key)
    top = max_idx(coll)
    next_idx = 0 if top is None else top + 1
    if state and state.get("complete"):
        report.already_done = True
        log.info("%s: already ingested into %s", source.label, collection)
        return report
    if state:
        start = int(state.get("records", 0))
        # Documents inserted after meta_info was last updated: the batch in flight at a crash.
        lag = coll.find_one(
            {"source": source.key, "idx": {"$gte": int(state.get("idx_end", 0))}},
            {"_id": 0, "source_pos": 1},
            sort=[("idx", -1)],
        )
        if lag is not None:
            start = int(lag["source_pos"]) + 1
        report.resumed_at = start
        report.skipped.update(state.get("skipped", {}))
        report.inserted = int(state.get("inserted", 0))
        if lag is not None:
            report.inserted += coll.count_documents(
                {"source": source.key, "idx": {"$gte": int(state.get("idx_end", 0))}}
            )
        log.info("%s: resuming after record %d", source.label, start)
    else:
        start = 0
        _record(conn, collection, source, report, records=0, idx_end=next_idx, complete=False)

    batch: list[dict[str, Any]] = []
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
            if pos < start:
                continue
            report.read += 1
            bar.update(1)
            doc = make_document(record, source.kind)
            if isinstance(doc, str):
                report.skipped[doc] += 1
                if strict:
                    raise BadDocumentError(
                        f"{source.label}: record {pos} is unusable ({doc}); fix it, or run without --strict"
                    )
                continue
            doc[HASH] = document_hash(doc, conn.config.text_field)
            batch.append({**doc, "source": source.key, "source_pos": pos})
            if len(batch) >= batch_size:
                next_idx = _flush(conn, coll, collection, source, report, batch, pos + 1, next_idx, seen)
                batch = []
        next_idx = _flush(conn, coll, collection, source, report, batch, max(pos + 1, start), next_idx, seen)
        if damage is not None:
            raise IngestError(
                f"{source.label}: the file is damaged after record {pos + 1} "
                f"({type(damage).__name__}: {str(damage).strip() or 'no detail'}); the records before it "
                "are ingested; repair or replace the file and re-run the same command to resume"
            )
        _record(
            conn, collection, source, report, records=max(pos + 1, start), idx_end=next_idx, complete=True
        )
    finally:
        bar.close()
    return report


def _flush(
    conn: Connection,
    coll: Any,
    collection: str,
    source: Source,
    report: SourceReport,
    batch: list[dict[str, Any]],
    records: int,
    next_idx: int,
    seen: SeenTexts | None,
) -> int:
    """Number and insert ``batch`` (with ``--dedup``, less the texts the corpus holds), record how far
    the source is read; returns the next idx."""
    if seen is not None:
        fresh = seen.fresh(batch)
        report.skipped["duplicate"] += len(batch) - len(fresh)
        batch = fresh
    if batch:
        numbered = [{"idx": next_idx + i, **doc} for i, doc in enumerate(batch)]
        if seen is not None:
            report.near_duplicates += seen.mark_near(collection, numbered)
        next_idx = insert_batch(conn, coll, numbered)
        report.inserted += len(batch)
    _record(conn, collection, source, report, records=records, idx_end=next_idx, complete=False)
    return next_idx


def _record(
    conn: Connection,
    collection: str,
    source: Source,
    report: SourceReport,
    records: int,
    idx_end: int,
    complete: bool,
) -> None:
    state = {
        "label": source.label,
        "kind": source.kind,
        "records": records,
        "inserted": report.inserted,
        "skipped": dict(report.skipped),
        "idx_end": idx_end,
        "complete": complete,
    }
    write_meta(
        conn,
        collection,
        {
            "cleaner_version": CLEANER_VERSION,
            f"sources.{source.key}": state,
            "updated_at": time.time(),
        },
        at_least={"count": idx_end},
    )
