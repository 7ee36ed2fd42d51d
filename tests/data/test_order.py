"""The reading order (dsgpt2.data.order): which documents a training chunk holds in an epoch."""

from __future__ import annotations

import time
import tracemalloc
from collections import Counter

import numpy as np
import pytest

from dsgpt2.data.dealing import ChunkOrders
from dsgpt2.data.order import Permutation, ReadOrder
from dsgpt2.data.table import ChunkTable


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_the_permutation_cuts_the_documents_into_disjoint_random_sets(n: int) -> None:
    p = Permutation(n, (1, 2, 3))
    assert n <= p.domain <= max(4, 2 * n - 1)
    values = p.take(0, p.domain)
    assert sorted(values.tolist()) == list(range(n))  # every value once
    cut = p.domain // 3
    parts = [p.take(0, cut), p.take(cut, p.domain)]
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    where = p.position(values)
    assert where.tolist() == sorted(where.tolist()) and (where < p.domain).all()  # the way back
    assert Permutation(n, (1, 2, 3)).take(0, p.domain).tolist() == values.tolist()  # computed, same each time
    if n >= 64:
        other = Permutation(n, (1, 2, 4)).take(0, p.domain)
        assert (other != values).mean() > 0.9  # another key (epoch), another order
        assert abs(np.corrcoef(np.arange(n), values)[0, 1]) < 4 / np.sqrt(n)  # no trace of the stored order
        assert abs(len(parts[0]) - n / 3) < 4 * np.sqrt(n)  # a range's share of the values


def test_the_permutation_deals_what_it_always_dealt() -> None:
    """A run resumed by a later version reads its epoch's remaining documents where it left them: the
    permutation's values pinned as the first version computed them."""
    p = Permutation(1000, (1, 2, 1000))
    assert p.take(0, 12).tolist() == [505, 355, 608, 837, 991, 465, 626, 30, 685, 976, 926]
    assert p.position(np.array([0, 1, 999])).tolist() == [113, 868, 877]


def docs_of(order: ReadOrder, epoch: int, chunk: int) -> set[tuple[int, int]]:
    colls, idxs = order.documents(epoch, chunk)
    return set(zip(colls.tolist(), idxs.tolist(), strict=True))


def _all_documents(order: ReadOrder, epoch: int) -> list[tuple[int, int]]:
    out = []
    for c in range(order.table.n_chunks):
        colls, idxs = order.documents(epoch, c)
        assert len(idxs) <= 1.3 * order.table.chunk_docs
        out += list(zip(colls.tolist(), idxs.tolist(), strict=True))
    return out


def test_each_epoch_reads_every_document_once_in_chunks_spread_over_the_pool() -> None:
    """Two collections in one pooled stream and a generation of growth: per epoch, every document in
    exactly one chunk; a chunk of the first generation mixes both collections from all over them, a
    chunk of growth only the documents that came with it; the inverse finds each document's chunk."""
    table = ChunkTable.initial(["a", "b"], [2500, 730], 100)
    table = table.grow([(0, 2500, 2800)], {0: 2})
    order = ReadOrder(table, [(0, 1)], seed=9, order="spread")
    expected = {(0, i) for i in range(2800)} | {(1, i) for i in range(730)}
    for epoch in (0, 1):
        seen = _all_documents(order, epoch)
        assert len(seen) == len(set(seen)) and set(seen) == expected
    colls, idxs = order.documents(0, 3)
    assert set(colls.tolist()) == {0, 1}
    assert np.ptp(idxs[colls == 0]) > 2000  # spread over collection a, not a run of neighbours
    grown = order.documents(0, table.n_chunks - 1)
    assert set(grown[0].tolist()) == {0} and grown[1].min() >= 2500
    assert not np.array_equal(order.documents(0, 3)[1], order.documents(1, 3)[1])
    for c, i in [(0, 0), (0, 2499), (0, 2650), (1, 729), (1, 5)]:
        for epoch in (0, 4):
            assert (c, i) in set(docs_of(order, epoch, order.chunk_of(epoch, c, i)))


def test_mixture_streams_keep_their_collections_apart_and_ranges_reads_as_before() -> None:
    table = ChunkTable.initial(["a", "b"], [1000, 300], 100)
    split = ReadOrder(table, [(0,), (1,)], seed=1, order="spread")
    for c in range(table.n_chunks):
        colls, _ = split.documents(0, c)
        assert set(colls.tolist()) == {table.locate(c)[0]}
    ranges = ReadOrder(table, [(0, 1)], seed=1, order="ranges")
    for c in range(table.n_chunks):
        coll, lo, hi = table.locate(c)
        colls, idxs = ranges.documents(5, c)
        assert set(colls.tolist()) == {coll} and idxs.tolist() == list(range(lo, hi))
        assert ranges.block_order(5, c, 10) is None and ranges.chunk_of(5, coll, lo) == c
    with pytest.raises(ValueError, match="choose from spread, ranges"):
        ReadOrder(table, [(0, 1)], 1, "random")


def test_the_block_order_is_a_permutation_of_the_seed_epoch_and_chunk() -> None:
    order = ReadOrder(ChunkTable.initial(["a"], [100], 10), [(0,)], seed=3, order="spread")
    a = order.block_order(0, 4, 50)
    assert sorted(a.tolist()) == list(range(50)) and a.tolist() != list(range(50))
    assert order.block_order(0, 4, 50).tolist() == a.tolist()
    assert order.block_order(1, 4, 50).tolist() != a.tolist() and order.block_order(0, 4, 1) is None


def test_a_chunk_costs_the_same_at_a_hundred_million_documents() -> None:
    """No list of the corpus: a chunk of 10^8 documents and a document's chunk in milliseconds, and
    memory for the chunk alone."""
    table = ChunkTable.initial(["a", "b"], [60_000_000, 40_000_000], 1000)
    order = ReadOrder(table, [(0, 1)], seed=1, order="spread")
    order.documents(0, 0)
    tracemalloc.start()
    started = time.perf_counter()
    colls, idxs = order.documents(3, 77_777)
    chunk = order.chunk_of(3, 1, 39_999_999)
    took = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 900 < len(idxs) < 1100 and set(colls.tolist()) == {0, 1} and 0 <= chunk < table.n_chunks
    assert (1, 39_999_999) in docs_of(order, 3, chunk)
    assert took < 0.5 and peak < 1_000_000


def test_a_step_reads_across_the_whole_corpus_like_a_global_permutation() -> None:
    """The shuffle-quality measure of ``make bench shuffle``: a corpus in arrival order read in the
    spread order spreads each step over the index as a global random permutation does; the ranges
    order puts a step in one or two places, and consecutive steps in the same ones."""
    from bench.bench_shuffle import spread_of_steps

    table = ChunkTable.initial(["a"], [20_000], 1000)
    ideal = spread_of_steps("global", table, docs_per_step=16, steps=300)
    spread = spread_of_steps("spread", table, docs_per_step=16, steps=300)
    ranges = spread_of_steps("ranges", table, docs_per_step=16, steps=300)
    assert spread.buckets >= 0.9 * ideal.buckets and ranges.buckets < 0.3 * ideal.buckets
    assert spread.overlap <= 1.2 * ideal.overlap + 0.02 and ranges.overlap > 0.5


def test_ranks_of_a_schedule_read_disjoint_documents_covering_the_epoch() -> None:
    table = ChunkTable.initial(["a", "b"], [900, 450], 100)
    schedule, order = ChunkOrders(table, [(0, 1)], 4), ReadOrder(table, [(0, 1)], 4, "spread")
    per_rank = [
        Counter(d for c in schedule.rank_chunks(0, 2, r, 3) for d in docs_of(order, 2, int(c)))
        for r in range(3)
    ]
    together = sum(per_rank, Counter())
    assert len(together) == 1350 and max(together.values()) == 1
