"""Conversations as token sequences: speaker tokens, and which tokens the loss covers.

A conversation ``[{speaker, text}, ...]`` becomes, turn after turn,
``<|speaker|>`` followed by the turn's text tokens; packing then appends the
end-of-text token. The loss covers the replies only: the text tokens of each
turn by a reply speaker and the token that ends it (the next speaker token,
or end-of-text after the last turn), so that the model learns both what to
answer and when to stop. Everything else is context. Pure functions: no
database, no model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Encode = Callable[[list[str]], list[list[int]]]


def speaker_ids(tokenizer: Any) -> dict[str, int]:
    """Speaker name → id of its ``<|name|>`` token, for every speaker token of the tokenizer."""
    from dsgpt2.tokenizer.bpe import EOT, PAD

    out = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token.startswith("<|") and token.endswith("|>") and token not in (EOT, PAD):
            out[token[2:-2]] = token_id
    return out


def format_conversation(
    turns: Sequence[Mapping[str, str]],
    text_ids: Sequence[Sequence[int]],
    speakers: Mapping[str, int],
    reply_speakers: frozenset[str] | set[str],
) -> tuple[list[int], list[bool]] | None:
    """Token ids of a conversation and, per id plus the end-of-text packing appends, whether
    the loss covers it.

    Args:
        turns: the conversation's turns.
        text_ids: the token ids of each turn's text.
        speakers: speaker name → speaker token id.
        reply_speakers: the speakers whose turns are learned.

    Returns:
        ``(ids, loss)`` with ``len(loss) == len(ids) + 1``, or None when a speaker has no token.
    """
    ids: list[int] = []
    loss: list[bool] = []
    ends_reply = False  # whether the next token closes a reply
    for turn, tokens in zip(turns, text_ids, strict=True):
        speaker = speakers.get(turn["speaker"])
        if speaker is None:
            return None
        ids.append(speaker)
        loss.append(ends_reply)
        reply = turn["speaker"] in reply_speakers
        ids.extend(tokens)
        loss.extend([reply] * len(tokens))
        ends_reply = reply
    loss.append(ends_reply)  # the end-of-text after the last turn
    return ids, loss


def encode_conversations(
    conversations: Sequence[Sequence[Mapping[str, str]]],
    encode: Encode,
    speakers: Mapping[str, int],
    reply_speakers: frozenset[str] | set[str],
) -> tuple[list[list[int]], list[list[bool]], int]:
    """Format a batch of conversations (one tokenizer call for all their turns).

    Returns:
        ``(ids, loss, unknown)``: per usable conversation its ids and loss flags, and how
        many were left out because a speaker has no token.
    """
    texts = [t["text"] for conv in conversations for t in conv]
    encoded = encode(texts) if texts else []
    ids, loss, unknown, at = [], [], 0, 0
    for conv in conversations:
        formatted = format_conversation(conv, encoded[at : at + len(conv)], speakers, reply_speakers)
        at += len(conv)
        if formatted is None:
            unknown += 1
            continue
        ids.append(formatted[0])
        loss.append(formatted[1])
    return ids, loss, unknown


def prompt_ids(
    turns: Sequence[Mapping[str, str]],
    text_ids: Sequence[Sequence[int]],
    speakers: Mapping[str, int],
    next_speaker: str,
) -> list[int]:
    """The ids that ask the model for ``next_speaker``'s turn after ``turns``."""
    formatted = format_conversation(turns, text_ids, speakers, frozenset())
    if formatted is None:
        unknown = sorted({t["speaker"] for t in turns} - set(speakers))
        raise KeyError(f"no speaker token for {unknown}")
    return [*formatted[0], speakers[next_speaker]]
