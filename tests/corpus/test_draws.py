"""Seeded per-document draws (corpus/draws.py) and the mixer under them (hashing.py): deterministic, the
same bits as ever, and independent of how a range is cut; even range splitting (ranges.py)."""

from __future__ import annotations

import numpy as np
import pytest

from dsgpt2.corpus.draws import select, uniform
from dsgpt2.hashing import GOLDEN_GAMMA, splitmix64
from dsgpt2.ranges import even_ranges

MASK64 = 2**64 - 1


def test_splitmix64_gives_the_reference_generator_s_outputs() -> None:
    """SplitMix64 seeded with 0 (Vigna's splitmix64.c) outputs these: its state advanced by the golden
    gamma, finalised."""
    with np.errstate(over="ignore"):
        states = np.arange(1, 4, dtype=np.uint64) * GOLDEN_GAMMA
    assert splitmix64(states).tolist() == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert splitmix64(np.uint64(5)) == 0xB6BF613DBEBB45DC  # a scalar, its products wrapping silently


def test_uniform_draws_the_bits_it_always_drew() -> None:
    """A document's split and sample follow from these bits (records and resumed runs rely on them): the
    formula as first written, here in Python integers."""

    def first(i: int, seed: int, salt: int) -> float:
        z = (i * 0x9E3779B97F4A7C15 + ((seed * 0x100000001B3 + salt) & MASK64)) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return ((z ^ (z >> 31)) >> 11) / 2**53

    idx = [0, 1, 2, 12_345, 10**12, 2**63 + 5]
    assert uniform(np.array(idx, dtype=np.uint64), seed=7, salt="split").tolist() == [
        first(i, 7, 0x5B11) for i in idx
    ]
    assert uniform(np.array(idx[:5]), seed=3).tolist() == [first(i, 3, 0x5A17) for i in idx[:5]]


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


@pytest.mark.parametrize(
    ("start", "stop", "parts"),
    [(0, 10, 3), (0, 100, 7), (0, 5, 10), (0, 0, 4), (0, 1, 1), (5, 7, 4), (40, 1040, 6)],
)
def test_even_ranges_cover_the_range_once_in_parts_within_one_of_each_other(
    start: int, stop: int, parts: int
) -> None:
    ranges = even_ranges(start, stop, parts)
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(start, stop))
    assert len(ranges) == max(1, min(parts, stop - start))  # fewer values than parts: one part each
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_even_ranges_cut_where_they_always_cut() -> None:
    """Shard files and machines' parts are named by these cuts: a resumed download or pass finds its own."""
    assert even_ranges(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert even_ranges(5, 7, 4) == [(5, 6), (6, 7)]
    assert even_ranges(0, 8, 5) == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 8)]
    assert even_ranges(3, 3, 2) == [(3, 3)]  # nothing to cut: one empty part
