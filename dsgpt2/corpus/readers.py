"""Where ingest's records come from: text, JSON lines, CSV and conversation files, the columnar
inputs of :mod:`dsgpt2.corpus.columnar`, and the built-in samples, each a :class:`Source` with the key
that makes its ingest resumable and the location of each record it yields.

Reading is kept apart from writing so that a record is turned into a document (or a reason to skip it)
the same way whoever reads it: the exactly-once writer, a benchmark, a test.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import io
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dsgpt2.corpus.builtin import SAMPLES, sample_version, stdlib_conversations, stdlib_documents
from dsgpt2.corpus.cleaning import clean_text
from dsgpt2.corpus.columnar import Row, Table, check_keep_fields, kept_as, sniff_binary, storable
from dsgpt2.corpus.columnar import detect as detect_columnar
from dsgpt2.corpus.formats import COLUMNAR, FORMATS
from dsgpt2.curation.pii import redact_document
from dsgpt2.documents import turns_text, utf8_encodable
from dsgpt2.errors import IngestError

TEXT_SPLITS = ("line", "paragraph")
# Speaker names given to query/reply pairs.
QUERY_SPEAKER = "user"
REPLY_SPEAKER = "bot"


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


def located(where: dict[str, Any]) -> str:
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
    if split not in TEXT_SPLITS:
        raise IngestError(f"unknown --split {split!r}; choose one of {', '.join(TEXT_SPLITS)}")
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
            yield Row(obj[field_name], {name: storable(obj.get(column)) for column, name in kept_as(keep)})
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
    for name, flag in [(column, "--column"), *((k, "--keep_fields") for k, _ in kept_as(keep))]:
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
                yield Row(value, {name: row.get(c) for c, name in kept_as(keep)}) if keep else value


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
