from __future__ import annotations

import json

import numpy as np
import pytest

from dsgpt2.data.dealing import Schedule, eval_chunks
from dsgpt2.data.packing import IGNORE, labels_and_mask, pack
from dsgpt2.data.split import split_mask
from dsgpt2.data.table import ChunkTable

EOT, PAD = 0, 1


def test_documents_are_packed_end_to_end_without_truncation() -> None:
    docs = [[10, 11, 12], [20], list(range(100, 109))]  # 4 + 2 + 10 = 16 tokens with EOTs
    blocks, last = pack(docs, context=5, eot=EOT, pad=PAD)
    assert blocks.shape == (4, 5) and last == 1
    flat = blocks.reshape(-1)[:16]
    assert flat.tolist() == [10, 11, 12, EOT, 20, EOT, *range(100, 109), EOT]
    assert blocks[-1].tolist() == [EOT, PAD, PAD, PAD, PAD]


def test_exact_fit_and_empty() -> None:
    blocks, last = pack([[5, 6, 7]], context=4, eot=EOT, pad=PAD)
    assert blocks.tolist() == [[5, 6, 7, EOT]] and last == 4
    blocks, last = pack([], context=4, eot=EOT, pad=PAD)
    assert blocks.shape == (0, 4) and last == 0
    with pytest.raises(ValueError):
        pack([[1]], context=0, eot=EOT, pad=PAD)


def test_labels_and_mask_hide_padding() -> None:
    blocks = np.array([[5, 6, 7], [8, PAD, PAD]])
    labels, mask = labels_and_mask(blocks, np.array([3, 1]))
    assert labels.tolist() == [[5, 6, 7], [8, IGNORE, IGNORE]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_split_is_deterministic_and_disjoint() -> None:
    idx = np.arange(100_000)
    train = split_mask(idx, 0.9, seed=1)
    assert np.array_equal(train, split_mask(idx, 0.9, seed=1))
    assert 0.89 < train.mean() < 0.91
    # Deciding a slice gives the same answer as deciding the whole.
    assert np.array_equal(split_mask(idx[500:900], 0.9, seed=1), train[500:900])
    assert split_mask(idx, 1.0, seed=1).all()
    # Each collection draws its own split, from its documents' own idx.
    assert np.array_equal(split_mask(idx, 0.9, 1, "news"), split_mask(idx, 0.9, 1, "news"))
    assert not np.array_equal(split_mask(idx, 0.9, 1, "news"), split_mask(idx, 0.9, 1, "wiki"))


def test_ranks_read_disjoint_chunks_covering_everything() -> None:
    table = ChunkTable.initial(["a", "b"], [10_001, 2_500], 1000)
    n = table.n_chunks
    assert n == 11 + 3 and table.locate(10) == (0, 10_000, 10_001) and table.locate(11) == (1, 0, 1000)
    schedule = Schedule(table, [(0, 1)], seed=3)
    for epoch in range(3):
        parts = [schedule.rank_chunks(0, epoch, r, 4) for r in range(4)]
        joined = np.concatenate(parts)
        assert sorted(joined.tolist()) == list(range(n))
    assert not np.array_equal(schedule.order(0, 0), schedule.order(0, 1))
    assert np.array_equal(schedule.order(0, 1), Schedule(table, [(0, 1)], seed=3).order(0, 1))
    assert sorted(np.concatenate([eval_chunks(table, r, 3) for r in range(3)]).tolist()) == list(range(n))


def test_growth_leaves_every_order_under_way_untouched() -> None:
    from dsgpt2.data.dealing import Position, ReadState, take_in

    table = ChunkTable.initial(["a", "b"], [250, 100], 100)
    assert table.growth([250, 100]) == [] and table.growth([420, 150]) == [(0, 250, 350)]  # whole chunks
    with pytest.raises(ValueError, match="fewer than the 250"):
        table.growth([200, 100])
    schedule = Schedule(table, [(0, 1)], seed=1)
    states = [ReadState([Position(2, 1, 0)]), ReadState([Position(3, 0, 0)])]
    for deal in (False, True):
        grown, dealt = take_in(schedule, states, [(0, 250, 450)], deal=deal)
        after = Schedule(grown, [(0, 1)], seed=1)
        assert grown.n_chunks == 6 and grown.locate(5) == (0, 350, 450) and grown.marks == (450, 100)
        for epoch in range(4):  # every epoch a rank has begun keeps its order
            assert np.array_equal(after.order(0, epoch), schedule.order(0, epoch))
        assert sorted(after.order(0, 4).tolist()) == list(range(6))  # the next one holds the new chunks
        assert np.array_equal(after.order(0, 4)[:4], schedule.order(0, 4))  # after the old ones
        if deal:  # dealt now as well, tagged with each rank's current epoch
            assert dealt == [
                {0: [(2, int(after.dealt(0, 1)[0]), 0)]},
                {0: [(3, int(after.dealt(0, 1)[1]), 0)]},
            ]
        else:
            assert dealt == [{}, {}]
    assert ChunkTable.from_dict(json.loads(json.dumps(grown.to_dict()))) == grown
