"""Reads over the idx index that stay bounded at any corpus size: the edges of the index
(:func:`idx_edge`) and the batches a curation pass walks (:func:`each_batch`)."""

from __future__ import annotations

from typing import Any

import pytest
from pymongo.collection import Collection

from conftest import make_config
from dsgpt2.curation.passes import each_batch, idx_bounds
from dsgpt2.db.client import Connection
from dsgpt2.db.idx import EDGE_WINDOW, idx_edge, max_idx


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


def test_each_batch_walks_bounded_windows_in_idx_order(asked: list[dict[str, Any]]) -> None:
    conn, _ = _collection([*range(0, 2500), *range(2600, 3100)], extra=5)
    batches = list(each_batch(conn, "a", {"even": True}, {"even": 1}, 100, desc="test"))
    seen = [d["idx"] for b in batches for d in b]
    assert seen == [i for i in [*range(0, 2500), *range(2600, 3100)] if i % 2 == 0]
    assert all(len(b) <= 100 for b in batches)
    walked = [f for f in asked if "even" in f]
    assert all(f["idx"]["$lt"] - f["idx"]["$gte"] <= 100 for f in walked)
    spanned = [d["idx"] for b in each_batch(conn, "a", {}, {}, 64, desc="test", span=(90, 2610)) for d in b]
    assert spanned == [*range(90, 2500), *range(2600, 2610)]


def test_each_batch_takes_in_documents_added_while_it_walks() -> None:
    conn, coll = _collection(list(range(250)))
    seen = []
    for batch in each_batch(conn, "a", {}, {}, 100, desc="test"):
        seen += [d["idx"] for d in batch]
        if len(seen) == 200:
            coll.insert_many([{"idx": i} for i in range(250, 420)])
    assert seen == list(range(420))


def test_idx_bounds_are_the_ends_of_the_numbered_documents() -> None:
    conn, _ = _collection(list(range(5, 3000)), extra=10)
    assert idx_bounds(conn, "a") == (5, 2999)
    conn.db["b"].insert_one({"text": "unnumbered"})
    assert idx_bounds(conn, "b") is None
