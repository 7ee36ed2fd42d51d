"""Check that collections satisfy what the :class:`~dsgpt2.db.wrapper.MongoWrapper` relies on.

A collection is valid when its documents carry integer ``idx`` values
0..n-1, each once, under a unique index, and meta_info records n. Every
problem found comes with the fix. The checks run on the server (counts,
aggregations, indexed lookups), never by reading the documents here.

Two depths: :func:`validate_collection` examines every document (``dsgpt2 validate``; minutes on
a collection of tens of millions); :func:`quick_check` reads only what the index and the
collection's metadata answer, in the same few commands at any size (what a run checks at start).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from dsgpt2.db.client import Connection, count_in, patiently, with_retries
from dsgpt2.db.idx import ensure_idx_index, idx_edge, idx_index_name
from dsgpt2.db.meta import read_meta, write_meta
from dsgpt2.db.summaries import integer_idx
from dsgpt2.errors import CorpusError

log = logging.getLogger(__name__)

INT_IDX: dict[str, Any] = {"$or": [{"idx": {"$type": "int"}}, {"idx": {"$type": "long"}}]}
NOT_INT_IDX: dict[str, Any] = {"$nor": [{"idx": {"$type": "int"}}, {"idx": {"$type": "long"}}]}
_EXAMPLES = 5


@dataclass
class Problem:
    """One thing wrong with a collection, and how to fix it."""

    kind: str
    message: str
    fix: str
    severity: str = "error"  # "error" blocks training; "warning" does not


@dataclass
class CollectionReport:
    """The validation result of one collection."""

    name: str
    documents: int
    meta_count: int | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def lines(self) -> list[str]:
        errors = sum(p.severity == "error" for p in self.problems)
        status = "OK" if errors == 0 else f"{errors} problem{'s' * (errors != 1)}"
        out = [f"{self.name}: {self.documents} documents, {status}"]
        for p in self.problems:
            out.append(f"  {p.severity}: {p.kind}: {p.message}")
            out.append(f"    fix: {p.fix}")
        return out


def validate_collection(conn: Connection, name: str) -> CollectionReport:
    """Run every check on collection ``name``."""
    db = conn.db
    coll = db[name]

    def run(what: str, fn: Any) -> Any:
        # Whole-collection counts and groupings: run to their end (the server watched meanwhile).
        return patiently(conn, lambda db: fn(db[name]), f"validating {name}: {what}")

    documents = run("count", lambda c: count_in(c, {}))
    meta = with_retries(lambda: read_meta(conn, [name]), conn.config, f"validating {name}: meta").get(name)
    meta_count = meta.get("count") if meta else None
    report = CollectionReport(name, documents, meta_count)
    problems = report.problems
    if documents == 0:
        problems.append(
            Problem(
                "empty",
                f"collection {name!r} holds no document (or does not exist)",
                f"ingest documents: dsgpt2 ingest --config {conn.config.source or 'CONFIG'} --collection "
                f"{name} FILE...",
            )
        )
        return report

    scan = _IntScan(conn, name) if conn.counts_walk else None
    not_int = documents - scan.count if scan else run("idx types", lambda c: count_in(c, NOT_INT_IDX))
    unnumbered, waiting = _unnumbered(coll, meta, run)
    problems += waiting
    not_int -= unnumbered
    if not_int:
        examples = run("idx examples", lambda c: list(c.find(NOT_INT_IDX, {"idx": 1}).limit(_EXAMPLES)))
        shown = ", ".join(f"{d.get('idx', '<missing>')!r} ({type(d.get('idx')).__name__})" for d in examples)
        problems.append(
            Problem(
                "non_integer_idx",
                f"{not_int} document(s) have a missing or non-integer idx, e.g. {shown}",
                'store idx as an integer ("7" → 7): '
                f"db.{name}.find({{idx: {{$type: 'string'}}}}).forEach(d => db.{name}.updateOne("
                "{_id: d._id}, {$set: {idx: NumberLong(d.idx)}})), or re-ingest the collection",
            )
        )

    index_name = run("indexes", lambda c: idx_index_name(c))
    duplicates = run("duplicates", lambda c: _duplicates(c)) if index_name is None else (0, [])
    if duplicates[0]:
        n, values = duplicates
        problems.append(
            Problem(
                "duplicate_idx",
                f"{n} idx value(s) are used by more than one document, e.g. {values}",
                f"delete or renumber the extra documents (db.{name}.find({{idx: {values[0]}}})), "
                "then run dsgpt2 validate --fix to create the unique index",
            )
        )
    if index_name is None:
        problems.append(
            Problem(
                "missing_idx_index",
                "no unique index on idx: lookups scan the collection and duplicates go unnoticed",
                f"dsgpt2 validate --fix (or db.{name}.createIndex({{idx: 1}}, {{unique: true}}))",
            )
        )

    stats = scan.stats() if scan else run("idx range", lambda c: _int_stats(c))
    if stats is not None:
        lo, hi, n_int = stats
        distinct = n_int - (run("copies", lambda c: _extra_copies(c)) if duplicates[0] else 0)
        if lo < 0:
            problems.append(
                Problem(
                    "negative_idx",
                    f"idx values start at {lo}; they must run from 0",
                    "renumber the documents from 0, or re-ingest the collection",
                )
            )
        missing = hi + 1 - distinct if lo >= 0 else 0
        if missing > 0:
            first = None
            if not duplicates[0]:
                first = scan.first_gap if scan else run("first gap", lambda c: _first_gap(c, hi))
            at = f"; the first missing idx is {first}" if first is not None else ""
            problems.append(
                Problem(
                    "gaps",
                    f"{missing} idx value(s) between 0 and {hi} have no document{at}",
                    "insert the missing documents or renumber idx to run 0..n-1 without holes; "
                    "until then each gap is skipped and counted as 'missing'",
                )
            )

    problems += _meta_problems(conn, name, meta_count, documents, _growing(meta))
    return report


def _unnumbered(coll: Any, meta: dict[str, Any] | None, run: Any) -> tuple[int, list[Problem]]:
    """In a collection numbered in place, the documents its application added since the last
    `dsgpt2 index`: not an error, they wait for their numbers."""
    numbered = (meta or {}).get("numbered_in_place")
    n = run("unnumbered", lambda c: count_in(c, {"idx": {"$exists": False}})) if numbered else 0
    if not n:
        return 0, []
    message = (
        f"{n} document(s) added since the last `dsgpt2 index` have no idx yet: training does not read them"
    )
    fix = f"dsgpt2 index --collection {coll.name} --field {numbered.get('field', 'text')} numbers them"
    return n, [Problem("unnumbered", message, fix, severity="warning")]


def _growing(meta: dict[str, Any] | None) -> bool:
    """Documents past meta_info's count are expected: an ingest is running, or the collection is
    numbered in place and its application adds documents that the next `dsgpt2 index` numbers."""
    sources = (meta or {}).get("sources") or {}
    ingesting = any(isinstance(v, dict) and not v.get("complete") for v in sources.values())
    return ingesting or bool((meta or {}).get("numbered_in_place"))


def _meta_problems(
    conn: Connection, name: str, meta_count: int | None, documents: int, ingesting: bool = False
) -> list[Problem]:
    """What meta_info says of the collection's size, against what it holds. Documents past the
    count while an ingest is under way are its batch in flight: the count (the high-water mark)
    follows once the batch is in."""
    out: list[Problem] = []
    if ingesting and meta_count is not None and meta_count < documents:
        out.append(
            Problem(
                "ingest_in_progress",
                f"{documents - meta_count} document(s) past the count {meta_count} are not counted yet "
                "(an ingest under way, or documents added since the last `dsgpt2 index`)",
                "none needed; a rerun of the interrupted ingest, or of dsgpt2 index, counts them",
                severity="warning",
            )
        )
        return out
    if meta_count is None:
        out.append(
            Problem(
                "no_meta_count",
                f"{conn.config.meta_collection} has no count for {name!r}; it will be counted at each open",
                "dsgpt2 validate --fix records it",
                severity="warning",
            )
        )
    elif meta_count != documents:
        out.append(
            Problem(
                "meta_count_mismatch",
                f"{conn.config.meta_collection} says {meta_count} documents, "
                f"the collection holds {documents}",
                "dsgpt2 validate --fix rewrites the count (after the other problems are fixed)",
            )
        )
    return out


def _duplicates(coll: Any) -> tuple[int, list[Any]]:
    pipeline = [
        {"$match": INT_IDX},
        {"$group": {"_id": "$idx", "n": {"$sum": 1}}},
        {"$match": {"n": {"$gt": 1}}},
        {"$sort": {"_id": 1}},
    ]
    dups = list(coll.aggregate(pipeline, allowDiskUse=True))
    return len(dups), [d["_id"] for d in dups[:_EXAMPLES]]


def _extra_copies(coll: Any) -> int:
    pipeline = [
        {"$match": INT_IDX},
        {"$group": {"_id": "$idx", "n": {"$sum": 1}}},
        {"$match": {"n": {"$gt": 1}}},
        {"$group": {"_id": None, "extra": {"$sum": {"$subtract": ["$n", 1]}}}},
    ]
    out = list(coll.aggregate(pipeline, allowDiskUse=True))
    return int(out[0]["extra"]) if out else 0


class _IntScan:
    """The integer idx values of a collection read in idx windows (bounded server memory on the
    embedded engine, whose counts with a condition hold every document): how many, the ends, the
    first missing one."""

    def __init__(self, conn: Connection, name: str) -> None:
        what = f"validating {name}: idx values"
        coll = conn.db[name]
        # Negative idx values, where the index's lowest end is one (an open range is a collection scan).
        lowest = with_retries(lambda: idx_edge(coll, 1), conn.config, what)
        below = []
        if isinstance(lowest, int | float) and not isinstance(lowest, bool) and lowest < 0:
            negative = {"idx": {"$gte": lowest, "$lt": 0}}
            below = with_retries(lambda: list(coll.find(negative, {"_id": 0, "idx": 1})), conn.config, what)
        ints = [d["idx"] for d in below if isinstance(d["idx"], int) and not isinstance(d["idx"], bool)]
        self.count, self.lo, self.hi = len(ints), min(ints, default=None), max(ints, default=None)
        self.first_gap: int | None = None
        expected = 0
        for window in integer_idx(conn, name, what):
            for idx in sorted(set(window)):
                if idx != expected and self.first_gap is None:
                    self.first_gap = expected
                expected = idx + 1
            self.count += len(window)
            if window:
                self.lo = min(window) if self.lo is None else self.lo
                self.hi = max(window)

    def stats(self) -> tuple[int, int, int] | None:
        return (
            None if self.count == 0 or self.lo is None or self.hi is None else (self.lo, self.hi, self.count)
        )


def _int_stats(coll: Any) -> tuple[int, int, int] | None:
    """The lowest and highest integer idx and how many there are, or None when there is none."""
    n = count_in(coll, INT_IDX)
    if n == 0:
        return None
    # The numeric ends in bounded idx windows; a sorted find over the type test would read (and on the
    # embedded engine hold) the whole collection, and is asked only when an end is not an integer.
    ends = [idx_edge(coll, 1), idx_edge(coll, -1, guess=n - 1)]
    for k, direction in enumerate((1, -1)):
        if not isinstance(ends[k], int) or isinstance(ends[k], bool):
            ends[k] = coll.find_one(INT_IDX, {"_id": 0, "idx": 1}, sort=[("idx", direction)])["idx"]
    return int(ends[0]), int(ends[1]), n


def _first_gap(coll: Any, hi: int) -> int | None:
    """The smallest missing idx in 0..hi, by binary search on indexed counts (no duplicates)."""
    lo_, hi_ = 0, hi + 1  # invariant: count(idx < lo_) == lo_
    if count_in(coll, {"idx": {"$gte": 0, "$lt": hi_}}) == hi_:
        return None
    while hi_ - lo_ > 1:
        mid = (lo_ + hi_) // 2
        if count_in(coll, {"idx": {"$gte": 0, "$lt": mid}}) == mid:
            lo_ = mid
        else:
            hi_ = mid
    return lo_


def quick_check(conn: Connection, name: str, meta: dict[str, Any] | None) -> CollectionReport:
    """What the unique index, the collection's metadata and meta_info say of ``name``, without a
    scan: the index is there; the collection holds meta_info's count n (its metadata count, where
    the engine keeps one); the index's two ends are the integers 0 and n-1. With a unique index these
    leave no room for a gap, a duplicate or a missing, null, string or negative idx (all of them sort
    outside the integers 0..n-1, or make the count differ), only for a fractional idx between two
    integers: that and the text of each document are what ``dsgpt2 validate`` examines. ``meta``: the
    collection's meta_info entry (None when it has none).
    """
    coll = conn.db[name]

    def run(what: str, fn: Any) -> Any:
        return with_retries(fn, conn.config, f"checking {name}: {what}")

    meta_count = meta.get("count") if meta else None
    if conn.counts_walk and isinstance(meta_count, int) and not isinstance(meta_count, bool):
        # The embedded engine keeps no count: counting reads every record (9 s at a million documents).
        # meta_info's count stands for it, and the idx index's two ends bound it; a document deleted
        # from the middle (the one thing this leaves unseen) is skipped and counted as missing where
        # training reads it, and `dsgpt2 validate` counts.
        documents = meta_count
    else:
        # mongod answers from its metadata; patiently, so that a large count is never cut off.
        documents = patiently(conn, lambda db: db[name].estimated_document_count(), f"checking {name}: count")
    report = CollectionReport(name, documents, meta_count)
    problems = report.problems
    if documents == 0:
        problems.append(Problem("empty", f"collection {name!r} holds no document (or does not exist)",
                                f"ingest documents: dsgpt2 ingest --config {conn.config.source or 'CONFIG'} "
                                f"--collection {name} FILE..."))  # fmt: skip
        return report
    if run("indexes", lambda: idx_index_name(coll)) is None:
        problems.append(
            Problem(
                "missing_idx_index",
                "no unique index on idx: lookups scan the collection and duplicates go unnoticed",
                f"dsgpt2 validate --fix (or db.{name}.createIndex({{idx: 1}}, {{unique: true}}))",
            )
        )
        return report
    problems += _meta_problems(conn, name, meta_count, documents, _growing(meta))
    n = meta_count if meta_count is not None else documents
    # In the index, missing and null idx sort before every number, strings and the other types
    # after them: the two ends show any of them. A collection numbered in place has a sparse index
    # (its application adds documents without idx), which only a query that asks for idx can use.
    only = {"idx": {"$exists": True}} if (meta or {}).get("numbered_in_place") else {}
    for end, direction, expected in (("first", 1, 0), ("last", -1, n - 1)):
        idx = run("idx ends", lambda d=direction, g=expected: _index_end(coll, d, only, max(g, 0)))
        if not isinstance(idx, int) or isinstance(idx, bool) or idx != expected:
            problems.append(
                Problem(
                    "idx_ends",
                    f"the {end} idx in index order is {idx!r} ({type(idx).__name__}), not {expected}: "
                    "idx must run 0..n-1 as integers",
                    f"dsgpt2 validate {name} names the documents and the fix",
                )
            )
    return report


def _index_end(coll: Any, direction: int, query: dict[str, Any], guess: int) -> Any:
    """The idx at one end of the idx index (1: the lowest), or None for an empty collection.

    Asked as bounded reads (see :func:`idx_edge`): first what sorts outside the numbers at that end
    (a missing or null idx before them; a string or a boolean, the kinds a hand-made or imported idx
    takes, after them), then the number at the end, looked for from ``guess``."""
    if direction > 0:
        doc = coll.find_one({"idx": {"$eq": None, **query.get("idx", {})}}, {"_id": 0, "idx": 1})
        outside = [doc] if doc is not None else []
    else:
        outside = [
            coll.find_one({"idx": q}, {"_id": 0, "idx": 1}) for q in ({"$in": [True, False]}, {"$gte": ""})
        ]
    for doc in outside:
        if doc is not None:
            return doc.get("idx")
    return idx_edge(coll, direction, guess=guess)


def validate_corpus(conn: Connection, names: list[str] | None = None) -> list[CollectionReport]:
    """Validate each of ``names`` (default: the configured collections)."""
    return [validate_collection(conn, n) for n in (names or list(conn.config.collections))]


def require_valid(
    conn: Connection, names: list[str] | None = None, full: bool = True, override: str = ""
) -> list[CollectionReport]:
    """Check, and refuse a corpus with errors (what training calls before it starts).

    Args:
        full: every document examined (:func:`validate_collection`); else :func:`quick_check`.
        override: how the caller's command goes on anyway (its flag), added to the message.

    Raises:
        CorpusError: naming each problem and its fix.
    """
    names = names or list(conn.config.collections)
    if full:
        reports = validate_corpus(conn, names)
    else:
        meta = with_retries(lambda: read_meta(conn, names), conn.config, "reading meta_info")
        reports = [quick_check(conn, n, meta.get(n)) for n in names]
    bad = [r for r in reports if not r.ok]
    if bad:
        details = "; ".join(
            f"{r.name}: {p.kind} ({p.message}; fix: {p.fix})"
            for r in bad
            for p in r.problems
            if p.severity == "error"
        )
        # A collection with no document has nothing to train past: going on anyway is no answer to it.
        kinds = {p.kind for r in bad for p in r.problems if p.severity == "error"}
        anyway = override if kinds - {"empty"} else ""
        raise CorpusError(f"the corpus has problems: {details}. Run `dsgpt2 validate` for details{anyway}")
    return reports


def fix_collection(conn: Connection, name: str) -> list[str]:
    """Repair what is safe to repair automatically; return one line per thing done or left.

    Creates the unique idx index when there are no duplicates, and records the
    document count in meta_info when idx is otherwise clean. Renumbering or
    deleting documents is left to the user: that changes the corpus, so what
    remains is named with what to do instead.
    """
    done: list[str] = []
    report = validate_collection(conn, name)
    kinds = {p.kind for p in report.problems}
    if "missing_idx_index" in kinds and "duplicate_idx" not in kinds:
        ensure_idx_index(conn, name, f"indexing {name}")
        done.append(f"{name}: fixed: created the unique index on idx")
    blocking = kinds & {"non_integer_idx", "duplicate_idx", "gaps", "negative_idx", "empty"}
    if kinds & {"no_meta_count", "meta_count_mismatch"} and not blocking:
        write_meta(conn, name, {"count": report.documents})
        done.append(f"{name}: fixed: recorded count {report.documents} in {conn.config.meta_collection}")
    if blocking:
        done.append(
            f"{name}: not fixed: {', '.join(sorted(blocking))} change which documents exist or their "
            "numbering, which --fix never does; re-ingest into a fresh collection (dsgpt2 ingest) or "
            "apply the fixes below by hand"
        )
    elif not kinds:
        done.append(f"{name}: nothing to fix")
    return done
