"""What a reader yields and what a reader is: the typed records of ingest, the :class:`Reader` every
input format implements, and the :class:`Source` ingest writes from.

A record turns itself into a document (:meth:`Record.document`) or names why it cannot: the same way
whoever reads it (the exactly-once writer, a benchmark, a test). The formats themselves are in
:mod:`dsgpt2.corpus.readers` (text) and :mod:`dsgpt2.corpus.columnar` (Parquet, Arrow, ``datasets``),
registered by name in :mod:`dsgpt2.corpus.formats`.
"""

from __future__ import annotations

import codecs
import datetime
import decimal
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from dsgpt2.corpus.cleaning import clean_text
from dsgpt2.documents import FORM, INGEST_FIELDS, TEXT, TURNS, turns_text, utf8_encodable
from dsgpt2.errors import IngestError
from dsgpt2.registry import Registry
from dsgpt2.settings.argtypes import comma_list
from dsgpt2.settings.options import Checked, option

# Speaker names given to query/reply pairs.
QUERY_SPEAKER = "user"
REPLY_SPEAKER = "bot"


class Record:
    """One record of an input."""

    __slots__ = ()

    def document(self) -> dict[str, Any] | str:
        """The fields of the document this record becomes, or the reason it is skipped."""
        raise NotImplementedError


class Text(Record):
    """A text (any type as read: whether it is usable is :meth:`document`'s to say) and the kept fields
    stored beside it."""

    __slots__ = ("fields", "text")

    def __init__(self, text: Any, fields: dict[str, Any] | None = None) -> None:
        self.text = text
        self.fields = fields

    def document(self) -> dict[str, Any] | str:
        record = self.text
        if record is None:
            return "null"
        if not isinstance(record, str):
            return "not_string"
        filt = clean_text(record)
        if not filt:
            return "empty"
        # A real server refuses strings with lone surrogates; keep the original otherwise.
        form = record if utf8_encodable(record) else record.encode("utf-8", "replace").decode("utf-8")
        doc = {FORM: form, TEXT: filt}
        if self.fields:
            doc.update(self.fields)
        return doc


class Conversation(Record):
    """A conversation's cleaned turns and the record it came from (as JSON)."""

    __slots__ = ("form", "turns")

    def __init__(self, turns: list[dict[str, str]], form: str) -> None:
        self.turns = turns
        self.form = form

    def document(self) -> dict[str, Any] | str:
        return {FORM: self.form, TEXT: turns_text(self.turns), TURNS: self.turns}


class BadRecord(Record):
    """A source record that cannot become a document, and why (``no_field``: the record's fields,
    each with whether it holds a string)."""

    __slots__ = ("keys", "reason")

    def __init__(self, reason: str, keys: dict[str, bool] | None = None) -> None:
        self.reason = reason
        self.keys = keys

    def document(self) -> str:
        return self.reason


def normalize_conversation(obj: Any) -> Conversation | BadRecord:
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
    return Conversation(turns, json.dumps(obj, ensure_ascii=False))


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


def source_key(*parts: str) -> str:
    """The key a source's ingest progress is recorded under in meta_info."""
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Source:
    """Where records come from, and the key that makes its ingest resumable."""

    key: str
    label: str
    kind: str  # "text" or "conversation"
    read: Callable[[], Iterator[Record]] = field(repr=False, compare=False)
    decoding: DecodeTally | None = field(default=None, repr=False, compare=False)
    # Sources that can start at a record number without reading the ones before it (columnar files).
    read_from: Callable[[int], Iterator[Record]] | None = field(default=None, repr=False, compare=False)
    # Where the record read last (number ``pos``) is in the input: {"file", "line"} or {"file",
    # "row_group", "row"}, or {"record"} for the built-in samples.
    locate: Callable[[int], dict[str, Any]] = field(default=_by_record_number, repr=False, compare=False)
    flag: str = ""  # the option that names the text field, with its value ("--field body")
    # What is read, whatever the options it is read with ("file:/abs/path", "sample:stdlib"), and, for a
    # file, its size and modification time: a source ingested again is checked against both.
    origin: str = ""
    stamp: dict[str, int] = field(default_factory=dict, compare=False)


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


# How a text file is cut into documents: a line each, or a blank-line separated paragraph each.
TEXT_SPLITS = ("line", "paragraph")


@dataclass(frozen=True)
class ReadOptions(Checked):
    """How to read an input: ``dsgpt2 ingest``'s flags (declared here, once); each reader takes what
    concerns it."""

    field: str = option("text", "jsonl, parquet, arrow, dataset: the field holding the text")
    keep_fields: tuple[str, ...] = option(
        (),
        "also store these columns (jsonl: keys) on each document, e.g. id,url,dump,language_score; "
        "COLUMN:NAME stores one under another name (source:src: `source` is a field of every document)",
        type=comma_list,
        metavar="A,B,...",
    )
    column: str = option("text", "csv: the column holding the text")
    split: str = option(
        "line", "text files: one document per line or per blank-line separated paragraph", choices=TEXT_SPLITS
    )
    encoding: str = option(
        "utf-8",
        "encoding of the input files, e.g. latin-1 or cp1252; bytes not valid in it become U+FFFD and "
        "are counted",
    )

    def convert(self) -> None:
        object.__setattr__(self, "keep_fields", tuple(self.keep_fields))

    def check(self) -> None:
        try:
            codecs.lookup(self.encoding)
        except LookupError:
            raise IngestError(f"unknown --encoding {self.encoding!r}; e.g. utf-8, latin-1, cp1252") from None
        check_keep_fields(self.keep_fields)


class Reader:
    """One input format: a file (or directory) read as records, each located.

    A subclass sets:

    - ``name``: the ``--format`` value (its registry key in :mod:`dsgpt2.corpus.formats`);
    - ``kind``: ``"text"`` or ``"conversation"`` (what training reads of its documents);
    - ``option``: the :class:`ReadOptions` field that is part of the source's key and label (``field``:
      the text field read; None: none), and ``names_text``: whether that option names the text field
      (a source none of whose records has it says so, naming the flag);
    - ``keeps_fields``: whether ``--keep_fields`` applies;
    - ``text``: a text file, decoded in ``--encoding`` and refused when its bytes are binary;
    - ``directory``: it reads a directory;
    - ``seekable``: :meth:`records` starts at a record number without reading the ones before it.

    and implements :meth:`records` and :meth:`where` (and :meth:`claims`, to be found by ``auto``).
    """

    name: ClassVar[str]
    kind: ClassVar[str] = "text"
    option: ClassVar[str | None] = None
    names_text: ClassVar[bool] = True
    keeps_fields: ClassVar[bool] = False
    text: ClassVar[bool] = True
    directory: ClassVar[bool] = False
    seekable: ClassVar[bool] = False

    def __init__(self, path: Path, options: ReadOptions) -> None:
        """Open ``path`` (checks that need it read, e.g. a header, done here).

        Raises:
            IngestError: the input cannot be read as this format with these options.
        """
        self.path, self.options = path, options
        self.tally = DecodeTally(options.encoding) if self.text else None

    @classmethod
    def claims(cls, path: Path) -> bool:
        """Whether ``--format auto`` reads ``path`` as this format (by its name or first bytes)."""
        return False

    def records(self, start: int = 0) -> Iterator[Record]:
        """Every record, in order (from record number ``start`` where the reader is ``seekable``)."""
        raise NotImplementedError

    def where(self) -> dict[str, Any]:
        """Where the record yielded last is (see :attr:`Source.locate`)."""
        return {"file": str(self.path)}


# ---------------------------------------------------------------- kept fields
INT64_MAX = 2**63 - 1


def kept_as(keep: Sequence[str]) -> list[tuple[str, str]]:
    """``--keep_fields``' entries as (column, the field it is stored as): ``url`` keeps ``url`` as
    ``url``, ``source:src`` keeps the column ``source`` as ``src``."""
    return [(k.partition(":")[0], k.partition(":")[2] if ":" in k else k) for k in keep]


def check_keep_fields(keep: Sequence[str]) -> None:
    """Refuse kept fields that would overwrite a document's own, naming them and the rename that
    keeps the column."""
    for entry, (column, name) in zip(keep, kept_as(keep), strict=True):
        if not column or not name:
            raise IngestError(f"--keep_fields {entry!r}: give COLUMN or COLUMN:NAME (e.g. source:src)")
        safe = {"source": "src"}.get(name, name.strip("$").replace(".", "_") + "_kept")
        if name in INGEST_FIELDS:
            raise IngestError(
                f"--keep_fields {entry}: {name!r} is a field of every document ({', '.join(INGEST_FIELDS)}: "
                f"see the document schema); keep the column under another name: --keep_fields {column}:{safe}"
            )
        if name.startswith("$") or "." in name:
            raise IngestError(
                f"--keep_fields {entry}: a field name cannot start with '$' or hold '.'; keep the column "
                f"under another name: --keep_fields {column}:{safe}"
            )


def storable(value: Any) -> Any:
    """``value`` as BSON can hold it: dates become datetimes, decimals floats, integers past int64
    strings, times and durations ISO strings; lists and structs converted inside."""
    if value is None or isinstance(value, bool | str | float | bytes | datetime.datetime):
        return value
    if isinstance(value, int):
        return value if -INT64_MAX - 1 <= value <= INT64_MAX else str(value)
    if isinstance(value, datetime.date):
        return datetime.datetime(value.year, value.month, value.day)
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, datetime.time | datetime.timedelta):
        return str(value)
    if isinstance(value, dict):
        return {str(k): storable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        # Arrow maps come as lists of (key, value) tuples.
        return [storable(v) for v in value]
    return str(value)


# Every input format by its --format name: each Reader class registers itself where it is defined
# (@READERS.register(name)); dsgpt2.corpus.formats imports the built-in ones, in the order --format lists.
READERS: Registry[type[Reader]] = Registry("input format", "--format", IngestError)
