"""Reads over the idx index that stay bounded at any corpus size: the edges of the index
(:func:`idx_edge`) and the batches a curation pass walks (:func:`numbered_batches`); the one driver every
pass runs under (:func:`run_pass`), shown on a pass made for the test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from pymongo.collection import Collection

from conftest import make_config
from dsgpt2.curation import passes
from dsgpt2.curation.passes import run_pass
from dsgpt2.curation.steps import Split, Step
from dsgpt2.db.client import Connection
from dsgpt2.db.idx import EDGE_WINDOW, idx_bounds, idx_edge, max_idx, numbered_batches
from dsgpt2.errors import CorpusError


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The filter of every find (find_one included) from here on."""
    filters: list[dict[str, Any]] = []
    find = Collection.find

    def recording(self: Collection, filter: Any = None, *args: Any, **kwargs: Any) -> Any:
        filters.append(dict(filter or {}))
        return find(self, filter, *args, **kwargs)

    monkeypatch.setattr(Collection, "find", recording)
    return filters


def _collection(idxs: list[Any], extra: int = 0) -> tuple[Connection, Any]:
    conn = Connection(make_config(["a"]))
    coll = conn.db["a"]
    coll.create_index("idx", unique=True, sparse=True)
    docs = [{"idx": i, "even": isinstance(i, int) and i % 2 == 0} for i in idxs]
    coll.insert_many(docs + [{"text": "unnumbered"} for _ in range(extra)])
    return conn, coll


@pytest.mark.parametrize("guess", [None, -50, 0, 3, 700, 4999, 6000, 10**7])
def test_idx_edge_finds_both_ends_from_any_guess(guess: int | None) -> None:
    idxs = [-7, *range(0, 300), *range(2000, 2100), 4100.5, 5003]
    _, coll = _collection(idxs, extra=40)
    evens = [i for i in idxs if isinstance(i, int) and i % 2 == 0]
    assert idx_edge(coll, -1, guess=guess) == 5003
    assert idx_edge(coll, 1, guess=guess) == -7
    assert idx_edge(coll, -1, {"even": True}, guess=guess) == max(evens)
    assert idx_edge(coll, 1, {"even": True, "idx": {"$exists": True}}, guess=guess) == min(evens)
    assert idx_edge(coll, -1, {"even": "never"}, guess=guess) is None
    assert idx_edge(coll, 1, {"even": "never"}, guess=guess) is None


def test_idx_edge_of_an_empty_collection_is_none() -> None:
    _, coll = _collection([], extra=3)
    assert idx_edge(coll, -1) is None and idx_edge(coll, 1) is None and max_idx(coll) is None


def test_an_edge_reads_the_documents_near_the_guess_not_the_collection(asked: list[dict[str, Any]]) -> None:
    """The index's ends at 6,000 documents: each read's idx range holds at most two windows of
    documents (an open read with a sort and a limit holds them all, and some servers read them all)."""
    _, coll = _collection(list(range(6000)))
    assert max_idx(coll) == 5999 and idx_edge(coll, 1) == 0
    assert max_idx(coll, guess=5000) == 5999 and max_idx(coll, guess=7000) == 5999
    assert asked
    for filter in asked:
        assert coll.count_documents({"idx": filter["idx"]}) <= 2 * EDGE_WINDOW, filter


def test_numbered_batches_walks_bounded_windows_in_idx_order(asked: list[dict[str, Any]]) -> None:
    conn, _ = _collection([*range(0, 2500), *range(2600, 3100)], extra=5)
    batches = list(numbered_batches(conn, "a", {"even": True}, {"even": 1}, 100, what="test"))
    seen = [d["idx"] for b in batches for d in b]
    assert seen == [i for i in [*range(0, 2500), *range(2600, 3100)] if i % 2 == 0]
    assert all(len(b) <= 100 for b in batches)
    walked = [f for f in asked if "even" in f]
    assert all(f["idx"]["$lt"] - f["idx"]["$gte"] <= 100 for f in walked)
    spanned = [
        d["idx"] for b in numbered_batches(conn, "a", {}, {}, 64, what="test", span=(90, 2610)) for d in b
    ]
    assert spanned == [*range(90, 2500), *range(2600, 2610)]


def test_numbered_batches_takes_in_documents_added_while_it_walks() -> None:
    conn, coll = _collection(list(range(250)))
    seen = []
    for batch in numbered_batches(conn, "a", {}, {}, 100, what="test"):
        seen += [d["idx"] for d in batch]
        if len(seen) == 200:
            coll.insert_many([{"idx": i} for i in range(250, 420)])
    assert seen == list(range(420))


def test_idx_bounds_are_the_ends_of_the_numbered_documents() -> None:
    conn, _ = _collection(list(range(5, 3000)), extra=10)
    assert idx_bounds(conn, "a") == (5, 2999)
    conn.db["b"].insert_one({"text": "unnumbered"})
    assert idx_bounds(conn, "b") is None


# ---------------------------------------------------------------- one pass kind, one driver


@dataclass
class _Report:
    parts: list[tuple[str, int]]
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return [f"{name}: {done} measured" for name, done in self.parts]


@dataclass
class Lengths(Step):
    """A new step is one class: each document's text length, under a version key."""

    version: int = 1

    command = "lengths"
    verb = "measure"
    writing = "lengths"
    mark = "len_key"

    def key(self) -> int:
        return self.version

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        return {"len": len(doc.get(text_field) or ""), "len_key": self.version}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> tuple[str, int]:
        return name, done

    def report(self, parts: list[Any]) -> _Report:
        return _Report(parts)


def _two_collections(label: str) -> Connection:
    conn = Connection(make_config(["a", "b"], MONGO_CONNECTION_DB=f"lengths_{label}"))
    for name, n in (("a", 130), ("b", 45)):
        conn.db[name].drop()
        conn.db[name].insert_many([{"idx": i, "filt_text": "x" * (i % 17)} for i in range(n)])
    return conn


def _lengths(conn: Connection) -> dict[tuple[str, int], tuple[int, int]]:
    return {(n, d["idx"]): (d["len"], d["len_key"]) for n in ("a", "b") for d in conn.db[n].find()}


def test_the_driver_runs_a_new_pass_resumes_it_and_splits_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What run_pass does for every pass: idx windows, the report, a key that selects what is left,
    a killed run that ends as a straight one, and machine parts that together cover every document."""
    straight = _two_collections("straight")
    report = run_pass(straight, ["a", "b"], Lengths(), batch_size=20)
    expected = {(n, i): (i % 17, 1) for n, c in (("a", 130), ("b", 45)) for i in range(c)}
    assert _lengths(straight) == expected and report.parts == [("a", 130), ("b", 45)]
    assert report.lines() == ["a: 130 measured", "b: 45 measured"] and report.seconds > 0
    assert run_pass(straight, ["a", "b"], Lengths(), batch_size=20).parts == [("a", 0), ("b", 0)]
    straight.db["b"].insert_one({"idx": 45, "filt_text": "new"})  # ingested since: the next run's
    assert run_pass(straight, ["a", "b"], Lengths(), batch_size=20).parts == [("a", 0), ("b", 1)]
    assert run_pass(straight, ["a"], Lengths(version=2), batch_size=20).parts == [("a", 130)]

    killed, calls = _two_collections("killed"), {"n": 0}
    original = passes.write_ops

    def crash(*args: Any, **kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        original(*args, **kwargs)

    monkeypatch.setattr(passes, "write_ops", crash)
    with pytest.raises(RuntimeError, match="killed"):
        run_pass(killed, ["a", "b"], Lengths(), batch_size=20)
    monkeypatch.undo()
    assert run_pass(killed, ["a", "b"], Lengths(), batch_size=20).parts == [("a", 130 - 40), ("b", 45)]
    assert _lengths(killed) == expected

    parted = _two_collections("parted")
    done = [run_pass(parted, ["a", "b"], Lengths(), split=Split(part=p, parts=2)).parts for p in (0, 1)]
    assert done == [[("a", 65), ("b", 22)], [("a", 65), ("b", 23)]] and _lengths(parted) == expected


def test_a_pass_over_a_missing_collection_is_refused_before_any_work() -> None:
    conn = _two_collections("missing")
    with pytest.raises(CorpusError, match=r"collection 'c' does not exist in database"):
        run_pass(conn, ["a", "c"], Lengths())
    assert conn.db["a"].count_documents({"len": {"$exists": True}}) == 0
