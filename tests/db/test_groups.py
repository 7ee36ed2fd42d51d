"""Values shared by several documents across collections: grouped from idx windows on the embedded
engine, by one aggregation elsewhere; the same groups either way."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import make_config, seed
from dsgpt2.db import groups, summaries
from dsgpt2.db.client import Connection
from dsgpt2.db.groups import SPAN, repeated_values, shared_elements


@pytest.fixture
def conn(monkeypatch: pytest.MonkeyPatch) -> Connection:
    """``a`` (idx 0..19) and ``b`` (idx 0..9): hash ``h{i % 7}`` in ``a``, ``h{i % 4}`` in ``b``, one
    unhashed; bands ``[i % 5, 100 + i]`` under key ``k``, one document under another key."""
    conn = Connection(make_config(["a", "b"]))
    seed(conn, "a", [f"a{i}" for i in range(20)])
    seed(conn, "b", [f"b{i}" for i in range(10)])
    for name, n, mod in (("a", 20, 7), ("b", 10, 4)):
        for i in range(n):
            conn.db[name].update_one(
                {"idx": i}, {"$set": {"h": f"h{i % mod}", "bands": [i % 5, 100 + i], "bk": "k"}}
            )
    conn.db["a"].update_one({"idx": 3}, {"$unset": {"h": ""}})
    conn.db["b"].update_one({"idx": 9}, {"$set": {"bk": "other"}})
    conn.db["b"].insert_one({"h": "h0", "bands": [0], "bk": "k"})  # not numbered: never grouped
    monkeypatch.setattr(summaries, "WINDOW", 3)  # many windows per collection
    return conn


def _values(
    names: list[str], mods: dict[str, tuple[int, int]], unset: set[tuple[int, int]]
) -> dict[str, Any]:
    """Each hash's (first key, ranks, copies) computed from the fixture's rule."""
    held: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        n, mod = mods[name]
        for i in range(n):
            if (rank, i) not in unset:
                held.setdefault(f"h{i % mod}", []).append(rank * SPAN + i)
    return {h: (min(keys), sorted({k // SPAN for k in keys})) for h, keys in held.items() if len(keys) > 1}


def test_repeated_values_from_windows_equal_the_aggregation_and_the_rule(conn: Connection) -> None:
    assert conn.counts_walk  # the embedded engine: windows
    got = repeated_values(conn, ["a", "b"], "h", "test")
    expected = _values(["a", "b"], {"a": (20, 7), "b": (10, 4)}, {(0, 3)})
    assert {h: (first, ranks) for h, first, ranks in got} == expected
    assert sorted(got) == sorted(groups.value_groups(conn.db, ["a", "b"], "h"))
    # The other order of collections names the same texts by other keys.
    flipped = {h: (first, ranks) for h, first, ranks in repeated_values(conn, ["b", "a"], "h", "test")}
    assert flipped == _values(["b", "a"], {"a": (20, 7), "b": (10, 4)}, {(1, 3)})


def test_shared_elements_from_windows_equal_the_aggregation(conn: Connection) -> None:
    got = shared_elements(conn, ["a", "b"], "bands", {"bk": "k"}, "test")
    assert sorted(got) == sorted(groups.element_groups(conn.db, ["a", "b"], "bands", {"bk": "k"}))
    # band i % 5 is shared; 100 + i is shared by a:i and b:i (i < 9: b:9 is under another key)
    expected = [
        [i for i in range(20) if i % 5 == v] + [SPAN + i for i in range(9) if i % 5 == v] for v in range(5)
    ]
    expected += [[i, SPAN + i] for i in range(9)]
    assert sorted(got) == sorted(expected)
    assert shared_elements(conn, ["a"], "bands", {"bk": "none"}, "test") == []


def test_the_server_shape_is_one_aggregation(conn: Connection, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where counts do not walk (mongod), the grouping is the aggregation's, not a window read."""
    monkeypatch.setattr(Connection, "counts_walk", property(lambda self: False))
    monkeypatch.setattr(summaries, "read_windows", None)  # never asked
    monkeypatch.setattr(groups, "read_windows", None)
    expected = _values(["a", "b"], {"a": (20, 7), "b": (10, 4)}, {(0, 3)})
    got = repeated_values(conn, ["a", "b"], "h", "test")
    assert {h: (first, ranks) for h, first, ranks in got} == expected
    assert len(shared_elements(conn, ["a", "b"], "bands", {"bk": "k"}, "test")) == 14
