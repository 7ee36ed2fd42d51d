"""The document: the names of its fields, what counts as a usable text, and the tally of those that are
not.

Every field dsgpt2 writes on a document is named here once and imported from here: those ingest writes
(:data:`INGEST_FIELDS`) and those the curation steps mark (:func:`mark`, one declaration a field). A
``FILTER`` may name any of them before a document holds it (:func:`known_fields`); a step registered from
outside declares its own through the step registry.

Pure functions: no database here, so the rules are tested directly.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

# ---------------------------------------------------------------- the fields ingest writes
ID = "_id"
IDX = "idx"  # the document's number in its collection: 0, 1, 2... with no gap (dsgpt2.db.numbering)
FORM = "form"  # the text as read
TEXT = "filt_text"  # the text cleaned (dsgpt2.corpus.cleaning): what training reads unless TEXT_FIELD says
SOURCE = "source"  # the input it came from
SOURCE_POS = "source_pos"  # its position in that input
TURNS = "turns"  # a conversation's [{speaker, text}], whose text is also in TEXT as `speaker: text` lines
# What every document may hold already: a kept column or field may not take one of these names.
INGEST_FIELDS = (ID, IDX, FORM, TEXT, SOURCE, SOURCE_POS, TURNS)

# ---------------------------------------------------------------- the fields the curation steps mark
_MARKS: dict[str, str] = {}


def mark(field: str, by: str) -> str:
    """Declare ``field`` a mark the step ``by`` writes on documents; returns ``field``.

    Raises:
        ValueError: ``field`` is one of ingest's, or another step's mark.
    """
    held = _MARKS.get(field, by)
    if field in INGEST_FIELDS or held != by:
        raise ValueError(f"{field!r} is a field of {'ingest' if field in INGEST_FIELDS else held}'s already")
    _MARKS[field] = by
    return field


HASH = mark("text_hash", "dedup")  # the hash of the text training reads (ingest writes it too)
DUP_OF = mark("dup_of", "dedup")  # "collection:idx" of the copy an exact duplicate repeats
BANDS = mark("lsh", "dedup --near")  # a document's LSH band keys
BANDS_KEY = mark("lsh_key", "dedup --near")  # the signing settings its bands were taken under
NEAR_OF = mark("near_dup_of", "dedup --near")  # "collection:idx" of the document a near duplicate repeats
QUALITY = mark("quality", "curate")  # the quality signals
PASSES = mark("passes", "curate")  # {rule set: verdict}
LANGUAGE = mark("lang", "langid")  # the ISO 639 code of the document's language
LANGUAGE_SCORE = mark("lang_score", "langid")
LANGUAGE_KEY = mark("lang_key", "langid")
CONTAMINATED = mark("contaminated", "decontaminate")  # {set: n-gram}, on a document sharing one
CHECKED = mark("decont", "decontaminate")  # {set: run key}: the sets it was checked against
PII = mark("pii", "redact")  # the redaction's version and counts by kind
_BUILT_IN = frozenset(_MARKS)


def declare_marks(by: str, fields: Sequence[str]) -> None:
    """Declare the fields of ``fields`` that no one has declared as marks of the step ``by`` (what a step
    registered from outside the package writes; the built-in marks are declared above): a field known
    already stays its declarer's."""
    known = known_fields()
    for field in fields:
        if field not in known:
            mark(field, by)


def forget_marks(by: str) -> None:
    """Take out the marks :func:`declare_marks` declared for the step ``by`` (taken out of its registry)."""
    for field in [f for f, step in _MARKS.items() if step == by and f not in _BUILT_IN]:
        del _MARKS[field]


def marks() -> dict[str, str]:
    """Every declared mark, with the step that writes it."""
    return dict(_MARKS)


def known_fields() -> tuple[str, ...]:
    """Every field dsgpt2 writes on a document: ingest's, then the marks."""
    return (*INGEST_FIELDS, *_MARKS)


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
    "bad_json": "an input line is not valid JSON, or not a JSON object",
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
    turns = doc.get(TURNS)
    if isinstance(turns, list) and all(isinstance(t, dict) for t in turns):
        return turns_text(turns)
    return None


def document_hash(doc: dict[str, Any], text_field: str) -> str | None:
    """The hash of :func:`document_text`; None for a document without text."""
    text = document_text(doc, text_field)
    return None if text is None else hash_text(text)
