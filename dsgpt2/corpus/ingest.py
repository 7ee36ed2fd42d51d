"""Ingest: text files or the built-in sample corpus → documents in a collection.

Each source record becomes ``{"idx", "form", "filt_text", "text_hash", "source", "source_pos"}``
(conversations also keep ``turns``): ``idx`` continues after the collection's
largest one, ``form`` is the original text, ``filt_text`` its cleaned form and
``text_hash`` the hash of the text training reads (:mod:`dsgpt2.curation.dedup`).

Exactly once, even when killed: before its first insert a source is recorded
in meta_info; each batch is inserted in order and then meta_info records how
far the source has been read. A re-run skips finished sources and resumes an
unfinished one after the last record that reached the collection, read back
from the documents themselves (``source``/``source_pos``), so a batch that was
inserted but not yet recorded is neither lost nor duplicated.

One writer per source: an ingest holds each source it writes (an owner and a
heartbeat in meta_info), and a second ingest of the same source while the first
lives is refused; a holder that died (its process gone on this machine, or no
heartbeat for ``LEASE_SECONDS``) is taken over by the re-run. Different sources
may go into one collection at once: the unique idx index numbers them apart.

Every skipped record is located (file and 1-based line, or Parquet row group and
row): the first few in the log, all of them in the ``--report`` file.
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
import socket
import sys
import time
import uuid
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dsgpt2.corpus.builtin import SAMPLES, sample_version, stdlib_conversations, stdlib_documents
from dsgpt2.corpus.cleaning import CLEANER_VERSION, clean_text
from dsgpt2.corpus.columnar import FORMATS as COLUMNAR
from dsgpt2.corpus.columnar import Row, Table, check_keep_fields, sniff_binary, storable
from dsgpt2.corpus.columnar import detect as detect_columnar
from dsgpt2.curation.dedup import HASH, SeenTexts, ensure_hash_index
from dsgpt2.curation.pii import redact_document
from dsgpt2.db.client import Connection, DatabaseError, database_errors, with_retries
from dsgpt2.db.idx import ensure_idx_index, insert_batch, max_idx
from dsgpt2.db.meta import read_meta
from dsgpt2.documents import SkipTally, document_hash, turns_text, utf8_encodable
from dsgpt2.errors import BadDocumentError, CorpusError, IngestError
from dsgpt2.files import process_alive
from dsgpt2.progress import progress as progress_display

log = logging.getLogger(__name__)

FORMATS = ("auto", "text", "jsonl", "csv", "conversation", *COLUMNAR)
SPLITS = ("line", "paragraph")
# Speaker names given to query/reply pairs.
QUERY_SPEAKER = "user"
REPLY_SPEAKER = "bot"


# A source held by an ingest whose heartbeat is older than this (on another machine) is taken over.
LEASE_SECONDS = 60.0
# Skipped records named in the log, per source (the --report file lists every one).
SHOWN_SKIPS = 5
# Records read without the text field, none with it, before the log says the field may be wrong.
NO_FIELD_WARNING = 1000


class BadRecord:
    """A source record that cannot become a document, and why (``no_field``: the record's fields,
    each with whether it holds a string)."""

    __slots__ = ("keys", "reason")

    def __init__(self, reason: str, keys: dict[str, bool] | None = None) -> None:
        self.reason = reason
        self.keys = keys


class LineCursor:
    """The 1-based line of the file (as an editor numbers them, blank lines counted) where the record
    a reader yielded last starts."""

    __slots__ = ("line",)

    def __init__(self) -> None:
        self.line = 0


def _by_record_number(pos: int) -> dict[str, Any]:
    return {"record": pos}


def describe(where: dict[str, Any]) -> str:
    """A location of :meth:`Source.locate` in words: ``news.jsonl line 21``, ``x.parquet row group 3,
    row 17``, ``record 20``."""
    if "line" in where:
        return f"{Path(where['file']).name} line {where['line']}"
    if "row_group" in where:
        return f"{Path(where['file']).name} row group {where['row_group']}, row {where['row']}"
    return f"record {where.get('record')}"


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
    # Where the record read last (number ``pos``) is in the input: {"file", "line"} or {"file",
    # "row_group", "row"}, or {"record"} for the built-in samples.
    locate: Callable[[int], dict[str, Any]] = field(default=_by_record_number, repr=False, compare=False)
    flag: str = ""  # the option that names the text field, with its value ("--field body")


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
    *,
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
        return Source(
            key,
            label,
            "text",
            table.rows,
            read_from=table.rows,
            locate=lambda _: table.where(),
            flag=f"--field {field}",
        )
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
    at = LineCursor()

    def locate(_: int) -> dict[str, Any]:
        return {"file": str(p), "line": at.line}

    if fmt == "text":
        return Source(key, label, "text", lambda: _read_text(p, split, tally, at), tally, locate=locate)
    if fmt == "jsonl":
        return Source(key, label, "text", lambda: _read_jsonl(p, field, tally, keep_fields, at), tally,
                      locate=locate, flag=f"--field {field}")  # fmt: skip
    if fmt == "csv":
        _check_csv_header(p, column, tally, keep_fields)
        return Source(key, label, "text", lambda: _read_csv(p, column, tally, keep_fields, at), tally,
                      locate=locate, flag=f"--column {column}")  # fmt: skip
    return Source(key, label, "conversation", lambda: _read_conversations(p, tally, at), tally, locate=locate)


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


def _read_text(
    path: Path, split: str, tally: DecodeTally | None = None, at: LineCursor | None = None
) -> Iterator[Any]:
    at = at or LineCursor()
    with open_text(path, tally) as f:
        if split == "line":
            for n, line in enumerate(f, 1):
                at.line = n
                yield line.rstrip("\r\n")
            return
        para: list[str] = []
        first = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                first = first if para else n
                para.append(line)
            elif para:
                at.line = first
                yield "".join(para)
                para = []
        if para:
            at.line = first
            yield "".join(para)


def _json_lines(path: Path, tally: DecodeTally | None = None, at: LineCursor | None = None) -> Iterator[Any]:
    at = at or LineCursor()
    with open_text(path, tally) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            at.line = n
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                # RecursionError: nesting deeper than the parser's stack (e.g. 100,000 "[").
                yield BadRecord("bad_json")


def _read_jsonl(
    path: Path,
    field_name: str,
    tally: DecodeTally | None = None,
    keep: tuple[str, ...] = (),
    at: LineCursor | None = None,
) -> Iterator[Any]:
    for obj in _json_lines(path, tally, at):
        if isinstance(obj, BadRecord):
            yield obj
        elif not isinstance(obj, dict):
            yield BadRecord("bad_json")
        elif field_name not in obj:
            yield BadRecord("no_field", {str(k): isinstance(v, str) for k, v in obj.items()})
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
    path: Path,
    column: str,
    tally: DecodeTally | None = None,
    keep: tuple[str, ...] = (),
    at: LineCursor | None = None,
) -> Iterator[Any]:
    at = at or LineCursor()
    with open_text(path, tally) as f:
        # csv.reader, not DictReader: a record's first line is the line after the previous record's
        # last, and DictReader passes over blank lines without saying so.
        reader = csv.reader(f)
        csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
        header = next(reader, [])
        end = reader.line_num
        for values in reader:
            at.line, end = end + 1, reader.line_num
            if not values:
                continue
            row = dict(zip(header, values, strict=False))
            value = row.get(column)
            if value is None:
                yield BadRecord("no_field")
            else:
                yield Row(value, {k: row.get(k) for k in keep}) if keep else value


def _read_conversations(
    path: Path, tally: DecodeTally | None = None, at: LineCursor | None = None
) -> Iterator[Any]:
    for obj in _json_lines(path, tally, at):
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


def make_document(record: Any, kind: str, *, pii: bool = False) -> dict[str, Any] | str:
    """The fields of a document for ``record``, or the reason it is skipped; with ``pii``, its text
    redacted and the counts in ``pii`` (``form`` keeps the original)."""
    if pii:
        doc = make_document(record, kind)
        if isinstance(doc, dict):
            doc.update(redact_document(doc, "filt_text") or {})
        return doc
    if isinstance(record, BadRecord):
        return record.reason
    if isinstance(record, Row):
        doc = make_document(record.text, kind)
        if isinstance(doc, dict):
            doc.update(record.fields)
        return doc
    if kind == "conversation":
        return {"form": record["form"], "filt_text": turns_text(record["turns"]), "turns": record["turns"]}
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


class SkipLog:
    """Where each skipped record is: every one in the ``--report`` file (one JSON object a line: the
    file and line, or the file, row group and row; and the reason), the first few of a source in the
    log when the source ends."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else str(path)
        self.file: TextIO | None = None
        self.first: list[str] = []
        self.count = 0
        if self.path is not None:
            try:
                self.file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
            except OSError as exc:
                raise IngestError(
                    f"cannot write --report {self.path!r}: {exc.strerror or exc}; give a writable path"
                ) from None

    def add(self, source: Source, where: dict[str, Any], reason: str) -> None:
        self.count += 1
        if len(self.first) < SHOWN_SKIPS:
            self.first.append(f"{describe(where)} ({reason})")
        if self.file is not None:
            entry = where if "file" in where else {"source": source.label, **where}
            self.file.write(json.dumps({**entry, "reason": reason}) + "\n")

    def end_source(self, source: Source, quiet: bool = False) -> None:
        """Log the first skipped records of ``source`` (not when ``quiet``: an error says more)."""
        if self.first and not quiet:
            more = self.count - len(self.first)
            rest = ""
            if more:
                rest = f" and {more} more (--report {self.path or 'FILE'} lists each)"
            log.warning("%s: skipped %s%s", source.label, ", ".join(self.first), rest)
        self.first, self.count = [], 0

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class MissingField:
    """The records without the text field, and the fields they have instead (for the line that says
    the field asked for is not there)."""

    KEPT = 1000  # records whose field names are counted

    def __init__(self) -> None:
        self.records = 0
        self.with_field = 0
        self.keys: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()  # fields holding a string

    def add(self, keys: dict[str, bool] | None) -> None:
        self.records += 1
        if keys and self.records <= self.KEPT:
            self.keys.update(list(keys))
            self.texts.update(k for k, is_text in keys.items() if is_text)

    def fields(self) -> str:
        return ", ".join(k for k, _ in self.keys.most_common(12)) or "none"

    def advice(self, source: Source) -> str:
        flag = source.flag.split(" ")[0]
        best = "text" if "text" in self.texts else next(iter(k for k, _ in self.texts.most_common(1)), None)
        example = f", e.g. {flag} {best}" if best else ""
        return (
            f"its records have the fields {self.fields()}; name the one holding the text with {flag}{example}"
        )


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
    *,
    progress: bool = False,
    dedup: bool = False,
    report_file: str | os.PathLike[str] | None = None,
    pii: bool = False,
) -> IngestReport:
    """Append every record of ``sources`` to ``collection`` exactly once (see module doc). With
    ``dedup``, a record whose text the corpus already holds (``collection`` and the config's
    collections, by ``text_hash``) is skipped and counted as ``duplicate``. ``report_file``: a JSON
    lines file that lists where each record this run skipped is, and why. With ``pii``, each document's
    text is redacted (:func:`dsgpt2.curation.pii.redact_document`) before it is hashed and inserted.

    Raises:
        IngestError: bad options or unreadable input, or no record of a source has its text field.
        BadDocumentError: a record is unusable and ``strict`` is on.
        CorpusError: the collection's idx is broken, or another ingest is writing the same source.
    """
    if batch_size <= 0:
        raise IngestError(f"--batch_size must be positive; got {batch_size}")
    started = time.monotonic()
    coll = conn.db[collection]
    skips = SkipLog(report_file)
    try:
        with database_errors(conn.config, f"ingest into {collection!r}", "re-run the same command to resume"):
            with_retries(lambda: ensure_idx_index(coll), conn.config, f"indexing {collection}")
            # Built here, not only by `dedup --exact`: `ingest --dedup` asks it of every batch.
            with_retries(lambda: ensure_hash_index(conn, collection), conn.config, f"indexing {collection}")
            seen = SeenTexts.open(conn, [collection, *conn.config.collections]) if dedup else None
            reports = [
                _ingest_source(
                    conn,
                    collection,
                    source,
                    batch_size,
                    strict,
                    progress=progress,
                    seen=seen,
                    skips=skips,
                    pii=pii,
                )
                for source in sources
            ]
            top = max_idx(coll)
    finally:
        skips.close()
    count = 0 if top is None else top + 1
    return IngestReport(collection, reports, count, time.monotonic() - started)


def _ingest_source(
    conn: Connection,
    collection: str,
    source: Source,
    batch_size: int,
    strict: bool,
    *,
    progress: bool,
    seen: SeenTexts | None = None,
    skips: SkipLog | None = None,
    pii: bool = False,
) -> SourceReport:
    """Ingest one source, holding it (see module doc) while this process writes it."""
    owner = _claim(conn, collection, source)
    try:
        return _write_source(
            conn,
            collection,
            source,
            batch_size,
            strict,
            progress=progress,
            seen=seen,
            skips=skips or SkipLog(),
            owner=owner,
            pii=pii,
        )
    finally:
        _release(conn, collection, source, owner)


def _write_source(
    conn: Connection,
    collection: str,
    source: Source,
    batch_size: int,
    strict: bool,
    *,
    progress: bool,
    seen: SeenTexts | None,
    skips: SkipLog,
    owner: str,
    pii: bool = False,
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
    start = _starting_point(conn, collection, source, report, state, next_idx=next_idx, owner=owner)
    batch: list[dict[str, Any]] = []
    places: list[dict[str, Any]] | None = [] if seen is not None else None  # where each of batch is
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
                _beat(conn, collection, source, owner)
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
            doc = make_document(record, source.kind, pii=pii)
            if isinstance(doc, str):
                report.skipped[doc] += 1
                where = source.locate(pos)
                if strict:
                    raise BadDocumentError(
                        f"{source.label}: {describe(where)} is unusable ({doc}); fix it, or run without "
                        "--strict"
                    )
                skips.add(source, where, doc)
                continue
            doc[HASH] = document_hash(doc, conn.config.text_field)
            batch.append({**doc, "source": source.key, "source_pos": pos})
            if places is not None:
                places.append(source.locate(pos))
            if len(batch) >= batch_size:
                next_idx = _flush(conn, coll, collection, source, report, batch=batch, records=pos + 1,
                                  next_idx=next_idx, seen=seen, owner=owner, places=places,
                                  skips=skips)  # fmt: skip
                batch, places, beat = [], [] if places is not None else None, time.monotonic()
        next_idx = _flush(conn, coll, collection, source, report, batch=batch, records=max(pos + 1, start),
                          next_idx=next_idx, seen=seen, owner=owner, places=places, skips=skips)  # fmt: skip
        if missing.records and not missing.with_field and not report.inserted and damage is None:
            # Nothing stored: the source is forgotten, so that the run with the right field starts clean.
            skips.end_source(source, quiet=True)
            _forget(conn, collection, source, owner)
            raise IngestError(
                f"{source.label}: none of its {missing.records} record(s) has the field named by "
                f"{source.flag}; nothing was stored; {missing.advice(source)}"
            )
        skips.end_source(source)
        if damage is not None:
            raise IngestError(
                f"{source.label}: the file is damaged after record {pos + 1} "
                f"({type(damage).__name__}: {str(damage).strip() or 'no detail'}); the records before it "
                "are ingested; repair or replace the file and re-run the same command to resume"
            )
        _record(conn, collection, source, report, records=max(pos + 1, start), idx_end=next_idx,
                complete=True, owner=owner)  # fmt: skip
    finally:
        bar.close()
    return report


def _starting_point(
    conn: Connection,
    collection: str,
    source: Source,
    report: SourceReport,
    state: dict[str, Any] | None,
    *,
    next_idx: int,
    owner: str,
) -> int:
    """The first record of ``source`` this run reads: after what an earlier run stored (its counts
    taken into ``report``), or 0 for a source begun now (recorded as begun)."""
    coll = conn.db[collection]
    if not (state and "records" in state):
        _record(conn, collection, source, report, records=0, idx_end=next_idx, complete=False, owner=owner)
        return 0
    # More than this run's claim: an earlier run started it.
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
    return start


def _flush(
    conn: Connection,
    coll: Any,
    collection: str,
    source: Source,
    report: SourceReport,
    *,
    batch: list[dict[str, Any]],
    records: int,
    next_idx: int,
    seen: SeenTexts | None,
    owner: str,
    places: list[dict[str, Any]] | None = None,
    skips: SkipLog | None = None,
) -> int:
    """Number and insert ``batch`` (with ``--dedup``, less the texts the corpus holds, each located
    by ``places`` in ``skips``), record how far the source is read; returns the next idx."""
    if seen is not None:
        fresh = seen.fresh(batch)
        report.skipped["duplicate"] += len(batch) - len(fresh)
        if skips is not None and places is not None and len(fresh) < len(batch):
            kept = {id(doc) for doc in fresh}
            for doc, where in zip(batch, places, strict=True):
                if id(doc) not in kept:
                    skips.add(source, where, "duplicate")
        batch = fresh
    if batch:
        numbered = [{"idx": next_idx + i, **doc} for i, doc in enumerate(batch)]
        if seen is not None:
            report.near_duplicates += seen.mark_near(collection, numbered)
        next_idx = insert_batch(conn, coll, numbered)
        report.inserted += len(batch)
    _record(conn, collection, source, report, records=records, idx_end=next_idx, complete=False, owner=owner)
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
    owner: str,
) -> None:
    """Record in meta_info how far ``source`` is read, as long as this run (``owner``) holds it."""
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
    fields = {f"sources.{source.key}.{k}": v for k, v in state.items()}
    _held_update(conn, collection, source, owner, {
        "$set": {"cleaner_version": CLEANER_VERSION, **fields, "updated_at": time.time()},
        "$max": {"count": idx_end},  # never lowered: another source may have gone further
    })  # fmt: skip


# ---------------------------------------------------------------- one writer per source


def _meta(conn: Connection) -> Any:
    return conn.db[conn.config.meta_collection]


def _held_update(
    conn: Connection, collection: str, source: Source, owner: str, update: dict[str, Any]
) -> None:
    """Apply ``update`` to the collection's meta_info entry while ``owner`` holds ``source``.

    Raises:
        CorpusError: another ingest took the source over (this one was silent past the lease).
    """
    held = {"collection": collection, f"sources.{source.key}.owner": owner}
    if _meta(conn).update_one(held, update).matched_count == 0:
        raise CorpusError(
            f"{source.label}: another dsgpt2 ingest took over writing it into {collection!r} (this one "
            f"gave no sign of life for {LEASE_SECONDS:.0f}s); this run stops, the other goes on"
        )


def _beat(conn: Connection, collection: str, source: Source, owner: str) -> None:
    _held_update(conn, collection, source, owner, {"$set": {f"sources.{source.key}.heartbeat": time.time()}})


def _alive(owner: str, heartbeat: Any) -> bool:
    """Whether the ingest ``owner`` (``host:pid:token``) may still be writing: on this machine, while
    its process lives; elsewhere, while its heartbeat is younger than ``LEASE_SECONDS``."""
    host, _, rest = owner.rpartition(":")[0].rpartition(":")
    pid = int(rest) if rest.isdigit() else -1
    if host == socket.gethostname() and pid > 0:
        return process_alive(pid)
    return isinstance(heartbeat, int | float) and time.time() - heartbeat < LEASE_SECONDS


def _claim(conn: Connection, collection: str, source: Source) -> str:
    """Hold ``source`` for this run: returns the owner token.

    Raises:
        CorpusError: a live ingest holds it.
    """
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    meta = _meta(conn)
    key = f"sources.{source.key}"
    # The entry exists before the conditional update takes the source.
    meta.update_one({"collection": collection}, {"$setOnInsert": {"collection": collection}}, upsert=True)
    for _ in range(5):
        entry = meta.find_one({"collection": collection}, {"_id": 0, key: 1}) or {}
        held = (entry.get("sources") or {}).get(source.key) or {}
        holder = held.get("owner")
        if holder and _alive(str(holder), held.get("heartbeat")):
            raise CorpusError(
                f"{source.label}: another dsgpt2 ingest ({holder}) is writing it into {collection!r} "
                "now, and one source has one writer; this run stops here; wait for that ingest to end, "
                "then re-run this command (what either has stored is not stored again)"
            )
        # Taken only if nobody took it since it was read (a racing ingest reads it held, above).
        took = meta.update_one(
            {"collection": collection, f"{key}.owner": holder},
            {"$set": {f"{key}.owner": owner, f"{key}.heartbeat": time.time()}},
        )
        if took.modified_count == 1:
            if holder:
                log.info("%s: taking over from %s, which stopped", source.label, holder)
            return owner
    raise CorpusError(
        f"{source.label}: other ingests keep taking it in {collection!r}; run one ingest of it at a time"
    )


def _release(conn: Connection, collection: str, source: Source, owner: str) -> None:
    """Let go of ``source`` (whatever ended this run: a re-run may take it at once)."""
    try:
        _meta(conn).update_one({"collection": collection, f"sources.{source.key}.owner": owner},
                               {"$set": {f"sources.{source.key}.owner": None}})  # fmt: skip
    except DatabaseError as exc:  # the server is gone: the error that ended the run says more
        log.debug("%s: not released (%s)", source.label, exc)


def _forget(conn: Connection, collection: str, source: Source, owner: str) -> None:
    """Remove ``source`` from meta_info: it stored nothing."""
    _held_update(conn, collection, source, owner, {"$unset": {f"sources.{source.key}": ""}})
