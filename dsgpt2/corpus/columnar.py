"""Columnar inputs: Parquet files, Arrow files and streams, and ``datasets`` directories.

FineWeb, FineWeb-Edu, RedPajama and most corpora on the Hugging Face Hub ship as Parquet (``text`` and
metadata columns: ``id``, ``url``, ``dump``, ``language_score``...); ``datasets.Dataset.save_to_disk``
writes Arrow streams beside a ``state.json``. Each is read in record batches of at most
:data:`BATCH_ROWS` rows and only the columns asked for, so memory stays bounded whatever the file's
size; a resumed read starts at a row number without decoding the row groups before it.

Rows come out as :class:`~dsgpt2.corpus.records.Text` (the text and the kept columns' values, made
storable in MongoDB), each input read by the :class:`~dsgpt2.corpus.records.Reader` of its format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dsgpt2.corpus.records import READERS, Reader, ReadOptions, Text, kept_as, storable
from dsgpt2.errors import IngestError

BATCH_ROWS = 1024
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message (a continuation marker)
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}


def detect(path: Path) -> str | None:
    """``parquet``, ``arrow`` or ``dataset`` by the path's suffix, layout or first bytes; None otherwise."""
    if path.is_dir():
        return "dataset"
    kind = SUFFIXES.get(path.suffix.lower())
    if kind:
        return kind
    head = _head(path, 8)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC) or head.startswith(ARROW_STREAM_MAGIC):
        return "arrow"
    return None


def _head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def dataset_files(path: Path) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` directory, in order (its ``state.json``)."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise IngestError(
            f"{path} holds a DatasetDict with splits {', '.join(map(str, splits))}: give one split's "
            f"directory, e.g. {path / str(splits[0] if splits else 'train')}"
        )
    state = path / "state.json"
    if path.is_file():
        raise IngestError(
            f"{path} is a file, and --format dataset reads a directory written by Dataset.save_to_disk; "
            "leave --format out to read the file by its name"
        )
    if not state.is_file():
        raise IngestError(
            f"{path} is a directory but not a `datasets` save_to_disk directory (no state.json); "
            "give files, or a directory written by Dataset.save_to_disk"
        )
    try:
        files = [path / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IngestError(f"{state}: not a `datasets` state file ({exc})") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise IngestError(f"{path}: the data file(s) {', '.join(missing)} named in state.json are missing")
    return files


class Table:
    """One columnar input: its schema checked at once, its rows read in bounded batches."""

    def __init__(self, path: Path, kind: str, field: str, keep: Sequence[str]) -> None:
        import pyarrow as pa

        self.path, self.kind, self.field, self.keep = path, kind, field, list(keep)
        self.files = dataset_files(path) if kind == "dataset" else [path]
        try:
            schemas = [self._schema(f) for f in self.files]
        except (pa.ArrowException, OSError) as exc:
            raise IngestError(f"{path}: not a readable {kind} input ({_first_line(exc)})") from None
        names = schemas[0].names if schemas else []
        wanted = [field, *(column for column, _ in kept_as(self.keep))]
        absent = [c for c in wanted if c not in names]
        if absent:
            which = "--field" if field in absent else "--keep_fields"
            texts = [f.name for f in schemas[0] if str(f.type) in ("string", "large_string", "string_view")]
            best = "text" if "text" in texts else (texts[0] if texts else None)
            example = (
                f"; name the text column with --field, e.g. --field {best}"
                if field in absent and best
                else ""
            )
            raise IngestError(
                f"{path.name} has no column {', '.join(map(repr, absent))} ({which}); its columns are "
                f"{', '.join(names)}{example}"
            )
        kind_of_text = schemas[0].field(field).type
        if not (pa.types.is_string(kind_of_text) or pa.types.is_large_string(kind_of_text)
                or str(kind_of_text) == "string_view"):  # fmt: skip
            raise IngestError(
                f"{path.name}: column {field!r} holds {kind_of_text}, not text; pick the text column "
                "with --field"
            )
        self.columns = list(dict.fromkeys(wanted))
        self._at: tuple[Path, int, int] = (self.files[0] if self.files else path, 0, 0)

    def _schema(self, file: Path) -> Any:
        import pyarrow.parquet as pq

        if self.kind == "parquet":
            return pq.read_schema(file)
        with self._open_ipc(file) as reader:
            return reader.schema

    def _open_ipc(self, file: Path) -> Any:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        source = pa.memory_map(str(file))
        if _head(file, 6) == ARROW_FILE_MAGIC:
            return ipc.open_file(source)
        return ipc.open_stream(source)

    def rows(self, start: int = 0) -> Iterator[Text]:
        """Every row from row number ``start`` on (the rows before it are not decoded); :meth:`where`
        locates the row yielded last."""
        import pyarrow as pa

        try:
            skip = start
            for file in self.files:
                if skip:
                    rows = self._count(file)
                    if skip >= rows:
                        skip -= rows
                        continue
                for group, first, batch in self._batches(file, skip):
                    for i, row in enumerate(self._rows(batch)):
                        self._at = (file, group, first + i)
                        yield row
                skip = 0
        except pa.ArrowException as exc:
            # Damage found mid-read: the ingest keeps what came before and names the file.
            raise OSError(_first_line(exc)) from None

    def _count(self, file: Path) -> int:
        import pyarrow.parquet as pq

        if self.kind == "parquet":
            return pq.ParquetFile(file).metadata.num_rows
        with self._open_ipc(file) as reader:
            return sum(b.num_rows for b in _ipc_batches(reader))

    def where(self) -> dict[str, Any]:
        """Where the row :meth:`rows` yielded last sits: its file, its row group (an Arrow input's
        record batch) and its row in that group, both counted from 0 as pyarrow counts them."""
        file, group, row = self._at
        return {"file": str(file), "row_group": group, "row": row}

    def _batches(self, file: Path, skip: int) -> Iterator[tuple[int, int, Any]]:
        """Record batches of at most BATCH_ROWS rows of ``file``, the first ``skip`` rows left out, each
        with its row group (record batch) and the place of its first row in that group."""
        if self.kind == "parquet":
            yield from self._parquet_batches(file, skip)
            return
        reader = self._open_ipc(file)
        for group, batch in enumerate(_ipc_batches(reader)):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            batch = batch.select(self.columns)
            for offset in range(skip, batch.num_rows, BATCH_ROWS):
                yield group, offset, batch.slice(offset, BATCH_ROWS)
            skip = 0

    def _parquet_batches(self, file: Path, skip: int) -> Iterator[tuple[int, int, Any]]:
        """One row group at a time (damage in a group surfaces after the groups before it), the
        groups wholly before ``skip`` not read at all."""
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(file)
        for i in range(pf.num_row_groups):
            n = pf.metadata.row_group(i).num_rows
            if skip >= n:
                skip -= n
                continue
            row = 0
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[i], columns=self.columns):
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    row += batch.num_rows
                    continue
                yield i, row + skip, batch.slice(skip)
                row += batch.num_rows
                skip = 0

    def _rows(self, batch: Any) -> Iterator[Text]:
        texts = batch.column(self.field).to_pylist()
        kept = [(name, batch.column(column).to_pylist()) for column, name in kept_as(self.keep)]
        for i, text in enumerate(texts):
            yield Text(text, {name: storable(values[i]) for name, values in kept})


class ColumnarReader(Reader):
    """A columnar input (:class:`Table`): the text in ``--field``, the ``--keep_fields`` columns beside
    it; a resumed read starts at its row."""

    option = "field"
    keeps_fields = True
    text = False
    seekable = True

    def __init__(self, path: Path, options: ReadOptions) -> None:
        super().__init__(path, options)
        self.table = Table(path, self.name, options.field, options.keep_fields)

    @classmethod
    def claims(cls, path: Path) -> bool:
        return detect(path) == cls.name

    def records(self, start: int = 0) -> Iterator[Text]:
        return self.table.rows(start)

    def where(self) -> dict[str, Any]:
        return self.table.where()


@READERS.register("parquet")
class ParquetReader(ColumnarReader):
    """A Parquet file, one row group at a time."""

    name = "parquet"


@READERS.register("arrow")
class ArrowReader(ColumnarReader):
    """An Arrow IPC file or stream (``.arrow``, ``.feather``)."""

    name = "arrow"


@READERS.register("dataset")
class DatasetReader(ColumnarReader):
    """A ``datasets`` ``save_to_disk`` directory: its Arrow files in order."""

    name = "dataset"
    directory = True


def _ipc_batches(reader: Any) -> Iterator[Any]:
    if hasattr(reader, "num_record_batches"):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def sniff_binary(path: Path) -> str | None:
    """What a file named as text really is when it is not text (``PDF``, ``zip``...); None for text.

    Gzip is text's own wrapper and is looked into; a NUL byte in the first 4 KB means binary.
    """
    head = _head(path, 4096)
    if head[:2] == b"\x1f\x8b":
        import gzip
        import zlib

        try:
            with gzip.open(path, "rb") as f:
                head = f.read(4096)
        except (OSError, EOFError, zlib.error):
            return None  # a damaged gzip: the reader reports it where it breaks
    for magic, name in (
        (PARQUET_MAGIC, "a Parquet file"),
        (ARROW_FILE_MAGIC, "an Arrow file"),
        (ARROW_STREAM_MAGIC, "an Arrow stream"),
        (b"%PDF", "a PDF"),
        (b"PK\x03\x04", "a zip archive"),
        (b"BZh", "bzip2-compressed"),
        (b"\xfd7zXZ\x00", "xz-compressed"),
        (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
        (b"7z\xbc\xaf\x27\x1c", "a 7z archive"),
    ):
        if head.startswith(magic):
            return name
    if b"\x00" in head:
        return "binary"
    return None
