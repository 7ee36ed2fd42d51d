"""What counts as a usable document text, and the tally of those that are not.

Pure functions: no database here, so the rules are tested directly.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple


class Doc(NamedTuple):
    """A usable document: its unified index over all collections and its text.

    A wrapper reading conversations puts the document's ``turns`` (a list of
    ``{"speaker", "text"}``) in ``text``.
    """

    index: int
    text: Any


# Why a document was skipped, in the order reports list them.
SKIP_REASONS = {
    "missing": "no document with this idx (a gap)",
    "no_field": "the text field is absent",
    "null": "the text field is null",
    "not_string": "the text field is not a string",
    "empty": "the text is empty or only whitespace",
    "too_long": "the text is longer than MAX_TEXT_CHARS",
    "invalid_unicode": "the text holds undecodable bytes or a lone surrogate",
    "bad_json": "an input line is not a JSON object",
    "bad_conversation": "not a list of {speaker, text} turns nor a query/reply pair",
    "unknown_speaker": "a turn's speaker has no <|speaker|> token in the vocabulary",
    "duplicate": "the text is already in the corpus (ingest --dedup)",
    "filtered": "left out by the config's FILTER",
}

_ABSENT = object()


def text_problem(value: Any, max_chars: int) -> str | None:
    """The skip reason for a text field value, or None when it is usable text.

    ``value`` is what the document holds; pass :data:`ABSENT` for a missing field.
    Undecodable UTF-8 arrives as lone surrogates (the client decodes with
    ``surrogateescape``), so one check covers both.
    """
    if value is _ABSENT:
        return "no_field"
    if value is None:
        return "null"
    if not isinstance(value, str):
        return "not_string"
    if len(value) > max_chars:
        return "too_long"
    if not value.strip():
        return "empty"
    if value.isascii() or utf8_encodable(value):  # no copy: ASCII text cannot hold a surrogate
        return None
    return "invalid_unicode"


def turns_problem(value: Any, max_chars: int) -> str | None:
    """The skip reason for a conversation's ``turns`` field, or None when it is usable.

    Usable: a list of at least two ``{"speaker": str, "text": str}`` whose texts pass
    :func:`text_problem`, at most ``max_chars`` characters of text in all.
    """
    if value is _ABSENT:
        return "no_field"
    if value is None:
        return "null"
    if not isinstance(value, list) or len(value) < 2:
        return "bad_conversation"
    total = 0
    for turn in value:
        if not isinstance(turn, dict) or not isinstance(turn.get("speaker"), str):
            return "bad_conversation"
        text = turn.get("text", _ABSENT)
        reason = text_problem(text, max_chars)
        if reason is not None:
            return reason
        total += len(text)
    return "too_long" if total > max_chars else None


def utf8_encodable(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_length(text: str) -> int:
    """The UTF-8 size of ``text`` in bytes, without encoding it when it is ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


ABSENT: Any = _ABSENT


class SkipTally(Counter):
    """How many documents were skipped, by reason."""

    @property
    def total(self) -> int:
        return sum(self.values())

    def summary(self) -> str:
        """``"3 skipped (missing: 1, empty: 2)"`` or ``"none skipped"``."""
        if not self.total:
            return "none skipped"
        order = [r for r in SKIP_REASONS if self[r]] + sorted(r for r in self if r not in SKIP_REASONS)
        parts = ", ".join(f"{r}: {self[r]}" for r in order)
        return f"{self.total} skipped ({parts})"


def turns_text(turns: Sequence[dict[str, Any]]) -> str:
    """A conversation as the text training reads and hashes: one ``speaker: text`` line per turn."""
    return "\n".join(f"{t.get('speaker')}: {t.get('text')}" for t in turns)


def hash_text(text: str) -> str:
    """The hex BLAKE2b-128 of ``text``'s UTF-8 (a lone surrogate, as a collection may hold, kept)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def document_text(doc: dict[str, Any], text_field: str) -> str | None:
    """What training reads of ``doc``: its ``text_field``, else its conversation turns as the
    ``speaker: text`` lines ingest writes; None when it holds neither (training skips it)."""
    value = doc.get(text_field)
    if isinstance(value, str):
        return value
    turns = doc.get("turns")
    if isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
        return turns_text(turns)
    return None


def document_hash(doc: dict[str, Any], text_field: str) -> str | None:
    """The hash of :func:`document_text`; None for a document without text."""
    text = document_text(doc, text_field)
    return None if text is None else hash_text(text)
