"""Conversation formatting and reply-only labels, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from dsgpt2.data.conversation import encode_conversations, format_conversation, prompt_ids
from dsgpt2.data.packing import IGNORE, labels_and_mask, pack_with_loss

SPEAKERS = {"user": 2, "bot": 3}
EOT, PAD = 0, 1


def test_format_marks_reply_tokens_and_their_terminators() -> None:
    turns = [
        {"speaker": "user", "text": "q1"},
        {"speaker": "bot", "text": "a1"},
        {"speaker": "user", "text": "q2"},
        {"speaker": "bot", "text": "a2"},
    ]
    text_ids = [[10, 11], [20, 21, 22], [12], [23]]
    ids, loss = format_conversation(turns, text_ids, SPEAKERS, {"bot"})
    assert ids == [2, 10, 11, 3, 20, 21, 22, 2, 12, 3, 23]
    # user turn: context; bot text: learned; the token after a bot turn (next speaker / EOT): learned.
    assert loss == [
        False, False, False,  # <|user|> q1
        False, True, True, True,  # <|bot|> a1
        True, False,  # <|user|> closes a1, q2
        False, True,  # <|bot|> a2
        True,  # the end-of-text packing appends closes a2
    ]  # fmt: skip


def test_unknown_speaker_is_reported_not_guessed() -> None:
    turns = [{"speaker": "alice", "text": "hi"}, {"speaker": "bot", "text": "hello"}]
    assert format_conversation(turns, [[1], [2]], SPEAKERS, {"bot"}) is None
    ids, loss, unknown = encode_conversations(
        [turns, [{"speaker": "user", "text": "a"}, {"speaker": "bot", "text": "b"}]],
        lambda texts: [[100 + len(t)] for t in texts],
        SPEAKERS,
        {"bot"},
    )
    assert unknown == 1 and len(ids) == 1 and len(loss[0]) == len(ids[0]) + 1


def test_prompt_ends_with_the_reply_speaker() -> None:
    turns = [{"speaker": "user", "text": "q"}]
    assert prompt_ids(turns, [[10, 11]], SPEAKERS, "bot") == [2, 10, 11, 3]
    with pytest.raises(KeyError):
        prompt_ids([{"speaker": "carol", "text": "q"}], [[1]], SPEAKERS, "bot")


def test_packed_labels_cover_exactly_the_reply_tokens() -> None:
    conv = [{"speaker": "user", "text": "q"}, {"speaker": "bot", "text": "a"}]
    docs, flags = [], []
    for n in (3, 9, 1):  # reply lengths; the second conversation crosses a block boundary
        ids, loss = format_conversation(conv, [[10, 11], [20] * n], SPEAKERS, {"bot"})
        docs.append(ids)
        flags.append(loss)
    blocks, loss_mask, last = pack_with_loss(docs, flags, 8, EOT, PAD)
    valid = np.full(len(blocks), 8)
    valid[-1] = last
    labels, _ = labels_and_mask(blocks, valid, loss_mask)
    flat_ids, flat_labels = blocks.reshape(-1), labels.reshape(-1)
    speaker = None
    for t, (tok, lab) in enumerate(zip(flat_ids, flat_labels, strict=True)):
        if t >= (len(blocks) - 1) * 8 + last:
            assert lab == IGNORE and tok == PAD  # padding
            continue
        if tok in (2, 3, EOT):
            expected = speaker == "bot"  # a speaker token or end-of-text closes the previous turn
            speaker = {2: "user", 3: "bot", EOT: None}[int(tok)]
        else:
            expected = speaker == "bot"
        assert (lab != IGNORE) == expected, (t, tok, lab)
        if expected:
            assert lab == tok
    assert int((labels != IGNORE).sum()) == sum(n + 1 for n in (3, 9, 1))


def test_loss_flags_must_match_the_ids() -> None:
    with pytest.raises(ValueError, match="loss flags"):
        pack_with_loss([[5, 6]], [[True, True]], 8, EOT, PAD)
