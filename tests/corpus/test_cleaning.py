from __future__ import annotations

import pytest

from dsgpt2.corpus.cleaning import clean_text
from dsgpt2.documents import ABSENT, SkipTally, text_problem


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("cafe\u0301", "café"),  # NFC composes the accent
        ("a\r\nb\rc\u2028d", "a\nb\nc\nd"),
        ("a\x00b\x07c\x1bd", "abcd"),
        ("zero\u200bwidth\ufeff soft\u00adhyphen", "zerowidth softhyphen"),
        ("too   many\t\tspaces\u00a0here", "too many spaces here"),
        ("    indented code\n\tand tab", "indented code\n    and tab"),
        ("  lead and trail  ", "lead and trail"),
        ("p1\n\n\n\n\np2", "p1\n\np2"),
        ("line end   \nnext", "line end\nnext"),
        ("bad \udcff byte", "bad \ufffd byte"),
        ("family 👨\u200d👩\u200d👧 ok", "family 👨\u200d👩\u200d👧 ok"),
        ("한국어 텍스트", "한국어 텍스트"),
        ("\n\t \x00", ""),
    ],
)
def test_clean_text_rules(raw: str, clean: str) -> None:
    assert clean_text(raw) == clean


def test_clean_text_is_idempotent(sample_texts: list[str]) -> None:
    for text in sample_texts[:500]:
        once = clean_text(text)
        assert clean_text(once) == once


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (ABSENT, "no_field"),
        (None, "null"),
        (42, "not_string"),
        (b"bytes", "not_string"),
        (["a"], "not_string"),
        ("", "empty"),
        ("  \n\t", "empty"),
        ("x" * 101, "too_long"),
        ("lone \udcff surrogate", "invalid_unicode"),
        ("fine text", None),
    ],
)
def test_text_problem(value: object, reason: str | None) -> None:
    assert text_problem(value, max_chars=100) == reason


def test_skip_tally_summary() -> None:
    tally = SkipTally()
    assert tally.summary() == "none skipped"
    tally.update({"empty": 2, "missing": 1})
    assert tally.total == 3
    assert tally.summary() == "3 skipped (missing: 1, empty: 2)"


def _reference_clean(text: str) -> str:
    """The rules of CLEANER_VERSION 1 written plainly, one substitution each (what clean_text, which
    skips the rules a text does not need, must equal)."""
    import re
    import unicodedata

    text = re.sub(r"[\ud800-\udfff]", "\ufffd", text)
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"\r\n?|[\x85\u2028\u2029]", "\n", text)
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u200b\u2060\ufeff]", "", text)
    text = re.sub(r"^[ \t]+", lambda m: m[0].replace("\t", "    "), text, flags=re.M)
    text = re.sub(r"(?<=\S)[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+", " ", text)
    text = re.sub(r"[ \t]+$", "", text, flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def test_clean_text_equals_the_plain_rules(sample_texts: list[str]) -> None:
    import random

    alphabet = list("ab  \t\n\r\x85\u2028\u2029\x00\x0b\x1f\x0c\x1c\u00ad\u200b\u2060\ufeff\u00a0\u1680"
                    "\u2000\u200a\u202f\u205f\u3000\ud800e\u0301é.")  # fmt: skip
    rng = random.Random(0)
    fuzz = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16))) for _ in range(50_000)]
    for text in fuzz + sample_texts:
        assert clean_text(text) == _reference_clean(text), repr(text)
