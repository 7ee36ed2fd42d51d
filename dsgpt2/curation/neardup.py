"""Near duplicates, found and marked where the corpus lives: ``dsgpt2 dedup --near``.

Stages, each resumable (the shape of datatrove's minhash dedup, on documents instead of files):

1. **Signatures.** Each document gets ``lsh`` (its MinHash LSH band values, :mod:`dsgpt2.curation.minhash`)
   and ``lsh_key`` (the shingling, permutations and banding they were taken with); ``lsh`` is indexed
   (multikey), so that a new document finds its candidates with one query. A pass signs the documents
   whose ``lsh_key`` is not this run's: killed, it continues; under another threshold it signs again.
2. **Buckets.** The database groups the band values (``$unwind``, ``$group`` over the collections
   joined by ``$unionWith``; on a sharded cluster every shard groups its own documents); a band value
   held by more than one document is a bucket of candidates.
3. **Clusters.** Candidates are confirmed on their texts (the Jaccard similarity of their shingle sets
   at least the threshold, not the signature's estimate of it) and joined into clusters.
4. **Marks.** Every document of a cluster but the first (earliest collection in ``COLLECTIONS``, then
   smallest idx) gets ``near_dup_of: "collection:idx"``, the cluster's first document; a document
   marked before and in no cluster now is unmarked. Stages 2–4 are computed whole from the
   signatures, so a pass killed while marking and run again ends as a straight one.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dsgpt2.curation.minhash import (
    NUM_PERM,
    Clusters,
    LshParams,
    Signer,
    band_values,
    jaccard,
    shingles,
    signature,
)
from dsgpt2.curation.passes import NUMBERED
from dsgpt2.curation.steps import CollectionPart, Reason, Report, Split, Step
from dsgpt2.db.bulk import find_in, write_ops
from dsgpt2.db.client import Connection, UpdateMany, UpdateOne, with_retries
from dsgpt2.db.groups import SPAN, shared_elements
from dsgpt2.db.idx import drop_index, ensure_index
from dsgpt2.db.meta import read_meta, write_meta
from dsgpt2.db.summaries import count_numbered, read_windows
from dsgpt2.documents import BANDS, BANDS_KEY, IDX, NEAR_OF, TURNS, document_text
from dsgpt2.settings.options import POSITIVE_INT, RATIO, Checked, option

log = logging.getLogger(__name__)

BANDS_INDEX = "lsh_1"
_BUCKETS_PER_ROUND = 2000
_CACHE = 50_000  # shingle sets held while confirming
_BULK = 1000


# The note of both dedup stages: marking groups every part's hashes or signatures, so one run without
# parts marks.
MARKED_AFTER_PARTS = "once every part is, run once without --part to mark"


def duplicates_line(part: Any, done: int, verb: str, what: str, mark: str) -> str:
    """A collection's line in a dedup stage's report: its documents, ``done`` of them ``verb`` by this
    run, and the copies marked ``mark`` (``part``: its ``name``, ``documents``, ``duplicates``,
    ``marked`` and ``unmarked`` by this run)."""
    share = f" ({part.duplicates / part.documents:.1%})" if part.documents else ""
    unmarked = f", {part.unmarked} unmarked" if part.unmarked else ""
    return (f"{part.name}: {part.documents} documents, {done} {verb} by this run; {part.duplicates} {what}"
            f"{share} marked {mark} ({part.marked} by this run{unmarked})")  # fmt: skip


def label(names: Sequence[str], key: int) -> str:
    """``collection:idx`` of a document key."""
    return f"{names[key // SPAN]}:{key % SPAN}"


def ensure_bands_index(conn: Connection, name: str, what: str) -> None:
    ensure_index(conn, name, BANDS, what)


@dataclass(frozen=True, kw_only=True)
class DedupSettings(Checked):
    """``dsgpt2 dedup``: which duplicates, and how near is near."""

    exact: bool = option(False, "exact duplicates, by text_hash")
    near: bool = option(False, "near duplicates, by MinHash LSH")
    threshold: float = option(
        0.8,
        "--near: the Jaccard similarity of word n-gram sets from which two texts are near duplicates",
        check=RATIO,
    )
    ngram: int = option(5, "--near: words per shingle", check=POSITIVE_INT)
    num_perm: int = option(
        128,
        "--near: MinHash permutations; the bands are chosen from them for --threshold",
        check=NUM_PERM,
    )


@dataclass
class Signing(Step):
    """``dedup --near``'s first stage: ``lsh`` and ``lsh_key`` stored on the documents not signed under
    ``params``, the ``lsh`` index built first; then, over every collection at once, the clusters marked
    ``near_dup_of``."""

    params: LshParams

    command = "dedup"
    settings = (DedupSettings,)
    marks = (BANDS, BANDS_KEY, NEAR_OF)
    reasons = (
        Reason("near duplicate", {NEAR_OF: {"$exists": True}}, "dsgpt2 dedup --near", ("dedup", "near"),
               of=NEAR_OF),
    )  # fmt: skip
    verb = "sign"
    writing = "dedup --near: signing"
    mark = BANDS_KEY
    part_note = MARKED_AFTER_PARTS

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Signing | None:
        s: DedupSettings = settings[DedupSettings]
        if not s.near:
            return None
        return cls(LshParams(threshold=s.threshold, ngram=s.ngram, num_perm=s.num_perm))

    def key(self) -> str:
        return self.params.key

    def start(self, conn: Connection, name: str) -> Signing:
        # The index is built once the bands are written (in ``conclude``), as a bulk load is: the
        # server sorts the keys and writes them in order. Kept while signing, each document's 18 random
        # keys land on pages of their own once the index outgrows the server's cache. Under other
        # settings every document is signed again, so an index of the old bands is dropped first.
        meta = with_retries(lambda: read_meta(conn, [name]), conn.config, "dedup --near: meta")
        last = ((meta.get(name) or {}).get("dedup") or {}).get("near", {}).get("key")
        if last is not None and last != self.key():
            drop_index(conn, name, BANDS_INDEX, f"dedup --near: unindexing {name}")
        return self

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        text = document_text(doc, text_field)
        return {BANDS: _signer(self.params).bands(text or ""), BANDS_KEY: self.key()}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionNear:
        return CollectionNear(name, signed=done)

    def report(self, parts: list[Any]) -> NearReport:
        return NearReport(parts, params=self.params)

    def conclude(self, conn: Connection, names: Sequence[str], report: Any, split: Split) -> None:
        """Bucket, confirm, cluster and mark (see module doc); with ``split.parts`` > 1 only this
        machine's part was signed: one run without parts then marks."""
        if split.parts > 1:
            report.deferred = True
            return
        params = self.params
        for name in names:  # what ``ingest --dedup`` asks of the corpus
            ensure_bands_index(conn, name, f"dedup --near: indexing {name}")
        dups = _cluster(conn, names, params, report)
        marks = {name: {} for name in names}
        for key, root in dups.items():
            marks[names[key // SPAN]][key % SPAN] = label(names, root)
        for part in report.collections:
            part.marked, part.unmarked = write_marks(conn, part.name, marks[part.name])
            part.documents = count_numbered(conn, part.name, NUMBERED, "dedup --near: counting")
            part.duplicates = len(marks[part.name])
            done = {
                "duplicates": part.duplicates,
                "key": params.key,
                "threshold": params.threshold,
                "params": asdict(params),
                "at": time.time(),
            }
            write_meta(conn, part.name, {"dedup.near": done})


@functools.lru_cache(maxsize=4)
def _signer(params: LshParams) -> Signer:
    """The permutations of ``params``, drawn once per process rather than once per batch."""
    return Signer(params)


class ShingleCache:
    """The shingle sets of documents by key, read from the collections in batches, the least recently
    used dropped beyond ``limit``."""

    def __init__(self, conn: Connection, names: Sequence[str], ngram: int, limit: int = _CACHE) -> None:
        self.conn, self.names, self.ngram, self.limit = conn, list(names), ngram, limit
        self.held: OrderedDict[int, np.ndarray] = OrderedDict()
        self.reads = 0

    def load(self, keys: set[int]) -> None:
        """Read the texts of ``keys`` not held (one query per collection and thousand keys)."""
        missing = sorted(k for k in keys if k not in self.held)
        while len(self.held) + len(missing) > self.limit and self.held:
            self.held.popitem(last=False)
        cfg = self.conn.config
        by_rank: dict[int, list[int]] = {}
        for k in missing:
            by_rank.setdefault(k // SPAN, []).append(k % SPAN)
        wanted = {IDX: 1, cfg.text_field: 1, TURNS: 1}
        for rank, idxs in by_rank.items():
            docs = find_in(self.conn, self.names[rank], "idx", idxs, fields=wanted,
                           what="dedup --near: reading candidates", longest=_BULK)  # fmt: skip
            self.reads += len(self.conn.in_lists(idxs, _BULK))
            for doc in docs:
                text = document_text(doc, cfg.text_field) or ""
                self.held[rank * SPAN + doc["idx"]] = shingles(text, self.ngram)
        for k in missing:  # a candidate deleted since it was signed: nobody's duplicate
            self.held.setdefault(k, np.empty(0, dtype=np.uint64))

    def __getitem__(self, key: int) -> np.ndarray:
        self.held.move_to_end(key)
        return self.held[key]


@dataclass
class CollectionNear(CollectionPart):
    signed: int = 0  # by this run
    duplicates: int = 0  # marked near_dup_of, after the run
    marked: int = 0  # by this run
    unmarked: int = 0


@dataclass
class NearReport(Report):
    collections: list[CollectionNear]
    params: LshParams
    buckets: int = 0
    compared: int = 0
    confirmed: int = 0
    clusters: int = 0
    examples: list[tuple[str, str, float]] = field(default_factory=list)  # (copy, kept, Jaccard)

    def lines(self) -> list[str]:
        p = self.params
        out = [f"near duplicates at Jaccard >= {p.threshold} of word {p.ngram}-grams "
               f"({p.num_perm} permutations, {p.bands} bands of {p.rows} rows)"]  # fmt: skip
        if self.deferred:
            return out + [f"{c.name}: {c.signed} signed by this run" for c in self.collections]
        out += [
            duplicates_line(c, c.signed, "signed", "near duplicate(s)", NEAR_OF) for c in self.collections
        ]
        out.append(
            f"{self.buckets} candidate bucket(s), {self.compared} pair(s) compared, {self.confirmed} "
            f"confirmed, {self.clusters} cluster(s) ({self.seconds:.1f}s)"
        )
        out.extend(f"e.g. {copy} repeats {kept} (Jaccard {j:.2f})" for copy, kept, j in self.examples)
        out.append(
            "to train on one of each cluster, add to the config: "
            f'"FILTER": {{"{NEAR_OF}": {{"$exists": false}}}}'
        )
        return out


def _cluster(conn: Connection, names: Sequence[str], params: LshParams, report: NearReport) -> dict[int, int]:
    cache = ShingleCache(conn, names, params.ngram)
    clusters = Clusters(lambda a, b: jaccard(cache[a], cache[b]) >= params.threshold)
    pending: list[list[int]] = []

    def settle() -> None:
        cache.load({k for keys in pending for k in keys})
        for keys in pending:
            clusters.add_bucket(keys)
        pending.clear()

    for keys in shared_elements(conn, names, BANDS, {BANDS_KEY: params.key}, "dedup --near: grouping bands"):
        report.buckets += 1
        pending.append(keys)
        if len(pending) >= _BUCKETS_PER_ROUND:
            settle()
    settle()
    report.compared, report.confirmed = clusters.compared, clusters.confirmed
    dups = clusters.duplicates()
    report.clusters = len(set(dups.values()))
    for key in sorted(dups)[:3]:
        root = dups[key]
        cache.load({key, root})
        j = jaccard(cache[key], cache[root])
        report.examples.append((label(names, key), label(names, root), j))
    return dups


def write_marks(conn: Connection, name: str, marks: dict[int, str]) -> tuple[int, int]:
    """Make ``near_dup_of`` on ``name`` equal ``marks`` (idx → the kept document's label): set what
    differs, unset what is marked and should not be. Returns (marked, unmarked) by this call."""
    marked = unmarked = 0
    items = sorted(marks.items())
    for start in range(0, len(items), _BULK):
        ops = [UpdateOne({"idx": i, NEAR_OF: {"$ne": label}}, {"$set": {NEAR_OF: label}})
               for i, label in items[start : start + _BULK]]  # fmt: skip
        marked += write_ops(conn, name, ops, "dedup --near: marking")
    marked_now = read_windows(conn, name, {NEAR_OF: {"$exists": True}}, {"_id": 0, "idx": 1},
                              f"dedup --near: reading marks of {name}")  # fmt: skip
    held = [d["idx"] for docs in marked_now for d in docs]
    stale = sorted(i for i in held if i not in marks)
    for part in conn.in_lists(stale, _BULK):
        unmarked += write_ops(conn, name, [UpdateMany({"idx": {"$in": part}}, {"$unset": {NEAR_OF: ""}})],
                              "dedup --near: unmarking")  # fmt: skip
    return marked, unmarked


class NearLookup:
    """``ingest --dedup`` on a corpus that ``dedup --near`` has run on: each new document is signed
    under the same settings (so that no later pass signs it again) and asked of the ``lsh`` index of
    every collection (one ``$in`` query per collection and batch); one whose near copy, confirmed on
    the texts, the corpus holds, or an earlier document of the batch, is marked ``near_dup_of`` that
    copy's cluster (the copy's own ``near_dup_of``, else the copy). It is kept, marked: a FILTER
    leaves it out, and the next ``dedup --near`` clusters it with the rest."""

    def __init__(self, conn: Connection, names: Sequence[str], params: LshParams) -> None:
        self.conn, self.names, self.params = conn, list(names), params
        self.signer = Signer(params)

    @classmethod
    def open(cls, conn: Connection, names: Sequence[str]) -> NearLookup | None:
        """The lookup under the settings of the last ``dedup --near`` on ``names``; None if none ran."""
        meta = with_retries(lambda: read_meta(conn, names), conn.config, "ingest --dedup: meta")
        for name in names:
            params = ((meta.get(name) or {}).get("dedup") or {}).get("near", {}).get("params")
            if params:
                return cls(conn, names, LshParams(**params))
        return None

    def mark(self, name: str, docs: list[dict[str, Any]]) -> int:
        """Sign ``docs`` (numbered, about to be inserted into ``name``) in place and mark their near
        copies; returns how many were marked."""
        cfg, p = self.conn.config, self.params
        sets = [shingles(document_text(d, cfg.text_field) or "", p.ngram) for d in docs]
        bands = [
            band_values(signature(s, self.signer.perms), p.bands, p.rows) if len(s) else [] for s in sets
        ]
        wanted = sorted({v for b in bands for v in b})
        held: list[tuple[tuple[int, int], str, set[int], np.ndarray]] = []  # (order, root, bands, shingles)
        for rank, other in enumerate(self.names):
            if not wanted:
                break
            fields = {IDX: 1, BANDS: 1, NEAR_OF: 1, cfg.text_field: 1, TURNS: 1}
            found: dict[Any, dict[str, Any]] = {}  # a document holding bands of two lists comes twice
            for c in find_in(self.conn, other, BANDS, wanted, fields=fields, also={BANDS_KEY: p.key},
                             what=f"ingest --dedup: near copies in {other}"):  # fmt: skip
                found.setdefault(c["_id"], c)
            for c in found.values():
                text = document_text(c, cfg.text_field) or ""
                root = c.get(NEAR_OF) or f"{other}:{c['idx']}"
                held.append(((rank, c["idx"]), root, set(c[BANDS]), shingles(text, p.ngram)))
        marked = 0
        rank = self.names.index(name) if name in self.names else len(self.names)
        for doc, mine, sh in zip(docs, bands, sets, strict=True):
            doc[BANDS], doc[BANDS_KEY] = mine, p.key
            first = min((h for h in held if h[2].intersection(mine) and jaccard(sh, h[3]) >= p.threshold),
                        default=None, key=lambda h: h[0])  # fmt: skip
            if first is not None:
                doc[NEAR_OF] = first[1]
                marked += 1
            held.append(((rank, doc["idx"]), doc.get(NEAR_OF) or f"{name}:{doc['idx']}", set(mine), sh))
        return marked
