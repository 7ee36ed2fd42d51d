"""The input formats ingest reads, in one registry: a format is a :class:`~dsgpt2.corpus.records.Reader`
class registered where it is defined (the built-in ones imported here, in the order ``--format`` lists
them). The command line's ``--format`` choices, ``auto``'s detection and
:func:`file_source` all read :data:`READERS`; a plugin (or a test) registers its own reader the same way
before the command runs::

    @READERS.register("tsv")
    class TsvReader(LineReader): ...
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path
from typing import Any

# isort: off
from dsgpt2.corpus import readers  # noqa: F401  text, jsonl, csv, conversation
from dsgpt2.corpus import columnar  # noqa: F401  parquet, arrow, dataset

# isort: on
from dsgpt2.corpus.columnar import sniff_binary
from dsgpt2.corpus.records import READERS, ReadOptions, Source, source_key
from dsgpt2.documents import utf8_encodable
from dsgpt2.errors import IngestError
from dsgpt2.files import not_a_file

# --format's choices: "auto" (the format told by the file's name and first bytes), then every reader.
FORMATS = READERS.choices("auto")
# Encodings in which a binary file's first bytes can be told from text.
SNIFFED_ENCODINGS = ("utf-8", "ascii", "latin-1", "cp1252", "iso8859-1")


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format ``auto`` reads ``path`` as: the first reader that claims it, the readers of binary
    inputs asked first (a file's own bytes say more than its name), else ``text``. Built in: ``.jsonl``/
    ``.json`` → jsonl, ``.csv`` → csv, ``.parquet`` → parquet, ``.arrow``/``.feather`` → arrow, a
    ``save_to_disk`` directory → dataset (Parquet and Arrow also by their first bytes, whatever the name)."""
    p = Path(path)
    ordered = sorted(READERS.items(), key=lambda item: item[1].text)
    return next((name for name, reader in ordered if reader.claims(p)), "text")


def _and_list(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def file_source(
    path: str | os.PathLike[str], fmt: str = "auto", options: ReadOptions | None = None, **read: Any
) -> Source:
    """A file (gzip transparently) or ``datasets`` directory read by the reader of ``fmt``, as
    ``options`` say (else :class:`ReadOptions` of ``read``: ``field=``, ``keep_fields=``...).

    Raises:
        IngestError: the file is missing, binary where text is expected, or the format or its options
            are invalid.
    """
    p = Path(path)
    why = not_a_file(p)
    a_directory = fmt == "auto" or (fmt in READERS and READERS[fmt].directory)
    if why is not None and not (a_directory and p.is_dir()):
        raise IngestError(f"input file {str(p)!r}: {why}")
    if p.is_file():
        try:
            with open(p, "rb"):
                pass
        except OSError as exc:
            why = f"input file {str(p)!r} cannot be read ({exc.strerror}); nothing was stored"
            raise IngestError(why) from None
    if not utf8_encodable(str(p.resolve())):
        raise IngestError(
            f"input file {str(p)!r}: its path is not UTF-8 text (the ingest record keeps it); "
            "rename it; nothing was stored"
        )
    if fmt not in FORMATS:
        raise IngestError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    options = options if options is not None else ReadOptions(**read)
    keep_fields, encoding = options.keep_fields, options.encoding
    fmt = detect_format(p) if fmt == "auto" else fmt
    kind = READERS[fmt]
    if keep_fields and not kind.keeps_fields:
        keeping = [name for name, reader in READERS.items() if reader.keeps_fields]
        raise IngestError(f"--keep_fields goes with {_and_list(keeping)} inputs, not {fmt}")
    if kind.text and codecs.lookup(encoding).name in SNIFFED_ENCODINGS:
        binary = sniff_binary(p)
        if binary:
            binaries = "|".join(name for name, reader in READERS.items() if not reader.text)
            expected = "text" if fmt == "text" else f"{fmt} text"
            raise IngestError(
                f"{p.name} is {binary}, not {expected}; nothing was stored. Parquet, Arrow and `datasets` "
                f"inputs are read by their own readers (--format {binaries}); convert other "
                "binary files to text first"
            )
    reader = kind(p, options)
    value = str(getattr(options, kind.option)) if kind.option else ""
    kept = f" +{','.join(keep_fields)}" if keep_fields else ""
    return Source(
        source_key("file", str(p.resolve()), fmt, value, *keep_fields),
        f"{p.name} ({fmt}{': ' + value if value else ''}{kept})",
        kind.kind,
        reader.records,
        reader.tally,
        read_from=reader.records if kind.seekable else None,
        locate=lambda _: reader.where(),
        flag=f"--{kind.option} {value}" if kind.option and kind.names_text else "",
        origin=f"file:{p.resolve()}",
        stamp={"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} if p.is_file() else {},
    )
