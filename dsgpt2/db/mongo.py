"""MongoDB access: connections, retries, meta_info and the :class:`MongoWrapper`.

This is the module that talks to pymongo (with :mod:`dsgpt2.db.embedded`, which starts the
server of a ``local://`` database).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import operator
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import bson
import pymongo
from bson.codec_options import CodecOptions
from bson.errors import InvalidBSON
from bson.raw_bson import RawBSONDocument
from pymongo.errors import (
    AutoReconnect,
    ConfigurationError,
    OperationFailure,
    PyMongoError,
)

from dsgpt2.db import embedded
from dsgpt2.db.config import ENV_URI, MongoConfig
from dsgpt2.documents import ABSENT, Doc, SkipTally, text_problem, turns_problem
from dsgpt2.errors import BadDocumentError, ConfigError, CorpusError, MongoUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

# What the rooms above write with (bulk updates, index keys, the errors they catch), named here so that
# only this layer imports pymongo.
ASCENDING = pymongo.ASCENDING
UpdateOne = pymongo.UpdateOne
UpdateMany = pymongo.UpdateMany
DatabaseError = PyMongoError

# AutoReconnect covers NetworkTimeout and ServerSelectionTimeoutError: a primary
# stepping down, a dropped socket, a server restarting. Reads are idempotent,
# so retrying them is safe.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (AutoReconnect,)
_MAX_BACKOFF_S = 30.0


def unreachable_message(config: MongoConfig, exc: BaseException | None = None) -> str:
    timeout = config.server_selection_timeout_ms
    reason = f" ({config.scrub(_first_line(exc))})" if exc is not None else ""
    return (
        f"cannot reach MongoDB at {config.hosts} within {timeout} ms{reason}; "
        f"check that the server is running and reachable from here, and the host and port "
        f"in MONGO_CONNECTION_STRING (config file or the {ENV_URI} environment variable)"
    )


def unavailable_error(config: MongoConfig, exc: BaseException) -> MongoUnavailableError:
    """The error to show for a failed ping: unreachable, login refused, or other."""
    if isinstance(exc, OperationFailure):
        if exc.code in (18, 8000) or "auth" in str(exc).lower():
            return MongoUnavailableError(
                f"MongoDB at {config.hosts} refused the login: {config.scrub(_first_line(exc))}; "
                f"check the user and password in MONGO_CONNECTION_STRING "
                f"(or the {ENV_URI} environment variable)"
            )
        return MongoUnavailableError(f"MongoDB at {config.hosts}: {config.scrub(_first_line(exc))}")
    return MongoUnavailableError(unreachable_message(config, exc))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def with_retries(
    fn: Callable[[], T],
    config: MongoConfig,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run the read ``fn``, retrying transient errors with exponential backoff.

    Raises:
        MongoUnavailableError: still failing after ``config.retries`` retries.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except TRANSIENT_ERRORS as exc:
            if attempt >= config.retries:
                raise MongoUnavailableError(
                    f"{what} failed {attempt + 1} times on MongoDB at {config.hosts}: "
                    f"{config.scrub(_first_line(exc))}; check the server and the network, "
                    f"or raise RETRIES in the config"
                ) from None
            delay = min(_MAX_BACKOFF_S, config.retry_backoff_s * 2**attempt)
            delay *= 1 + random.random() * 0.1  # jitter, so that ranks do not retry in lockstep
            log.warning(
                "%s: transient MongoDB error (%s); retry %d/%d in %.1fs",
                what, config.scrub(_first_line(exc)), attempt + 1, config.retries, delay,
            )  # fmt: skip
            sleep(delay)
            attempt += 1


@contextlib.contextmanager
def database_errors(config: MongoConfig, what: str, advice: str) -> Iterator[None]:
    """Turn a pymongo error raised inside into one line naming the host (never the password).

    Raises:
        MongoUnavailableError: for any pymongo error (after whatever retries ran inside).
    """
    try:
        yield
    except PyMongoError as exc:
        raise MongoUnavailableError(
            f"{what} failed on MongoDB at {config.hosts}: {config.scrub(_first_line(exc))}; {advice}"
        ) from None


class Connection:
    """A lazily made client for the current process, and the database to use.

    The client is created on first use in the process that uses it. After a
    fork (DataLoader workers, launcher ranks) the child makes its own instead
    of reusing the parent's, and a pickled connection carries no client.
    """

    def __init__(self, config: MongoConfig) -> None:
        self.config = config
        self._client: Any = None
        self._pid: int | None = None
        self._filter_checked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "_client": None, "_pid": None}

    def __repr__(self) -> str:
        return f"Connection({self.config.display_uri!r}, db={self.config.db!r})"

    @property
    def client(self) -> Any:
        if self._client is None or self._pid != os.getpid():
            self._client = self._make_client()
            self._pid = os.getpid()
        return self._client

    @property
    def client_pid(self) -> int | None:
        """The process that made the current client (None before first use)."""
        return self._pid

    @property
    def db(self) -> Any:
        return self.client[self.config.db]

    def _make_client(self) -> Any:
        uri = self.config.uri
        if embedded.is_local(uri):  # the embedded server: started here if none runs yet
            uri = embedded.ensure(embedded.local_dir(uri))
        try:
            return pymongo.MongoClient(
                uri,
                serverSelectionTimeoutMS=self.config.server_selection_timeout_ms,
                connectTimeoutMS=min(self.config.server_selection_timeout_ms, 20000),
                socketTimeoutMS=self.config.socket_timeout_ms,
                appname="dsgpt2",
                connect=False,
            )
        except ConfigurationError as exc:
            raise ConfigError(
                f"invalid MONGO_CONNECTION_STRING {self.config.display_uri!r}: "
                f"{self.config.scrub(_first_line(exc))}"
            ) from None

    def ping(self) -> None:
        """Check that the server answers; fail fast with a clear message if not.

        Raises:
            MongoUnavailableError: no server within the selection timeout, or login refused.
        """
        try:
            self.client.admin.command("ping")
        except PyMongoError as exc:
            self.close()
            raise unavailable_error(self.config, exc) from None
        self.check_filter()  # every command that reads starts here: a bad FILTER stops it first

    def check_filter(self) -> None:
        """:func:`check_filter`, once per connection."""
        if not self._filter_checked:
            check_filter(self)
            self._filter_checked = True

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None
        self._pid = None


def read_preference(config: MongoConfig) -> Any:
    """pymongo's read preference for the training reads of ``config`` (READ_PREFERENCE, _TAGS)."""
    from pymongo import read_preferences as rp

    mode = {
        "primary": rp.Primary,
        "primaryPreferred": rp.PrimaryPreferred,
        "secondary": rp.Secondary,
        "secondaryPreferred": rp.SecondaryPreferred,
        "nearest": rp.Nearest,
    }[config.read_preference]
    if mode is rp.Primary:
        return rp.Primary()
    return mode(tag_sets=[dict(t) for t in config.read_preference_tags] or None)


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


def existing_collections(conn: Connection) -> list[str]:
    """The names of the collections in the configured database (none if it does not exist)."""
    return sorted(with_retries(conn.db.list_collection_names, conn.config, "list collections"))


def require_collections(conn: Connection, config_path: str = "CONFIG") -> None:
    """Raise when a configured collection does not exist in the database.

    Raises:
        CorpusError: naming the missing collections, those that exist, and the fix.
    """
    have = existing_collections(conn)
    missing = [c for c in conn.config.collections if c not in have]
    if not missing:
        return
    holds = f"it holds {', '.join(have)}" if have else "it holds no collection (empty or absent)"
    raise CorpusError(
        f"collection(s) {', '.join(missing)} not found in database {conn.config.db!r} at "
        f"{conn.config.display_uri} ({holds}); ingest them first (dsgpt2 ingest --config {config_path} "
        f"--collection {missing[0]} FILE...) or fix COLLECTIONS in {config_path}"
    )


def check_exist(conn: Connection, names: Sequence[str], fix: str) -> None:
    """Raise when one of ``names`` is not a collection of the database, before any work reads it (an
    absent collection reads as an empty one: an empty split, a count of 0, advice that cannot help).

    Raises:
        CorpusError: one line naming the missing ones, the corpus collections the database holds, and
            ``fix`` (the command's way to name others).
    """
    have = existing_collections(conn)
    missing = [n for n in names if n not in have]
    if not missing:
        return
    # The toolkit's own collections are no corpus to name.
    corpus = [c for c in have if c not in (conn.config.meta_collection, EVAL_RESULTS)]
    corpus = [c for c in corpus if not c.startswith("system.")]
    holds = f"it holds {', '.join(corpus)}" if corpus else "it holds no corpus collection"
    what = "collection {} does" if len(missing) == 1 else "collections {} do"
    raise CorpusError(
        f"{what.format(', '.join(map(repr, missing)))} not exist in database {conn.config.db!r} "
        f"({holds}); {fix}"
    )


def check_filter(conn: Connection) -> None:
    """Ask the server to parse the config's FILTER once, on no document of the corpus, so that an
    operator it refuses is one line before any work, not a failure in a worker hours later.

    One empty document matched in the server has every operator parsed (``$documents``: MongoDB 5.1+
    and the embedded server); older servers parse the whole query before they use the idx index that
    rules out every document (``idx`` -1).

    Raises:
        ConfigError: the server refuses the query (the message names the key and the operator).
    """
    config = conn.config
    query = config.filter_query
    if query is None:
        return
    check_filter_languages(query, config.filter)

    def ask() -> None:
        try:
            list(conn.db.aggregate([{"$documents": [{}]}, {"$match": query}]))
        except OperationFailure as exc:
            if exc.code not in (40324, 40602) and "$documents" not in str(exc):
                raise
            conn.db[config.collections[0]].find_one({"$and": [{"idx": -1}, query]}, {"_id": 1})

    try:
        with_retries(ask, config, "checking FILTER")
    except OperationFailure as exc:
        reason = str((exc.details or {}).get("errmsg") or _first_line(exc)).split(", full error")[0]
        raise ConfigError(
            f"FILTER {config.filter}: {filter_refusal(query, reason)}; fix FILTER in the config"
        ) from None


# The field `dsgpt2 langid` labels, and every code its model (py3langid 0.4) can put there; a test of
# dsgpt2/curation/language.py keeps the list equal to the model's.
LANGUAGE_FIELD = "lang"
_CODES = """ace af am an ar ary arz as az ba bcl be bg bn br bs ca crh cs cy da de dz el en eo es et eu ext fa
fi fo fr fuv fy ga gcf gcr gd gl gom grc gu gug guw ha hbo he hi hr ht hu hy id ig is it ja jv ka
kab kik kk km kn ko ku ky la lb lg lij ln lo lt ltg lv mg mk ml mn mr ms mt my ne nl nn no nso oc om
or pa pcm pl ps pt qu ro ru rw sa sdh se si sk sl sn so sq sr st sv sw ta te tg th tk tl tr tt ug uk
ur uz uzs vec vi vo wa wuu xh yo yue zh zu zxx"""
LANGUAGE_CODES = frozenset(_CODES.split())


def check_filter_languages(query: Any, shown: str) -> None:
    """Refuse a FILTER that compares ``lang`` with a code the language model never emits (it would
    select nothing, or everything): ``{"lang": "xx"}``, ``{"lang": {"$in": ["en", "zz"]}}``, also
    inside ``$and``, ``$or``, ``$nor`` and ``$not``.

    Raises:
        ConfigError: naming the code.
    """
    for code in _language_values(query):
        if code not in LANGUAGE_CODES:
            raise ConfigError(
                f"FILTER {shown}: {LANGUAGE_FIELD!r} {code!r} is not a language code `dsgpt2 langid` "
                f"labels (ISO 639, e.g. en, de, zh; {len(LANGUAGE_CODES)} codes); fix FILTER in the config"
            )


def _language_values(query: Any) -> Iterator[str]:
    if isinstance(query, list):
        for item in query:
            yield from _language_values(item)
    elif isinstance(query, dict):
        for key, value in query.items():
            if key in ("$and", "$or", "$nor"):
                yield from _language_values(value)
            elif key == LANGUAGE_FIELD:
                yield from _compared_codes(value)


def _compared_codes(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for op, operand in value.items():
            if op in ("$eq", "$ne") and isinstance(operand, str):
                yield operand
            elif op in ("$in", "$nin") and isinstance(operand, list):
                yield from (v for v in operand if isinstance(v, str))
            elif op == "$not":
                yield from _compared_codes(operand)


# Query operators, to suggest one for a typo the server refuses.
QUERY_OPERATORS = [
    "$eq", "$ne", "$gt", "$gte", "$lt", "$lte", "$in", "$nin", "$and", "$or", "$nor", "$not",
    "$exists", "$type", "$expr", "$jsonSchema", "$mod", "$regex", "$options", "$text", "$all",
    "$elemMatch", "$size", "$bitsAllClear", "$bitsAllSet", "$bitsAnyClear", "$bitsAnySet", "$comment",
]  # fmt: skip


def filter_refusal(query: Any, reason: str) -> str:
    """The server's ``reason`` for refusing ``query``, with the key of the operator it names and, for an
    unknown one, the operator most like it."""
    import difflib
    import re

    named = re.search(r"\$[A-Za-z]\w*", reason)
    if named is None:
        return f"the server refuses it ({reason})"
    operator = named.group(0)
    key = _key_of(query, operator)
    where = f"key {key!r}, operator {operator}" if key else f"operator {operator}"
    text = f"the server refuses {where} ({reason})"
    if "unknown" in reason:
        close = difflib.get_close_matches(operator, QUERY_OPERATORS, n=1)
        if close:
            text += f"; did you mean {close[0]}?"
    return text


def _key_of(query: Any, operator: str, key: str | None = None) -> str | None:
    """The field whose condition holds ``operator`` (None: a top-level one or not found)."""
    if isinstance(query, list):
        return next((k for item in query if (k := _key_of(item, operator, key)) is not None), None)
    if not isinstance(query, Mapping):
        return None
    for name, value in query.items():
        if name == operator:
            return key
        found = _key_of(value, operator, key if name.startswith("$") else name)
        if found is not None:
            return found
    return None


def connect(config: MongoConfig) -> Connection:
    """Open a connection and check that the server answers."""
    conn = Connection(config)
    conn.ping()
    return conn


# ---------------------------------------------------------------- meta_info


def read_meta(conn: Connection, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The meta_info entries of ``names`` (one query), keyed by collection name."""
    meta = conn.db[conn.config.meta_collection]
    docs = with_retries(
        lambda: list(meta.find({"collection": {"$in": list(names)}}, {"_id": 0})),
        conn.config,
        "reading meta_info",
    )
    return {d["collection"]: d for d in docs}


def write_meta(
    conn: Connection, name: str, fields: dict[str, Any], at_least: dict[str, Any] | None = None
) -> None:
    """Set ``fields`` on the meta_info entry of collection ``name`` (created if absent), and raise each
    field of ``at_least`` to its value (never lowered: another writer may have gone further)."""
    meta = conn.db[conn.config.meta_collection]
    update: dict[str, Any] = {"$set": fields}
    if at_least:
        update["$max"] = at_least
    meta.update_one({"collection": name}, update, upsert=True)


def idx_index_name(coll: Any) -> str | None:
    """The name of the unique ascending index on ``idx`` alone, or None."""
    for name, info in coll.index_information().items():
        if [tuple(k) for k in info["key"]] == [("idx", 1)] and info.get("unique"):
            return name
    return None


# ---------------------------------------------------------------- the wrapper


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
                coll = self._conn.db[name]
                count = with_retries(lambda c=coll: c.count_documents({}), self.config, f"counting {name}")
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

        One query per collection touched: a range query when that collection's
        indices are consecutive, ``$in`` otherwise. Bad documents are left out
        and counted in ``skipped`` (or raise in strict mode).
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
            lo, hi = min(locals_), max(locals_)
            if hi - lo + 1 == len(locals_):
                filt: dict[str, Any] = {"idx": {"$gte": lo, "$lt": hi + 1}}
            else:
                filt = {"idx": {"$in": sorted(locals_)}}
            fetched[pos] = self._query(pos, filt, batch=len(locals_))
            left_out[pos] = self._left_out(pos, filt, fetched[pos], len(locals_))
        out = []
        for i in wanted:
            pos, local = self.locate(i)
            text = self._check(i, pos, local, fetched[pos].get(local), local in left_out[pos])
            if text is not None:
                out.append(Doc(i, text))
        return out

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
        only when some asked for did not come (one query, idx only)."""
        if self.filter is None or len(fetched) >= asked:
            return set()
        out = self._query(
            pos, {"$and": [filt, {"$nor": [self.filter]}]}, asked - len(fetched), unfiltered=True
        )
        return set(out)

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
            filt = {"$and": [filt, self.filter]}

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


CONVERSATION_FIELD = "turns"
EVAL_RESULTS = "eval_results"
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


# ---------------------------------------------------------------- writing


def ensure_idx_index(coll: Any) -> None:
    """Create the unique index on ``idx`` unless it exists.

    Raises:
        CorpusError: the collection holds duplicate idx values, so no unique index can exist.
    """
    if idx_index_name(coll) is not None:
        return
    try:
        coll.create_index([("idx", pymongo.ASCENDING)], unique=True, name="idx_unique")
    except (OperationFailure, PyMongoError) as exc:
        raise CorpusError(
            f"cannot create the unique idx index on {coll.name!r}: {_first_line(exc)}; "
            f"run `dsgpt2 validate` to find the duplicate idx values"
        ) from None


# Reads of "the largest idx" or "the next documents after idx k" ask bounded idx windows, never an
# open range with a sort and a limit: the embedded server reads every document of a range before it
# applies the limit, so an open range costs the whole collection there (2 s for one edge at 50,000
# documents, where a window of 1,024 costs 30 ms). On mongod the windows cost what the open read did.
EDGE_WINDOW = 1024


def _first_idx(coll: Any, query: dict[str, Any], bounds: dict[str, Any], direction: int) -> Any:
    doc = coll.find_one({**query, "idx": bounds}, {"_id": 0, "idx": 1}, sort=[("idx", direction)])
    return None if doc is None else doc["idx"]


def idx_edge(coll: Any, direction: int, query: dict[str, Any] | None = None, guess: int | None = None) -> Any:
    """The lowest (``direction`` 1) or highest (-1) numeric idx of the documents of ``coll`` that match
    ``query`` (its own idx condition, if any, is replaced), or None when none does.

    Looked for from ``guess`` (default: 0 for the lowest, the collection's count - 1 for the highest)
    outwards in idx windows that double: the documents read are those between the guess and the edge,
    a few when the guess is close, never more than the range holds.
    """
    query = {k: v for k, v in (query or {}).items() if k != "idx"}
    if direction < 0:
        start = guess if guess is not None else coll.estimated_document_count() - 1
        found = _first_idx(coll, query, {"$gte": start}, -1)
        hi, width = start, EDGE_WINDOW
        while found is None:
            if hi <= 0:  # below 0 only negative idx values remain, few if any: one open read
                return _first_idx(coll, query, {"$lt": hi}, -1)
            found = _first_idx(coll, query, {"$gte": hi - width, "$lt": hi}, -1)
            hi, width = hi - width, width * 2
        return found
    start = guess if guess is not None else 0
    found = _first_idx(coll, query, {"$lte": start}, 1)
    lo, width, top = start, EDGE_WINDOW, None
    while found is None:
        if lo > start:  # an empty window: the walk ends at the highest
            top = idx_edge(coll, -1, query) if top is None else top
            if top is None or lo >= top:
                return None
        found = _first_idx(coll, query, {"$gt": lo, "$lte": lo + width}, 1)
        lo, width = lo + width, width * 2
    return found


def max_idx(coll: Any, guess: int | None = None) -> int | None:
    """The largest numeric idx in ``coll``, or None when there is none (:func:`idx_edge`)."""
    top = idx_edge(coll, -1, guess=guess)
    return None if top is None else int(top)


def insert_batch(
    conn: Connection, coll: Any, docs: list[dict[str, Any]], sleep: Callable[[float], None] = time.sleep
) -> int:
    """Insert ``docs`` (numbered from ``docs[0]["idx"]`` on) in order; returns the idx after the last.

    Another writer of the same collection (a second ingest) may take an idx first: the unique index
    refuses ours, and the rest of the batch is numbered again after the largest idx there is. Inserts
    are ordered and each one lands at most one past the largest idx, so idx stays contiguous. A transient
    error (a failover, a dropped connection) is retried with backoff, up to ``RETRIES`` times: the
    documents that landed before it (found by their ``_id``, which the driver gave each one) are not
    sent again.

    Raises:
        CorpusError: a write refused for another reason.
        MongoUnavailableError: the server failed mid-batch, past the retries.
    """
    attempt = 0
    unsure = False  # after a transient error: which of ``docs`` landed is not known yet
    while True:
        try:
            if unsure:
                end = int(docs[-1]["idx"]) + 1
                docs = docs[_landed(coll, docs) :]
                unsure = False
                if not docs:
                    return end
            coll.insert_many(docs, ordered=True)
            return int(docs[-1]["idx"]) + 1
        except pymongo.errors.BulkWriteError as exc:
            first = (exc.details.get("writeErrors") or [{}])[0]
            at = int(first.get("index", 0))
            if first.get("code") == 11000 and "idx" in (first.get("keyPattern") or {"idx": 1}):
                top = max_idx(coll, guess=int(docs[at]["idx"]))
                docs = [{**d, "idx": (-1 if top is None else top) + 1 + i} for i, d in enumerate(docs[at:])]
                log.debug("%s: idx taken by another writer; the batch goes on from idx %d", coll.name, top)
                continue
            raise CorpusError(
                f"insert into {coll.name!r} failed at idx {docs[at].get('idx')}: "
                f"{conn.config.scrub(str(first.get('errmsg', exc)))}"
            ) from None
        except TRANSIENT_ERRORS as exc:
            if attempt >= conn.config.retries:
                raise MongoUnavailableError(
                    f"insert into {coll.name!r} failed {attempt + 1} times on MongoDB at "
                    f"{conn.config.hosts}: {conn.config.scrub(_first_line(exc))}; "
                    "re-run the same command to resume"
                ) from None
            delay = min(_MAX_BACKOFF_S, conn.config.retry_backoff_s * 2**attempt)
            log.warning("insert into %s: transient MongoDB error (%s); retry %d/%d in %.1fs",
                        coll.name, conn.config.scrub(_first_line(exc)), attempt + 1, conn.config.retries,
                        delay)  # fmt: skip
            sleep(delay)
            attempt += 1
            unsure = True
        except PyMongoError as exc:
            raise MongoUnavailableError(
                f"insert into {coll.name!r} on {conn.config.hosts} failed: "
                f"{conn.config.scrub(_first_line(exc))}; re-run the same command to resume"
            ) from None


def _landed(coll: Any, docs: list[dict[str, Any]]) -> int:
    """How many of ``docs``, from the first, are stored (an ordered insert stores a prefix)."""
    ids = [d["_id"] for d in docs if "_id" in d]
    stored = {d["_id"] for d in coll.find({"_id": {"$in": ids}}, {"_id": 1})} if ids else set()
    landed = 0
    for d in docs:
        if d.get("_id") not in stored:
            break
        landed += 1
    return landed


def record_eval(conn: Connection, result: dict[str, Any], collection: str = EVAL_RESULTS) -> Any:
    """Store an evaluation result in ``collection`` beside the corpus; return its id."""
    import uuid

    coll = conn.db[collection]
    doc = {"_id": uuid.uuid4().hex, **result}
    # An upsert by a fixed _id: retrying after a lost acknowledgement cannot store it twice.
    try:
        with_retries(
            lambda: coll.replace_one({"_id": doc["_id"]}, doc, upsert=True),
            conn.config,
            f"writing {collection}",
        )
    except OperationFailure as exc:
        raise MongoUnavailableError(
            f"could not write to {conn.config.db}.{collection}: {conn.config.scrub(_first_line(exc))}; "
            "the user needs the readWrite role on the database (or skip recording)"
        ) from None
    return doc["_id"]
