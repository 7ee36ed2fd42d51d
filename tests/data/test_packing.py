from __future__ import annotations

import json

import numpy as np
import pytest

from dsgpt2.data.dealing import ChunkOrders, eval_chunks
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
    schedule = ChunkOrders(table, [(0, 1)], seed=3)
    for epoch in range(3):
        parts = [schedule.rank_chunks(0, epoch, r, 4) for r in range(4)]
        joined = np.concatenate(parts)
        assert sorted(joined.tolist()) == list(range(n))
    assert not np.array_equal(schedule.order(0, 0), schedule.order(0, 1))
    assert np.array_equal(schedule.order(0, 1), ChunkOrders(table, [(0, 1)], seed=3).order(0, 1))
    assert sorted(np.concatenate([eval_chunks(table, r, 3) for r in range(3)]).tolist()) == list(range(n))


def test_growth_leaves_every_order_under_way_untouched() -> None:
    from dsgpt2.data.dealing import Position, ReadState, take_in

    table = ChunkTable.initial(["a", "b"], [250, 100], 100)
    assert table.growth([250, 100]) == [] and table.growth([420, 150]) == [(0, 250, 350)]  # whole chunks
    with pytest.raises(ValueError, match="fewer than the 250"):
        table.growth([200, 100])
    schedule = ChunkOrders(table, [(0, 1)], seed=1)
    states = [ReadState([Position(2, 1, 0)]), ReadState([Position(3, 0, 0)])]
    for deal in (False, True):
        grown, dealt = take_in(schedule, states, [(0, 250, 450)], deal=deal)
        after = ChunkOrders(grown, [(0, 1)], seed=1)
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


def test_elastic_resume_of_a_mixture_redeals_each_stream_once() -> None:
    from dsgpt2.data.dealing import Position, ReadState, redeal_states

    table = ChunkTable.initial(["a", "b"], [70, 50], 10)
    schedule = ChunkOrders(table, [(0,), (1,)], seed=4)
    blocks = lambda c: c % 3 + 1  # noqa: E731 - chunk c holds c % 3 + 1 blocks

    def read(positions: list[Position], s: int) -> set[tuple[int, int, int]]:
        out = set()
        for r, p in enumerate(positions):
            for e in range(p.epoch + 1):
                mine = schedule.rank_chunks(s, e, r, len(positions))
                done = len(mine) if e < p.epoch else p.chunk
                out |= {(e, int(c), b) for c in mine[:done] for b in range(blocks(int(c)))}
                if e == p.epoch and p.chunk < len(mine):
                    out |= {(e, int(mine[p.chunk]), b) for b in range(p.block)}
        return out

    states = [
        ReadState([Position(0, 2, 1), Position(1, 0, 0)], [300, 100], 1, 9, {0: 300, 1: 100}),
        ReadState([Position(0, 3, 0), Position(0, 1, 1)], [250, 150], 1, 9, {0: 250, 1: 150}),
    ]
    three = redeal_states(schedule, states, 3)
    for s in (0, 1):
        last = max(st.streams[s].epoch for st in states)
        left = [
            (e, c, b) for st in three for e, c, skip in st.streams[s].queue for b in range(skip, blocks(c))
        ]
        every = {
            (e, int(c), b)
            for e in range(last + 1)
            for c in schedule.order(s, e)
            for b in range(blocks(int(c)))
        }
        done = read([st.streams[s] for st in states], s)
        assert len(left) == len(set(left)) and set(left).isdisjoint(done) and set(left) | done == every
        assert all(st.streams[s].epoch == last + 1 and st.streams[s].chunk == 0 for st in three)
    assert [st.stage for st in three] == [1, 1, 1] and [st.micro for st in three] == [9, 9, 9]
    assert three[0].tokens == {0: 550, 1: 250} and three[1].tokens == three[2].tokens == {}


def test_bos_packing_starts_every_block_at_a_document_and_fits_short_ones_best_first() -> None:
    """``--packing bos`` on a hand-made chunk (context 4; each document's length with its end-of-text):
    a long document fills whole blocks from its first token and its tail opens the next block; short
    ones go longest first into the block with the least room that holds them, else a new block; no
    token is lost, padding fills the rest."""
    from dsgpt2.data.packing import aligned_spans, lay_end_to_end, place_in_blocks, tokens_in_spans

    docs = [[31, 32], [41] * 9, [51], [61, 62, 63, 64], [], [71, 72, 73], []]  # lengths 3, 10, 2, 5, 1, 4, 1
    lengths = np.array([len(d) + 1 for d in docs])
    spans, n = aligned_spans(lengths, 4)
    blocks = place_in_blocks(lay_end_to_end(docs, EOT), lengths, spans, n, 4, fill=PAD)
    assert blocks.tolist() == [
        [41, 41, 41, 41],  # the 10-token document: two whole blocks from its first token,
        [41, 41, 41, 41],
        [41, EOT, 51, EOT],  # its tail, then the 2-token document in the room it leaves (2: exactly)
        [61, 62, 63, 64],  # the 5-token one: a whole block,
        [EOT, 31, 32, EOT],  # its tail, and the 3-token document in the 3 left
        [71, 72, 73, EOT],  # 4 tokens: a whole block of its own
        [EOT, EOT, PAD, PAD],  # the two 1-token documents (an empty text is its end-of-text)
    ]
    # Each document's tokens lie contiguous at its span, every short document within one block.
    assert spans.tolist() == [[17, 20], [0, 10], [10, 12], [12, 17], [24, 25], [20, 24], [25, 26]]
    for (first, end), length in zip(spans.tolist(), lengths.tolist(), strict=True):
        assert end - first == length and (length >= 4 or first // 4 == (end - 1) // 4)
    shares = tokens_in_spans(spans, np.array([0, 1, 0, 1, 0, 0, 1]), 4, n, 2)
    assert shares.tolist() == [[0, 4], [0, 4], [2, 2], [0, 4], [3, 1], [4, 0], [1, 1]]
    assert shares.sum() == lengths.sum()


def test_tokens_in_spans_of_documents_end_to_end_are_tokens_per_block() -> None:
    from dsgpt2.data.packing import tokens_in_spans, tokens_per_block

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=50)
    groups = rng.integers(0, 3, size=50)
    ends = np.cumsum(lengths)
    n = -(-int(ends[-1]) // 16)
    spans = np.stack([ends - lengths, ends], axis=1)
    assert np.array_equal(tokens_in_spans(spans, groups, 16, n, 3), tokens_per_block(lengths, groups, 16, 3))


def test_an_empty_training_split_says_which_documents_were_set_aside() -> None:
    """`--task conversation` on a text corpus: every document set aside (no turns), and the refusal
    blamed only --tr_ratio."""
    from types import SimpleNamespace

    from dsgpt2.data.loader import BlockStream

    stream = object.__new__(BlockStream)
    stream.schedule = SimpleNamespace(table=SimpleNamespace(names=["chats"]), streams=[[0]])
    stream.rank, stream.skipped = 0, {"no_field": 12}
    said = str(stream._empty(0))
    assert said.startswith("rank 0 has no training block of chats in a whole epoch: the split is empty")
    assert said.endswith("; documents skipped: no_field 12 (a conversation task on text documents?)")
    stream.skipped = {}
    assert "skipped" not in str(stream._empty(0))
