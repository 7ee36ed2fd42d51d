"""What an ingest run tells: each source's counts, every skipped record located (the first few in the
log, all of them in the ``--report`` file), and the advice when the text field named is not there.

Kept apart from the writer so that what a run reports can change without touching how it stores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from dsgpt2.corpus.records import DecodeTally, Source, located
from dsgpt2.documents import SkipTally
from dsgpt2.errors import DsGpt2Error, IngestError, NoRoomError
from dsgpt2.files import out_of_room, umask

log = logging.getLogger(__name__)

# Skipped records named in the log, per source (the --report file lists every one).
SHOWN_SKIPS = 5


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
    log when the source ends.

    The file is written beside its place and put there by :meth:`close`, whatever ended the run (what it
    read is told): a report that cannot be written is no file at all, and one there before is kept."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else str(path)
        self.file: TextIO | None = None
        self.first: list[str] = []
        self.count = 0
        self._tmp = ""
        if self.path is not None:
            try:
                directory = os.path.dirname(self.path) or "."
                os.makedirs(directory, exist_ok=True)
                fd, self._tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", suffix=".tmp",
                                                 dir=directory)  # fmt: skip
                os.fchmod(fd, 0o666 & ~umask())  # as open() makes a file, not mkstemp's 0600
                self.file = open(fd, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
            except OSError as exc:
                raise self._unwritten(exc) from None

    def add(self, source: Source, where: dict[str, Any], reason: str) -> None:
        self.count += 1
        if len(self.first) < SHOWN_SKIPS:
            self.first.append(f"{located(where)} ({reason})")
        if self.file is not None:
            entry = where if "file" in where else {"source": source.label, **where}
            try:
                self.file.write(json.dumps({**entry, "reason": reason}) + "\n")
            except OSError as exc:
                raise self._unwritten(exc) from None

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
        """The report in its place, whole."""
        if self.file is None or self.path is None:
            return
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self._tmp, self.path)
        except OSError as exc:
            raise self._unwritten(exc) from None
        self.file = None

    def _unwritten(self, exc: OSError) -> DsGpt2Error:
        """What the command says where the report could not be written; its temporary file removed."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)
        path = Path(self.path or "")
        room = out_of_room(path.parent, exc)
        if room is None:
            return IngestError(
                f"cannot write --report {self.path!r}: {exc.strerror or exc}; give a writable path"
            )
        return NoRoomError(
            f"--report {path}: not written, {room}; the documents stored before it are kept: free space "
            "there and re-run the same command (it resumes, and its report lists the records it reads)"
        )


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
