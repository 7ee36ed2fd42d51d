"""The client of a MongoDB database: the per-process connection, retries of transient errors, one-line
errors naming the host (never the password), the read preference, the server's parse of FILTER, and
checks that collections exist.

The corpus is read and written through the clients made here (:mod:`dsgpt2.db.embedded` starts the server
of a ``local://`` database); the pymongo names the rooms above write with are given here too.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import random
import re
import shutil
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pymongo
from pymongo.errors import (
    AutoReconnect,
    ConfigurationError,
    OperationFailure,
    PyMongoError,
)

from dsgpt2.db import embedded
from dsgpt2.db.config import ENV_URI, EVAL_RESULTS, MongoConfig, uri_shape
from dsgpt2.db.filters import check_filter_languages, conjoin, filter_refusal
from dsgpt2.errors import ConfigError, CorpusError, DiskFullError, MongoUnavailableError, ServerLostError
from dsgpt2.progress import interval_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

# What the rooms above write with (bulk updates, index keys, the errors they catch, ``OperationFailure``
# among them), named here so that only this layer imports pymongo.
ASCENDING = pymongo.ASCENDING
UpdateOne = pymongo.UpdateOne
UpdateMany = pymongo.UpdateMany
DatabaseError = PyMongoError

# AutoReconnect covers NetworkTimeout and ServerSelectionTimeoutError: a primary
# stepping down, a dropped socket, a server restarting. Reads are idempotent,
# so retrying them is safe.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (AutoReconnect,)
MAX_BACKOFF_S = 30.0
# The longest $in list one query to stock SecantusDB carries (Connection.in_list_max): where its
# cost, quadratic in the list, meets the cost of one more query.
EMBEDDED_IN_LIST = 32
# What the buildInfo of the server dsgpt2 starts holds (db/secantusd.py): its $in costs a set lookup.
IN_LISTS_BY_SET = "dsgpt2InListsBySet"


def unreachable_message(config: MongoConfig, exc: BaseException | None = None) -> str:
    timeout = config.server_selection_timeout_ms
    reason = f" ({config.scrub(first_line(exc))})" if exc is not None else ""
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
                f"MongoDB at {config.hosts} refused the login: {config.scrub(first_line(exc))}; "
                f"check the user and password in MONGO_CONNECTION_STRING "
                f"(or the {ENV_URI} environment variable)"
            )
        return MongoUnavailableError(f"MongoDB at {config.hosts}: {config.scrub(first_line(exc))}")
    return MongoUnavailableError(unreachable_message(config, exc))


# patiently(): a server that has not answered a ping for this long (or three server selection timeouts)
# is lost.
LOST_AFTER_S = 15.0
# Less free space than this on the disk of an embedded database, when a command fails: a full disk.
# WiredTiger writes its log in files of 10 MB and stops (a panic) when it cannot.
FULL_DISK_BYTES = 32 * 2**20


def disk_full_error(config: MongoConfig) -> DiskFullError | None:
    """For a command that failed on an embedded database: the error to show when its disk is full, else
    None. The server, which stops answering once WiredTiger cannot write, is stopped: the next command
    starts it again from its journal, with every write acknowledged before kept."""
    if not embedded.is_local(config.uri):
        return None
    directory = embedded.local_dir(config.uri)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if free >= FULL_DISK_BYTES:
        return None
    held = embedded.disk_bytes(directory)
    with contextlib.suppress(ConfigError, OSError):
        embedded.stop(directory, timeout_s=10)
    return DiskFullError(
        f"{config.display_uri}: the disk holding the database is full ({free / 2**20:.0f} MB free; the "
        f"database takes {held / 2**20:.0f} MB); free at least {max(256, 2 * held / 2**20):.0f} MB there "
        "(room for the database to grow by its size) or move it to a larger disk, then re-run the same "
        "command to resume: everything written before is kept"
    )


_EMBEDDED_CLIENTS: dict[int, bool] = {}  # id(MongoClient) -> whether it speaks to the embedded engine


def count_in(coll: Any, query: dict[str, Any]) -> int:
    """``coll.count_documents(query)``. On the embedded engine as its ``count`` command, which counts
    while it reads: the aggregation ``count_documents`` sends is held whole in its memory there (every
    matching document, texts and all)."""
    client = coll.database.client
    embedded_engine = _EMBEDDED_CLIENTS.get(id(client))
    if embedded_engine is None:
        embedded_engine = "secantusVersion" in client.admin.command("buildInfo")
        _EMBEDDED_CLIENTS[id(client)] = embedded_engine
    if embedded_engine:
        return int(coll.database.command({"count": coll.name, "query": query})["n"])
    return int(coll.count_documents(query))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if not text:
        return type(exc).__name__
    # pymongo's server selection errors end in a dump of the topology: the reason comes before it.
    line = text[0].split(", Timeout: ")[0] if "Topology Description" in text[0] else text[0]
    return line[:300]


def revive(config: MongoConfig) -> bool:
    """After a transient error: an embedded server that died is started again (see
    :func:`dsgpt2.db.embedded.revive`); one that cannot start leaves the retries to end the command.
    Returns whether a server was started."""
    embedded.count_error()
    try:
        return embedded.revive(config.uri) is not None
    except (ConfigError, MongoUnavailableError, OSError) as exc:
        log.warning("%s: could not start its server again: %s", config.display_uri, first_line(exc))
        return False


def with_retries(
    fn: Callable[[], T],
    config: MongoConfig,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run the read ``fn``, retrying transient errors with exponential backoff.

    Raises:
        ServerLostError: still failing after ``config.retries`` retries (exit 3: re-run to resume).
    """
    attempt = 0
    while True:
        try:
            return fn()
        except TRANSIENT_ERRORS as exc:
            if attempt >= config.retries:
                raise ServerLostError(
                    f"{what} failed {attempt + 1} times on MongoDB at {config.hosts}: "
                    f"{config.scrub(first_line(exc))}; check the server and the network, "
                    f"or raise RETRIES in the config"
                ) from None
            revive(config)
            delay = min(MAX_BACKOFF_S, config.retry_backoff_s * 2**attempt)
            delay *= 1 + random.random() * 0.1  # jitter, so that ranks do not retry in lockstep
            log.warning(
                "%s: transient MongoDB error (%s); retry %d/%d in %.1fs",
                what, config.scrub(first_line(exc)), attempt + 1, config.retries, delay,
            )  # fmt: skip
            sleep(delay)
            attempt += 1


def patiently(conn: Connection, fn: Callable[[Any], T], what: str) -> T:
    """``fn(db)``: a server command whose time grows with the collection (an index build, a
    whole-collection aggregation or count), run to its end however long it takes.

    It runs on a client without the socket timeout (``SOCKET_TIMEOUT_MS`` bounds one ordinary query; a
    10^8-document index build or a loaded machine legitimately takes longer), in a thread of its own,
    while this one asks the server every few seconds whether it still answers (a ping bounded by the
    server selection timeout) and logs how long it has waited every ``DSGPT2_PROGRESS_SECONDS``.
    Transient errors are retried as any read is.

    Raises:
        ServerLostError: the server stopped answering, or transient errors past the retries (what was
            done is kept; re-run to resume).
    """
    beat = min(5.0, max(0.2, conn.config.server_selection_timeout_ms / 2000))
    # A server at work on a big command may be slow to answer a ping (the embedded one serves every
    # connection from one process; a loaded machine slows any): lost only after this long without one.
    grace = max(LOST_AFTER_S, 3 * conn.config.server_selection_timeout_ms / 1000)

    def attempt() -> T:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(conn.patient_db)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                box["error"] = exc

        worker = threading.Thread(target=run, name=f"dsgpt2: {what}", daemon=True)
        started = said = time.monotonic()
        worker.start()
        silent: float | None = None  # since when the server has not answered
        while True:
            worker.join(beat)
            if not worker.is_alive():
                break
            silent = answering(conn, what, started, silent, grace)
            if time.monotonic() - said >= interval_seconds():
                said = time.monotonic()
                log.info("%s: the server is still at it (%.0fs so far)", what, said - started)
        if "error" in box:
            if isinstance(box["error"], TRANSIENT_ERRORS):
                answering(conn, what, started)  # a lost server ends it; a passing fault is retried
            raise box["error"]
        return box["value"]

    return with_retries(attempt, conn.config, what)


def compact(conn: Connection) -> int:
    """Have the embedded server give the space of rewritten records back to the file system (its
    ``compact`` command, over the whole store: readers and writers go on meanwhile); returns the bytes
    its files shrank by. Waits however long it takes (:func:`patiently`)."""
    reply = patiently(conn, lambda db: db.client.admin.command("compact", "*"), "compacting the database")
    return int(reply.get("bytesFreed", 0))


def answering(
    conn: Connection, what: str, since: float, silent: float | None = None, grace: float = 0.0
) -> float | None:
    """Whether the server answers a ping within the server selection timeout: None if it does (or, for
    an embedded server, if its process is at work), else since when it has not (``silent``, or now).

    Raises:
        ServerLostError: it has not answered for ``grace`` seconds.
    """
    try:
        with pymongo.timeout(conn.config.server_selection_timeout_ms / 1000):
            conn.client.admin.command("ping")
        return None
    except PyMongoError as exc:
        if embedded.is_local(conn.config.uri) and embedded.working(embedded.local_dir(conn.config.uri)):
            return None
        if revive(conn.config):  # a killed embedded server, started again: the command's retries go on
            return None
        silent = time.monotonic() if silent is None else silent
        if time.monotonic() - silent < grace:
            return silent
        raise ServerLostError(
            f"{what}: MongoDB at {conn.config.hosts} stopped answering after {time.monotonic() - since:.0f}s "
            f"({conn.config.scrub(first_line(exc))}); what was done is kept: run the same command again "
            "once the server is back"
        ) from None


@contextlib.contextmanager
def database_errors(config: MongoConfig, what: str, advice: str) -> Iterator[None]:
    """Turn a pymongo error raised inside into one line naming the host (never the password); the
    retries' own error keeps its line and gains ``advice``.

    Raises:
        MongoUnavailableError: for any pymongo error (after whatever retries ran inside).
    """
    try:
        yield
    except DiskFullError:
        raise
    except MongoUnavailableError as exc:
        advised = exc if advice in str(exc) else type(exc)(f"{exc}; {advice}")
        raise disk_full_error(config) or advised from None
    except PyMongoError as exc:
        full = disk_full_error(config)
        if full is not None:
            raise full from None
        raise MongoUnavailableError(
            f"{what} failed on MongoDB at {config.hosts}: {config.scrub(first_line(exc))}; {advice}"
        ) from None


def _unknown_options(uri: str) -> str:
    """The options of ``uri`` pymongo does not know, each with the known one it is closest to."""
    from pymongo.common import URI_OPTIONS_VALIDATOR_MAP, VALIDATORS

    known = {k.lower(): k for k in (*URI_OPTIONS_VALIDATOR_MAP, *VALIDATORS)}
    query = urllib.parse.urlsplit(uri).query
    pairs = [p.partition("=")[0] for p in re.split(r"[&;]", query) if p]  # pymongo takes either separator
    names = [urllib.parse.unquote(k) for k in pairs if urllib.parse.unquote(k).lower() not in known]
    said = []
    for name in names or ["?"]:
        close = difflib.get_close_matches(name.lower(), list(known), n=1)
        said.append(f"{name!r}" + (f" (did you mean {known[close[0]]}?)" if close else ""))
    return f"unknown option {', '.join(said)}; pymongo would ignore it"


class Connection:
    """A lazily made client for the current process, and the database to use.

    The client is created on first use in the process that uses it. After a
    fork (DataLoader workers, launcher ranks) the child makes its own instead
    of reusing the parent's, and a pickled connection carries no client.
    """

    def __init__(self, config: MongoConfig, create: bool = True) -> None:
        self.config = config
        # False for a command that only reads: a local:// directory without a database is refused
        # instead of made (a typo in the path would otherwise start an empty server).
        self.create = create
        self._client: Any = None
        self._pid: int | None = None
        self._patient: Any = None  # the client without a socket timeout, made on first use here
        self._filter_checked = False
        self.filter_sampled = False  # FILTER tried on the first documents (the reader, once)
        # (pid, whether the server is the embedded engine, whether it matches an $in by set lookups)
        self._engine: tuple[int, bool, bool] | None = None
        self._port: int | None = None  # the embedded server's port when the clients were made
        self._errors_seen = 0

    def _engine_info(self) -> tuple[int, bool, bool]:
        """(pid, whether the server is the embedded engine (SecantusDB), whether it matches an ``$in`` by
        set lookups), by its buildInfo, once per process."""
        if self._engine is None or self._engine[0] != os.getpid():
            info = with_retries(lambda: self.client.admin.command("buildInfo"), self.config, "buildInfo")
            self._engine = (os.getpid(), "secantusVersion" in info, bool(info.get(IN_LISTS_BY_SET)))
        return self._engine

    def _embedded_engine(self) -> bool:
        return self._engine_info()[1]

    @property
    def in_list_max(self) -> int | None:
        """The longest ``$in`` list a query of this server should carry (None: any length).

        mongod looks each value of an ``$in`` up in the index and answers a list of thousands in time
        linear in it, and so does the embedded server dsgpt2 starts (its buildInfo says
        :data:`IN_LISTS_BY_SET`). Stock SecantusDB looks the values up as well, then tests every
        document it found against the whole list again: k values cost O(k^2) (measured: 1,000 values
        as one list 13x the time of the range holding them, as lists of 25 to 50 about 2x, as single
        values 11x: a query costs about as much as testing 200 values).
        """
        _, embedded_engine, by_set = self._engine_info()
        return EMBEDDED_IN_LIST if embedded_engine and not by_set else None

    @property
    def counts_walk(self) -> bool:
        """Whether counting a collection reads every record of it: on the embedded engine, which keeps
        no count (about 9 µs a document, 9 s at a million); mongod answers from its metadata."""
        return self._embedded_engine()

    def bulk_write(self, name: str, ops: Sequence[Any], *, ordered: bool = False) -> int:
        """``ops`` (pymongo write operations) on collection ``name`` as one bulk write; returns how many
        documents it modified.

        On the embedded engine the bulk runs in one transaction: it commits every statement of a bulk
        write on its own, a durable commit each (measured at 20,000 documents: 3.4 ms an updated
        document one by one, 0.6 ms in one transaction of 1,000). A transaction is all or nothing, so
        a retry after a failure rewrites the whole bulk. mongod applies a bulk write as a batch already
        (and runs transactions only on a replica set): there it is a plain bulk write.
        """
        if not ops:
            return 0
        coll = self.db[name]
        if not self._embedded_engine():
            return int(coll.bulk_write(list(ops), ordered=ordered).modified_count)
        with self.client.start_session() as session:
            result = session.with_transaction(
                lambda s: coll.bulk_write(list(ops), ordered=ordered, session=s)
            )
        return int(result.modified_count)

    def in_lists(self, values: Sequence[Any], longest: int | None = None) -> list[list[Any]]:
        """``values`` cut into the lists of ``$in`` queries this server answers in linear time, in
        order, none longer than ``longest`` (if given): one list on mongod, lists of
        :data:`EMBEDDED_IN_LIST` on the embedded engine. The server is asked only for a longer list."""
        values = list(values)
        size = longest
        if len(values) > EMBEDDED_IN_LIST and (engine := self.in_list_max) is not None:
            size = engine if size is None else min(size, engine)
        if size is None:
            return [values] if values else []
        return [values[i : i + size] for i in range(0, len(values), size)]

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "create": self.create, "_client": None, "_pid": None, "_patient": None,
                "_filter_checked": False, "_engine": None, "_port": None, "_errors_seen": 0}  # fmt: skip

    def __repr__(self) -> str:
        return f"Connection({self.config.display_uri!r}, db={self.config.db!r})"

    @property
    def client(self) -> Any:
        if self._server_moved() or self._client is None or self._pid != os.getpid():
            self._client = self._make_client()
            self._pid = os.getpid()
        return self._client

    def _server_moved(self) -> bool:
        """Whether, since a transient error of this process, the embedded server listens elsewhere (one
        started again after it died, on another port): the clients made for the old one are dropped.
        Asked only after such an error (:func:`revive` counts them), so a query pays nothing for it."""
        if self._errors_seen == embedded.errors_seen() or not embedded.is_local(self.config.uri):
            return False
        self._errors_seen = embedded.errors_seen()
        state = embedded.running(embedded.local_dir(self.config.uri))
        if state is None or state.port == self._port:
            return False
        log.info("%s: its server now listens on port %d; reconnecting", self.config.display_uri, state.port)
        # Dropped, not closed: closing would ask the dead server to end its sessions first.
        self._client, self._pid, self._patient = None, None, None
        return True

    @property
    def client_pid(self) -> int | None:
        """The process that made the current client (None before first use)."""
        return self._pid

    @property
    def db(self) -> Any:
        return self.client[self.config.db]

    @property
    def meta(self) -> Any:
        """The collection of the corpus's records (``meta_info``: counts, sources, marks, leases)."""
        return self.db[self.config.meta_collection]

    @property
    def patient_db(self) -> Any:
        """The database through a client of this process without the socket timeout: for the commands
        whose time grows with the collection (:func:`patiently` watches the server meanwhile)."""
        if self._server_moved() or self._patient is None or self._patient[0] != os.getpid():
            self._patient = (os.getpid(), self._make_client(patient=True))
        return self._patient[1][self.config.db]

    def _make_client(self, patient: bool = False) -> Any:
        uri = self.config.uri
        if embedded.is_local(uri):  # the embedded server: started here if none runs yet
            uri = embedded.ensure(embedded.local_dir(uri), create=self.create)
            self._port = urllib.parse.urlsplit(uri).port
            self._errors_seen = embedded.errors_seen()
        try:
            with warnings.catch_warnings():
                # pymongo ignores an option it does not know (readPreferance), or a value it cannot use
                # (authMechanism=BOGUS), with a warning: each is refused like any other bad option.
                warnings.filterwarnings("error", category=UserWarning, module=r"pymongo\.")
                warnings.filterwarnings("error", message="Unknown option", category=UserWarning)
                return pymongo.MongoClient(
                    uri,
                    serverSelectionTimeoutMS=self.config.server_selection_timeout_ms,
                    connectTimeoutMS=min(self.config.server_selection_timeout_ms, 20000),
                    socketTimeoutMS=None if patient else self.config.socket_timeout_ms,
                    appname="dsgpt2",
                    connect=False,
                )
        # ValueError: a port not a number; OSError: a tlsCAFile or tlsCertificateKeyFile not readable.
        except (ConfigurationError, ValueError, UserWarning, OSError) as exc:
            # Options named, never shown with their values: a misspelt secret option is not known to be one.
            unknown = isinstance(exc, UserWarning) and str(exc).startswith("Unknown option")
            why = _unknown_options(uri) if unknown else first_line(exc)
            raise ConfigError(
                f"invalid MONGO_CONNECTION_STRING {uri_shape(self.config.uri)!r}: {self.config.scrub(why)}"
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
        if self._patient is not None and self._patient[0] == os.getpid():
            self._patient[1].close()
        self._client = None
        self._pid = None
        self._patient = None
        self._engine = None


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


def existing_collections(conn: Connection) -> list[str]:
    """The names of the collections in the configured database (none if it does not exist)."""
    return sorted(with_retries(conn.db.list_collection_names, conn.config, "list collections"))


def require_collections(conn: Connection, names: Sequence[str] | None = None) -> None:
    """Raise, before any work reads them, when one of ``names`` (default: the config's COLLECTIONS) is
    not a collection of the database: an absent collection reads as an empty one (an empty split, a
    count of 0, advice that cannot help). Every command that reads a corpus asks this, so a missing
    collection gets one answer wherever it is named.

    Raises:
        CorpusError: one line naming the missing ones, the corpus collections the database holds and
            the closest of them, and the fixes: the name where it was given (COLLECTIONS in the user's
            config, or ``--collection``), or an ingest into it with the user's ``--config``.
    """
    names = list(conn.config.collections if names is None else names)
    have = existing_collections(conn)
    missing = [n for n in names if n not in have]
    if not missing:
        return
    # The toolkit's own collections are no corpus to name.
    corpus = [c for c in have if c not in (conn.config.meta_collection, EVAL_RESULTS)]
    corpus = [c for c in corpus if not c.startswith("system.")]
    holds = f"it holds {', '.join(corpus)}" if corpus else "it holds no corpus collection"
    close = difflib.get_close_matches(missing[0], corpus, n=1)
    if close:
        holds += f"; did you mean {close[0]!r}?"
    what = "collection {} does" if len(missing) == 1 else "collections {} do"
    source = conn.config.source or "CONFIG"
    where = f"COLLECTIONS in {source}" if set(missing) <= set(conn.config.collections) else "--collection"
    raise CorpusError(
        f"{what.format(', '.join(map(repr, missing)))} not exist in database {conn.config.db!r} at "
        f"{conn.config.display_uri} ({holds}); fix {where}, or ingest into it first: dsgpt2 ingest "
        f"--config {source} --collection {missing[0]} FILE..."
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
            conn.db[config.collections[0]].find_one(conjoin({"idx": -1}, query), {"_id": 1})

    try:
        with_retries(ask, config, "checking FILTER")
    except OperationFailure as exc:
        reason = str((exc.details or {}).get("errmsg") or first_line(exc)).split(", full error")[0]
        raise ConfigError(
            f"FILTER {config.filter}: {filter_refusal(query, reason)}; fix FILTER in the config"
        ) from None


def connect(config: MongoConfig, create: bool = True) -> Connection:
    """Open a connection and check that the server answers (``create``: see :class:`Connection`)."""
    conn = Connection(config, create=create)
    conn.ping()
    return conn
