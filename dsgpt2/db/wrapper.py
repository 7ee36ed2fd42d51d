"""The unified index: all configured collections as one sequence of document texts
(:class:`MongoWrapper`), and the decoding of fetched documents one by one."""

from __future__ import annotations

import bisect
import logging
import operator
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import bson
from bson.codec_options import CodecOptions
from bson.errors import InvalidBSON
from bson.raw_bson import RawBSONDocument

from dsgpt2.db.client import EMBEDDED_IN_LIST, Connection, count_in, patiently, read_preference, with_retries
from dsgpt2.db.config import MongoConfig
from dsgpt2.db.filters import conjoin, unknown_fields
from dsgpt2.db.meta import read_meta
from dsgpt2.db.summaries import count_numbered
from dsgpt2.documents import ABSENT, FORM, TURNS, Doc, SkipTally, text_problem, turns_problem
from dsgpt2.errors import BadDocumentError, ConfigError, CorpusError

log = logging.getLogger(__name__)

_READER_LOGGED: set[int] = set()


def _log_reader(config: MongoConfig, address: tuple[str, int] | None) -> None:
    """Once per process: which server answers the reads (a secondary, with READ_PREFERENCE)."""
    if address is None or os.getpid() in _READER_LOGGED:
        return
    _READER_LOGGED.add(os.getpid())
    log.info(
        "process %d reads from %s:%d (READ_PREFERENCE %s)", os.getpid(), address[0], address[1],
        config.read_preference,
    )  # fmt: skip


# FILTER is tried on the first documents of each collection (an idx range on the index, never a scan).
FILTER_SAMPLE = 1000


def check_filter_keeps(conn: Connection, names: Sequence[str], counts: Sequence[int]) -> None:
    """Tell a FILTER that selects nothing before any work: a field it names that neither the first
    documents nor dsgpt2 have (a warning: a typo); none of those documents kept (then counted exactly,
    in idx windows) and none of any collection kept (refused).

    Raises:
        ConfigError: FILTER keeps no document.
    """
    config = conn.config
    query = config.filter_query
    kept, present = 0, set()
    light = {FORM: 0, config.text_field: 0, TURNS: 0}
    for name, count in zip(names, counts, strict=True):
        if not count:
            continue
        coll = conn.db[name]
        first = {"idx": {"$gte": 0, "$lt": min(count, FILTER_SAMPLE)}}
        docs = with_retries(
            lambda c=coll, q=first: list(c.find(q, light).limit(20)), config, "checking FILTER"
        )
        present |= {k for d in docs for k in d}
        q = conjoin(first, query)
        kept += len(with_retries(lambda c=coll, q=q: list(c.find(q, {"_id": 1}).limit(1)), config,
                                 "checking FILTER"))  # fmt: skip
    for path, close in unknown_fields(query, present, (config.text_field,)):
        hint = f"; did you mean {close!r}?" if close else ""
        log.warning("FILTER names %r, a field none of the first documents has and dsgpt2 never writes: a "
                    "typo?%s (it selects as if the field were absent)", path, hint)  # fmt: skip
    if kept or not any(counts):
        return
    total = sum(count_numbered(conn, n, query, "counting what FILTER keeps") for n in names)
    if total == 0:
        raise ConfigError(
            f"FILTER {config.filter} keeps 0 of the {sum(counts)} documents of {', '.join(names)}: every "
            "command would read nothing; fix FILTER in the config"
        )


class MongoWrapper:
    """All configured collections as one indexed sequence of document texts.

    Global index ``i`` maps to ``(collection, idx)`` by binary search over the
    cumulative counts, in config order. Opening reads only the counts; texts
    are fetched on demand, one query per collection touched by a batch.

    Args:
        config: where the corpus lives.
        connection: reuse this connection (default: a new lazy one).
        counts: per-collection counts to use instead of reading meta_info.
        strict: override ``config.strict``.
        conversations: read each document's ``turns`` (see :mod:`dsgpt2.corpus.ingest`)
            instead of its text field; ``Doc.text`` then holds the turns.
    """

    def __init__(
        self,
        config: MongoConfig,
        connection: Connection | None = None,
        counts: Sequence[int] | None = None,
        strict: bool | None = None,
        conversations: bool = False,
    ) -> None:
        self.config = config
        self.field = CONVERSATION_FIELD if conversations else config.text_field
        self._problem = turns_problem if conversations else text_problem
        self.collections: tuple[str, ...] = tuple(config.collections)
        self.strict = config.strict if strict is None else strict
        self.skipped = SkipTally()
        self.queries: Counter[str] = Counter()
        self.query_seconds = 0.0  # time spent waiting for the server (and decoding), for benchmarks
        if connection is None:
            connection = Connection(config)
            connection.ping()
        self._conn = connection
        self.counts: tuple[int, ...] = tuple(counts) if counts is not None else self._read_counts()
        if len(self.counts) != len(self.collections) or any(c < 0 for c in self.counts):
            raise ConfigError(f"counts {list(self.counts)} do not match {list(self.collections)}")
        self.offsets: tuple[int, ...] = tuple(_cumulative(self.counts))
        # FILTER: asked of every read; the documents it leaves out are counted as `filtered`.
        self.filter = config.filter_query
        if self.filter is not None and counts is None:
            connection.check_filter()
            if not connection.filter_sampled:
                check_filter_keeps(connection, self.collections, self.counts)
                connection.filter_sampled = True

    def __repr__(self) -> str:
        counts = dict(zip(self.collections, self.counts, strict=True))
        return f"MongoWrapper({self.config.display_uri!r}, {counts})"

    @property
    def connection(self) -> Connection:
        return self._conn

    def _read_counts(self) -> tuple[int, ...]:
        meta = read_meta(self._conn, self.collections)
        self.queries["meta"] += 1
        counts = []
        for name in self.collections:
            count = meta.get(name, {}).get("count")
            if not isinstance(count, int) or isinstance(count, bool):
                count = patiently(self._conn, lambda db, n=name: count_in(db[n], {}), f"counting {name}")
                self.queries[name] += 1
                # validate --fix records a count; for no document (or no collection) it cannot help.
                fix = " (run `dsgpt2 validate --fix` to record it)" if count else ""
                log.warning("meta_info has no count for %r; counted %d documents%s", name, count, fix)
            counts.append(count)
        return tuple(counts)

    def __len__(self) -> int:
        return self.offsets[-1]

    @property
    def total_queries(self) -> int:
        return sum(self.queries.values())

    def locate(self, index: int) -> tuple[int, int]:
        """Global index → (position of the collection in config order, local idx)."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"document index {index} out of range for a corpus of {n}")
        pos = bisect.bisect_right(self.offsets, index) - 1
        return pos, index - self.offsets[pos]

    def __getitem__(self, index: int) -> Any:
        """The text (or turns) of document ``index``, or None when it is bad (counted in ``skipped``)."""
        index = self._normalize(operator.index(index))
        pos, local = self.locate(index)
        filt = {"idx": local}
        found = self._query(pos, filt)
        doc = found.get(local)
        return self._check(index, pos, local, doc, self._left_out(pos, filt, found, 1))

    def get_many(self, indices: Iterable[int]) -> list[Doc]:
        """The usable documents among ``indices``, in the order asked.

        One query per collection touched (on mongod and the embedded server dsgpt2 starts): a range
        query when that collection's indices are consecutive, ``$in`` otherwise. On stock SecantusDB,
        whose ``$in`` costs the square of its length, a long list is cut into short ones
        (:meth:`Connection.in_lists`), or read as the range holding it when that range is at most twice
        as long. Bad documents are left out and counted in
        ``skipped`` (or raise in strict mode).
        """
        # operator.index: numpy integers become ints, which pymongo can encode.
        wanted = [self._normalize(operator.index(i)) for i in indices]
        by_coll: dict[int, set[int]] = {}
        for i in wanted:
            pos, local = self.locate(i)
            by_coll.setdefault(pos, set()).add(local)
        fetched: dict[int, dict[int, dict[str, Any]]] = {}
        left_out: dict[int, set[int]] = {}
        for pos, locals_ in sorted(by_coll.items()):
            fetched[pos], left_out[pos] = self._read_set(pos, sorted(locals_))
        out = []
        for i in wanted:
            pos, local = self.locate(i)
            text = self._check(i, pos, local, fetched[pos].get(local), local in left_out[pos])
            if text is not None:
                out.append(Doc(i, text))
        return out

    def _read_set(self, pos: int, asked: list[int]) -> tuple[dict[int, dict[str, Any]], set[int]]:
        """The documents of collection ``pos`` with idx in ``asked`` (sorted, distinct), by idx, and
        the idx FILTER left out of them (the answer may hold more of the range it read)."""
        lo, hi = asked[0], asked[-1]
        span = hi - lo + 1
        long_list = len(asked) > EMBEDDED_IN_LIST
        if span == len(asked) or (long_list and span <= 2 * len(asked) and self._conn.in_list_max):
            filt: dict[str, Any] = {"idx": {"$gte": lo, "$lt": hi + 1}}
            found = self._query(pos, filt, batch=span)
            return found, self._left_out(pos, filt, found, span)
        found, left_out = {}, set()
        for part in self._conn.in_lists(asked):
            filt = {"idx": {"$in": part}}
            got = self._query(pos, filt, batch=len(part))
            found.update(got)
            left_out |= self._left_out(pos, filt, got, len(part))
        return found, left_out

    def get_range(self, start: int, stop: int) -> list[Doc]:
        """The usable documents with global index in ``[start, stop)``, in order."""
        start, stop = max(0, operator.index(start)), min(len(self), operator.index(stop))
        out: list[Doc] = []
        while start < stop:
            pos, lo = self.locate(start)
            hi = min(stop, self.offsets[pos + 1]) - self.offsets[pos]
            filt = {"idx": {"$gte": lo, "$lt": hi}}
            fetched = self._query(pos, filt, batch=hi - lo)
            left_out = self._left_out(pos, filt, fetched, hi - lo)
            for local in range(lo, hi):
                index = self.offsets[pos] + local
                text = self._check(index, pos, local, fetched.get(local), local in left_out)
                if text is not None:
                    out.append(Doc(index, text))
            start = self.offsets[pos] + hi
        return out

    def iter_range(self, start: int = 0, stop: int | None = None, chunk: int = 1000) -> Iterator[list[Doc]]:
        """Chunks of usable documents over ``[start, stop)``, ``chunk`` indices at a time."""
        if chunk <= 0:
            raise ValueError(f"chunk must be positive, got {chunk}")
        stop = len(self) if stop is None else min(stop, len(self))
        for lo in range(max(0, start), stop, chunk):
            yield self.get_range(lo, min(lo + chunk, stop))

    def _normalize(self, index: int) -> int:
        return index + len(self) if index < 0 else index

    def _left_out(self, pos: int, filt: dict[str, Any], fetched: dict[int, Any], asked: int) -> set[int]:
        """The idx of the documents of ``filt`` that FILTER left out of ``fetched``: asked of the server
        only when some asked for did not come (one query, idx only: those of ``filt`` without FILTER,
        a query every engine answers from the idx index, less those fetched)."""
        if self.filter is None or len(fetched) >= asked:
            return set()
        return set(self._query(pos, filt, asked, unfiltered=True)) - fetched.keys()

    def _query(
        self, pos: int, filt: dict[str, Any], batch: int = 1, unfiltered: bool = False
    ) -> dict[int, dict[str, Any]]:
        """The documents of ``filt`` (and FILTER, unless ``unfiltered``: then their idx only) by idx."""
        name = self.collections[pos]
        # Raw documents, decoded one by one below: a single document with
        # undecodable UTF-8 must not fail the whole batch.
        coll = self._conn.db[name].with_options(
            codec_options=RAW_DOCUMENTS, read_preference=read_preference(self.config)
        )
        projection = {"_id": 0, "idx": 1} if unfiltered else {"_id": 0, "idx": 1, self.field: 1}
        if self.filter is not None and not unfiltered:
            filt = conjoin(filt, self.filter)

        def run() -> list[Any]:
            # One batch for the whole answer: no getMore round trip under 16 MB. One more than the answer
            # holds, so that the batch ends the cursor (a server that fills a batch exactly may keep the
            # cursor open, and the client then asks for an empty getMore).
            cursor = coll.find(filt, projection).batch_size(batch + 1)
            docs = list(cursor)
            _log_reader(self.config, getattr(cursor, "address", None))
            return docs

        started = time.perf_counter()
        docs = with_retries(run, self.config, f"reading {name}")
        self.queries[name] += 1
        out: dict[int, dict[str, Any]] = {}
        for raw in docs:
            d = decode_document(raw, self.field)
            idx = d.get("idx")
            if isinstance(idx, int) and not isinstance(idx, bool):
                out.setdefault(idx, d)
        self.query_seconds += time.perf_counter() - started
        return out

    def _check(
        self, index: int, pos: int, local: int, doc: dict[str, Any] | None, left_out: bool = False
    ) -> Any:
        if left_out:  # not a bad document: one the config chose not to read (never strict's concern)
            self.skipped["filtered"] += 1
            return None
        if doc is None:
            reason = "missing"
            value = None
        else:
            value = doc.get(self.field, ABSENT)
            reason = self._problem(value, self.config.max_text_chars)
        if reason is None:
            return value
        self.skipped[reason] += 1
        if self.strict:
            raise BadDocumentError(
                f"{self.collections[pos]} idx={local} (document {index}) is unusable: {reason}; "
                f"fix or remove it, or turn strict mode off (STRICT: false)"
            )
        return None


CONVERSATION_FIELD = TURNS
RAW_DOCUMENTS: CodecOptions = CodecOptions(document_class=RawBSONDocument)
_LENIENT: CodecOptions = CodecOptions(unicode_decode_error_handler="replace")
INVALID_TEXT = "\udcff"  # a lone surrogate: text_problem() classifies it as invalid_unicode


def decode_document(raw: Any, text_field: str) -> dict[str, Any]:
    """A fetched document as a dict; raw BSON with undecodable UTF-8 keeps its idx and
    gets a text that :func:`~dsgpt2.documents.text_problem` rejects as invalid_unicode."""
    if not isinstance(raw, RawBSONDocument):
        return raw
    try:
        return bson.decode(raw.raw)
    except (InvalidBSON, UnicodeDecodeError):
        doc = bson.decode(raw.raw, codec_options=_LENIENT)
        doc[text_field] = INVALID_TEXT
        return doc


def _cumulative(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def require_nonempty(wrapper: MongoWrapper) -> None:
    """Raise when the configured collections hold no document at all."""
    if len(wrapper) == 0:
        raise CorpusError(
            f"collections {list(wrapper.collections)} in database {wrapper.config.db!r} are empty; "
            f"ingest documents first (dsgpt2 ingest)"
        )
