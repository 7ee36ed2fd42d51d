"""The text inputs ingest reads, one :class:`~dsgpt2.corpus.records.Reader` per format: plain text
(a document per line or per paragraph), JSON lines, CSV and conversation files, gzip transparently; and
the built-in samples. Each record is located by its file's 1-based line (as an editor numbers them).
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, TextIO

from dsgpt2.corpus.builtin import SAMPLES, sample_version, stdlib_conversations, stdlib_documents
from dsgpt2.corpus.records import (
    READERS,
    BadRecord,
    DecodeTally,
    Reader,
    ReadOptions,
    Record,
    Source,
    Text,
    kept_as,
    normalize_conversation,
    source_key,
    storable,
)
from dsgpt2.errors import IngestError


class LineReader(Reader):
    """A text file read line by line: the record yielded last starts at :attr:`line`. ``auto`` reads a
    file as this format when its name (less ``.gz``) ends with one of ``SUFFIXES``."""

    SUFFIXES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, path: Path, options: ReadOptions) -> None:
        super().__init__(path, options)
        self.line = 0

    @classmethod
    def claims(cls, path: Path) -> bool:
        return bool(cls.SUFFIXES) and str(path).lower().removesuffix(".gz").endswith(cls.SUFFIXES)

    def where(self) -> dict[str, Any]:
        return {"file": str(self.path), "line": self.line}


@READERS.register("text")
class TextReader(LineReader):
    """Plain text: one document per line, or per paragraph (``--split paragraph``)."""

    name = "text"
    option = "split"
    names_text = False

    def records(self, start: int = 0) -> Iterator[Record]:
        for text in _read_text(self.path, self.options.split, self.tally, self):
            yield Text(text)


@READERS.register("jsonl")
class JsonlReader(LineReader):
    """JSON lines: the text in ``--field``, the ``--keep_fields`` keys beside it."""

    name = "jsonl"
    option = "field"
    keeps_fields = True
    SUFFIXES = (".jsonl", ".json", ".ndjson")

    def records(self, start: int = 0) -> Iterator[Record]:
        return _read_jsonl(self.path, self.options.field, self.tally, self.options.keep_fields, self)


@READERS.register("csv")
class CsvReader(LineReader):
    """CSV with a header: the text in ``--column``, the ``--keep_fields`` columns beside it."""

    name = "csv"
    option = "column"
    keeps_fields = True
    SUFFIXES = (".csv",)

    def __init__(self, path: Path, options: ReadOptions) -> None:
        super().__init__(path, options)
        _check_csv_header(path, options.column, self.tally, options.keep_fields)

    def records(self, start: int = 0) -> Iterator[Record]:
        return _read_csv(self.path, self.options.column, self.tally, self.options.keep_fields, self)


@READERS.register("conversation")
class ConversationReader(LineReader):
    """JSON lines of conversations: ``{"turns": [{speaker, text}, ...]}`` or ``{"query", "reply"}``."""

    name = "conversation"
    kind = "conversation"
    names_text = False

    def records(self, start: int = 0) -> Iterator[Record]:
        for obj in _json_lines(self.path, self.tally, self):
            yield obj if isinstance(obj, BadRecord) else normalize_conversation(obj)


def builtin_source(name: str = "stdlib", limit: int | None = None) -> Source:
    """A built-in sample (see :mod:`dsgpt2.corpus.builtin`), at most ``limit`` records.

    ``stdlib`` is the pretraining sample; ``stdlib-chat`` its conversation sample.
    """
    if name not in SAMPLES:
        raise IngestError(f"unknown sample {name!r}; the built-in samples are {', '.join(SAMPLES)}")
    version = sample_version()
    label = f"sample {name} {version}" + (f" (first {limit})" if limit else "")
    if name == "stdlib-chat":
        return Source(
            source_key("sample", name, version, str(limit)),
            label,
            "conversation",
            lambda: (normalize_conversation(c) for c in stdlib_conversations(limit)),
            origin=f"sample:{name}",
        )
    return Source(source_key("sample", version, str(limit)), label, "text",
                  lambda: (Text(d) for d in stdlib_documents(limit)), origin=f"sample:{name}")  # fmt: skip


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
    if gz:
        check_gzip(path)
    try:
        raw = gzip.open(path, "rb") if gz else open(path, "rb")  # noqa: SIM115
    except OSError as exc:
        raise IngestError(f"cannot read {str(path)!r}: {exc}") from None
    return io.TextIOWrapper(raw, encoding=encoding, errors=tally.errors(), newline="")


_GZIP_WHOLE: set[tuple[str, int, int]] = set()  # (path, size, mtime) of the gzip files found whole


def check_gzip(path: Path) -> None:
    """Refuse a gzip file whose stream is damaged, read through before any of its text is used: gzip
    checks its CRC and length only at the end of a member, so the text of a damaged one may be garbled
    anywhere before the error (a byte flipped mid-file gave documents of scrambled text). A file only cut
    short is let through: the text before the cut is the file's own.

    Raises:
        IngestError: naming the file and the damage.
    """
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _GZIP_WHOLE:
        return
    try:
        with gzip.open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    except EOFError:
        pass  # cut short: read as far as it goes, and said where
    except (OSError, zlib.error) as exc:
        raise IngestError(
            f"{path}: the gzip file is damaged ({type(exc).__name__}: {exc}); gzip finds it only at the "
            "file's end, so its text may be garbled anywhere before: nothing of it is ingested; restore the "
            "file and re-run the same command"
        ) from None
    _GZIP_WHOLE.add(key)


# What reading a damaged file raises: a truncated gzip (EOFError), a bad CRC or header
# (gzip.BadGzipFile, an OSError), damaged deflate data (zlib.error), a malformed CSV.
DAMAGED_INPUT = (EOFError, OSError, zlib.error, csv.Error)


def _read_text(path: Path, split: str, tally: DecodeTally | None, at: LineReader) -> Iterator[Any]:
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


def _json_lines(path: Path, tally: DecodeTally | None, at: LineReader) -> Iterator[Any]:
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
    tally: DecodeTally | None,
    keep: tuple[str, ...],
    at: LineReader,
) -> Iterator[Any]:
    for obj in _json_lines(path, tally, at):
        if isinstance(obj, BadRecord):
            yield obj
        elif not isinstance(obj, dict):
            yield BadRecord("bad_json")
        elif field_name not in obj:
            yield BadRecord("no_field", {str(k): isinstance(v, str) for k, v in obj.items()})
        elif keep:
            yield Text(obj[field_name], {name: storable(obj.get(column)) for column, name in kept_as(keep)})
        else:
            yield Text(obj[field_name])


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
    tally: DecodeTally | None,
    keep: tuple[str, ...],
    at: LineReader,
) -> Iterator[Any]:
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
                yield Text(value, {name: row.get(c) for c, name in kept_as(keep)} if keep else None)
