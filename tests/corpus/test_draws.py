"""Seeded per-document draws and shard ranges (corpus/draws.py): deterministic, and independent of how a
range is cut."""

from __future__ import annotations

import numpy as np
import pytest

from dsgpt2.corpus.draws import select, shard_ranges, uniform


def test_uniform_is_deterministic_and_in_range() -> None:
    idx = np.arange(0, 200_000)
    u = uniform(idx, seed=3)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.array_equal(u, uniform(idx, seed=3))
    assert not np.array_equal(u, uniform(idx, seed=4))
    assert not np.array_equal(u, uniform(idx, seed=3, salt="split"))
    # Roughly uniform: each decile holds about a tenth.
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 20_000) < 1_000)
    # Huge indices (a 100M-document corpus and beyond) work the same way.
    assert 0 <= uniform(np.array([10**12]), seed=1)[0] < 1


def test_select_does_not_depend_on_how_the_range_is_cut() -> None:
    whole = select(0, 10_000, 0.3, seed=7)
    parts = np.concatenate([select(lo, lo + 999, 0.3, seed=7) for lo in range(0, 10_000, 999)])
    assert np.array_equal(whole, parts[parts < 10_000])
    assert 2_700 < len(whole) < 3_300
    assert np.array_equal(select(5, 9, 1.0, seed=0), np.arange(5, 9))


@pytest.mark.parametrize(("total", "shards"), [(10, 3), (100, 7), (5, 10), (0, 4), (1, 1)])
def test_shard_ranges_cover_everything_once(total: int, shards: int) -> None:
    ranges = shard_ranges(total, shards)
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(total))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1
