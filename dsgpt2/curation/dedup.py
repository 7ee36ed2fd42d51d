"""Exact duplicates, found and marked where the corpus lives.

Every document carries ``text_hash``: a 128-bit BLAKE2b of the text training reads (the config's
``TEXT_FIELD``; a conversation's turns as the ``speaker: text`` lines ingest writes), stored by
``dsgpt2 ingest`` and, for documents without one (a collection numbered in place, one ingested
before hashes), by ``dsgpt2 dedup --exact``, which also indexes it.

``dedup --exact`` groups the hashes with the database's aggregation pipeline (``$group``, over several
collections joined by ``$unionWith``: on a sharded cluster every shard groups its own documents),
keeps the first copy of each text (the earliest collection in ``COLLECTIONS`` order, then the
smallest idx) and marks every other copy with ``dup_of: "collection:idx"``, the copy it repeats.
Nothing is deleted: a query ``{"dup_of": {"$exists": false}}`` selects one copy of every text.

Killed and re-run, a pass ends as a straight one: hashing continues with the documents still
without a hash, and marking is a function of the groups alone (the kept copy of a group is unmarked
if it was marked before, say under another order of ``COLLECTIONS``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsgpt2.curation.neardup import MARKED_AFTER_PARTS, DedupSettings, NearLookup, Signing, duplicates_line
from dsgpt2.curation.passes import NUMBERED
from dsgpt2.curation.steps import STEPS, About, AtIngest, CollectionPart, Reason, Report, Split, Step
from dsgpt2.db.bulk import find_in
from dsgpt2.db.client import Connection, UpdateMany, with_retries
from dsgpt2.db.groups import SPAN, repeated_values
from dsgpt2.db.idx import ensure_index
from dsgpt2.db.meta import read_meta, write_meta
from dsgpt2.db.summaries import count_numbered, first_numbered
from dsgpt2.documents import DUP_OF, HASH, document_hash

log = logging.getLogger(__name__)

HASH_INDEX = "text_hash_1"
# idx values stay below 2**40: a document's place over all collections is rank * 2**40 + idx.
_BULK = 1000


@dataclass
class CollectionDedup(CollectionPart):
    """One collection's part of a ``dedup --exact`` run."""

    hashed: int = 0  # documents given a hash by this run
    duplicates: int = 0  # documents marked as a copy, after the run
    marked: int = 0  # of them, marked by this run
    unmarked: int = 0  # documents no longer marked (kept copies, marked before)


@dataclass
class DedupReport(Report):
    collections: list[CollectionDedup]
    groups: int = 0  # texts held more than once
    examples: list[tuple[str, str]] = field(default_factory=list)  # (copy, kept)

    def lines(self) -> list[str]:
        if self.deferred:
            return [f"{c.name}: {c.hashed} hashed by this run" for c in self.collections]
        out = [duplicates_line(c, c.hashed, "hashed", "exact duplicate(s)", DUP_OF) for c in self.collections]
        out.append(f"{self.groups} text(s) held more than once ({self.seconds:.1f}s)")
        out.extend(f"e.g. {copy} repeats {kept}" for copy, kept in self.examples)
        out.append(
            "to train on one copy of each text, add to the config: "
            f'"FILTER": {{"{DUP_OF}": {{"$exists": false}}}}'
        )
        return out


@STEPS.register("exact")
@dataclass
class Hashing(Step):
    """``dedup --exact``'s first stage: ``text_hash`` stored on every document without one (on every
    document, ``every``, when the hashes were taken of another field than the config's TEXT_FIELD);
    then, over every collection at once, the copies marked ``dup_of``."""

    text_field: str = ""  # the field hashed (the config's TEXT_FIELD), known once started
    every: bool = False

    command = "dedup"
    about = About(
        help="mark duplicate and near-duplicate documents in place (dup_of, near_dup_of)",
        description=(
            "--exact: store text_hash (a hash of the text training reads) on every document without one "
            "and index it, group the hashes with MongoDB's aggregation pipeline over the collections, "
            "and mark every copy of a text but the first (the earliest collection in COLLECTIONS "
            'order, then the smallest idx) with dup_of: "collection:idx".\n\n'
            "--near: store lsh (MinHash LSH band values of the text's word n-grams) on every document "
            "not signed under these settings and index it, group the band values with the aggregation "
            "pipeline, confirm each candidate pair on the texts (Jaccard similarity of their n-gram "
            "sets >= --threshold), cluster the confirmed pairs and mark every document of a cluster "
            'but the first with near_dup_of: "collection:idx".\n\n'
            "Nothing is deleted; select the rest with a FILTER. Killed and re-run, a pass ends as a "
            "straight run. --workers splits hashing and signing by idx ranges across processes; "
            "--part R/M does only this machine's share of them (then one run without --part marks)."
        ),
        epilog=(
            "examples:\n  dsgpt2 dedup --config c.json --exact --near --threshold 0.8\n"
            "  dsgpt2 dedup --config c.json --near --workers 4 --part 1/2   # machine 1 of 2, then:\n"
            "  dsgpt2 dedup --config c.json --near"
        ),
    )
    settings = (DedupSettings,)
    none_asked = "say which duplicates: --exact, --near, or both"
    marks = (HASH, DUP_OF)
    reasons = (
        Reason("exact duplicate", {DUP_OF: {"$exists": True}}, "dsgpt2 dedup --exact", ("dedup", "exact"),
               of=DUP_OF),
    )  # fmt: skip
    verb = "hash"
    writing = "dedup: hashing"
    part_note = MARKED_AFTER_PARTS

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Hashing | None:
        return cls() if settings[DedupSettings].exact else None

    def key(self) -> str:
        """A hash is current while it is of the field it was taken of (meta_info's ``hashes.field``)."""
        return self.text_field

    def todo(self) -> dict[str, Any]:
        todo: dict[str, Any] = {"idx": {"$exists": True}}
        if not self.every:
            todo[HASH] = {"$exists": False}
        return todo

    def start(self, conn: Connection, name: str) -> Hashing:
        cfg = conn.config
        # Indexed before the hashes are written: the writes keep it, no long build at the end.
        ensure_index(conn, name, HASH, f"dedup: indexing {name}")
        meta = with_retries(lambda: read_meta(conn, [name]), cfg, f"dedup: meta of {name}").get(name) or {}
        hashed_field = (meta.get("hashes") or {}).get("field")
        every = hashed_field is not None and hashed_field != cfg.text_field
        if every:
            log.info("%s: hashes were taken of %r, TEXT_FIELD is %r: hashing every document again", name,
                     hashed_field, cfg.text_field)  # fmt: skip
        return Hashing(text_field=cfg.text_field, every=every)

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        return {HASH: document_hash(doc, text_field)}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionDedup:
        if split.parts == 1:  # the field is recorded once every range is hashed under it
            write_meta(conn, name, {"hashes": {"field": self.key(), "at": time.time()}})
        return CollectionDedup(name, hashed=done)

    def report(self, parts: list[Any]) -> DedupReport:
        return DedupReport(parts)

    def conclude(self, conn: Connection, names: Sequence[str], report: Any, split: Split) -> None:
        """Group the hashes and mark every copy but the first (see module doc); with ``split.parts`` >
        1 only this machine's part was hashed: one run without parts then marks."""
        if split.parts > 1:
            report.deferred = True
            return
        marked, unmarked = {n: 0 for n in names}, {n: 0 for n in names}
        writer = _Marker(conn, names, marked, unmarked)
        for h, first, ranks in repeated_values(conn, names, HASH, "dedup: grouping"):
            report.groups += 1
            kept = (first // SPAN, first % SPAN)
            writer.mark(h, kept, ranks)
        writer.flush()
        for part in report.collections:
            part.marked, part.unmarked = marked[part.name], unmarked[part.name]
            part.documents = count_numbered(conn, part.name, NUMBERED, "dedup: counting")
            marks = {DUP_OF: {"$exists": True}}
            part.duplicates = count_numbered(conn, part.name, marks, "dedup: counting")
            write_meta(conn, part.name, {"dedup.exact": {"duplicates": part.duplicates, "at": time.time()}})
            if part.duplicates and len(report.examples) < 3:
                doc = first_numbered(
                    conn, part.name, marks, {"_id": 0, "idx": 1, DUP_OF: 1}, "dedup: example"
                )
                if doc is not None:
                    report.examples.append((f"{part.name}:{doc['idx']}", doc[DUP_OF]))


# dedup's second stage, after the hashes.
STEPS.register("near")(Signing)


class _Marker:
    """Bulk writes that mark a group's copies and unmark its kept document, per collection."""

    def __init__(
        self, conn: Connection, names: Sequence[str], marked: dict[str, int], unmarked: dict[str, int]
    ):
        self.conn, self.names, self.marked, self.unmarked = conn, list(names), marked, unmarked
        self.ops: dict[str, list[tuple[str, dict[str, Any], dict[str, Any]]]] = {n: [] for n in names}

    def mark(self, h: str, kept: tuple[int, int], ranks: Sequence[int]) -> None:
        kept_name, kept_idx = self.names[kept[0]], kept[1]
        label = f"{kept_name}:{kept_idx}"
        for rank in ranks:
            name = self.names[rank]
            copies: dict[str, Any] = {HASH: h, DUP_OF: {"$ne": label}}
            if name == kept_name:
                copies["idx"] = {"$ne": kept_idx}
                self._add(
                    name,
                    "unmark",
                    {HASH: h, "idx": kept_idx, DUP_OF: {"$exists": True}},
                    {"$unset": {DUP_OF: ""}},
                )
            self._add(name, "mark", copies, {"$set": {DUP_OF: label}})

    def _add(self, name: str, kind: str, query: dict[str, Any], update: dict[str, Any]) -> None:
        self.ops[name].append((kind, query, update))
        if len(self.ops[name]) >= _BULK:
            self._write(name)

    def flush(self) -> None:
        for name in self.names:
            self._write(name)

    def _write(self, name: str) -> None:
        ops, self.ops[name] = self.ops[name], []
        if not ops:
            return

        def write() -> None:
            for kind in ("unmark", "mark"):
                batch = [(q, u) for k, q, u in ops if k == kind]
                if not batch:
                    continue
                n = self.conn.bulk_write(name, [UpdateMany(q, u) for q, u in batch])
                (self.marked if kind == "mark" else self.unmarked)[name] += n

        with_retries(write, self.conn.config, f"dedup: marking {name}")


class SeenTexts:
    """``ingest --dedup``: which of a batch's texts the corpus does not hold yet, asked of the
    ``text_hash`` index of each collection (one query per collection and batch)."""

    def __init__(self, conn: Connection, names: Sequence[str]) -> None:
        self.conn, self.names = conn, list(dict.fromkeys(names))
        self.near: NearLookup | None = None  # once `dedup --near` has run on these collections

    @classmethod
    def open(cls, conn: Connection, names: Sequence[str]) -> SeenTexts:
        """Index the hashes of ``names`` that exist; warn of documents there without one."""
        seen = cls(conn, names)
        present = set(with_retries(conn.db.list_collection_names, conn.config, "dedup: collections"))
        seen.names = [n for n in seen.names if n in present or n == seen.names[0]]
        for name in seen.names:
            ensure_index(conn, name, HASH, f"indexing {name}")
            unhashed = first_numbered(conn, name, {HASH: {"$exists": False}}, {"_id": 1}, f"indexing {name}")
            if unhashed is not None:
                log.warning(
                    "%s holds documents without %s (ingested before hashes, or numbered in place): "
                    "`ingest --dedup` does not see their texts until `dsgpt2 dedup --exact` hashes them",
                    name,
                    HASH,
                )
        seen.near = NearLookup.open(conn, seen.names)
        return seen

    def mark_near(self, name: str, docs: list[dict[str, Any]]) -> int:
        """Sign numbered ``docs`` and mark their near copies (see :class:`NearLookup`); 0 when no
        ``dedup --near`` has run."""
        return self.near.mark(name, docs) if self.near is not None else 0

    def fresh(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``docs`` less those whose text a collection holds, or an earlier one of ``docs``."""
        hashes = list({d[HASH] for d in docs if d.get(HASH)})
        held: set[str] = set()
        for name in self.names:
            found = find_in(self.conn, name, HASH, hashes, fields={"_id": 0, HASH: 1},
                            what=f"ingest --dedup: looking up {name}")  # fmt: skip
            held.update(d[HASH] for d in found)
        out = []
        for doc in docs:
            h = doc.get(HASH)
            if h is not None and h in held:
                continue
            if h is not None:
                held.add(h)
            out.append(doc)
        return out


@STEPS.register("held")
@dataclass
class HeldTexts(Step):
    """``ingest --dedup``: a document whose text the corpus holds (the collection ingested into and the
    config's, by ``text_hash``), or an earlier one of the run, is not stored; one whose near copy it
    holds is stored marked ``near_dup_of`` (:class:`SeenTexts`)."""

    seen: SeenTexts | None = None

    at_ingest = AtIngest(
        "dedup",
        "skip a record whose text the corpus already holds (this collection and the config's), "
        "counted as duplicate",
    )
    skip_reason = "duplicate"

    def opened(self, conn: Connection, collection: str) -> HeldTexts:
        return HeldTexts(SeenTexts.open(conn, [collection, *conn.config.collections]))

    def admit(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        assert self.seen is not None, "opened for the ingest first"
        return self.seen.fresh(docs)

    def stored(self, collection: str, docs: list[dict[str, Any]]) -> int:
        assert self.seen is not None, "opened for the ingest first"
        return self.seen.mark_near(collection, docs)
