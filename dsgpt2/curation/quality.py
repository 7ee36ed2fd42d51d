"""Quality signals of a document and the rule sets that judge them: Gopher's quality rules, its
repetition rules, and C4's, as the Gopher paper (Rae et al. 2021, appendix A) and C4 (Raffel et
al. 2020) define them and datatrove implements them, with the thresholds of those papers as defaults.

Pure functions: no database here. A word is a whitespace-separated token; a line ends at a line
break; a paragraph at a blank line. :func:`signals` measures, :func:`verdicts` judges.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from dsgpt2.errors import ConfigError

SIGNALS_VERSION = 1
RULES = ("gopher", "repetition", "c4")

# name: (default, rule set, what it bounds). min_* fail below, max_* fail above.
THRESHOLDS: dict[str, tuple[float, str, str]] = {
    "min_words": (50, "gopher", "words (not counting symbol-only tokens)"),
    "max_words": (100_000, "gopher", "words (not counting symbol-only tokens)"),
    "min_mean_word_length": (3, "gopher", "mean characters per word"),
    "max_mean_word_length": (10, "gopher", "mean characters per word"),
    "max_symbol_ratio": (0.1, "gopher", "'#' and ellipses per word"),
    "max_bullet_lines": (0.9, "gopher", "share of lines starting with a bullet"),
    "max_ellipsis_lines": (0.3, "gopher", "share of lines ending with an ellipsis"),
    "min_alpha_words": (0.8, "gopher", "share of words with a letter"),
    "min_stop_words": (2, "gopher", "English stop words (the, be, to, of, and, that, have, with)"),
    "max_dup_lines": (0.3, "repetition", "share of lines that repeat an earlier line"),
    "max_dup_line_chars": (0.2, "repetition", "share of characters in repeated lines"),
    "max_dup_paragraphs": (0.3, "repetition", "share of paragraphs that repeat an earlier one"),
    "max_dup_paragraph_chars": (0.2, "repetition", "share of characters in repeated paragraphs"),
    **{f"max_top_{n}gram": (f, "repetition", f"share of characters in the most frequent {n}-gram")
       for n, f in ((2, 0.2), (3, 0.18), (4, 0.16))},
    **{f"max_dup_{n}gram": (f, "repetition", f"share of characters in repeated {n}-grams")
       for n, f in ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10))},
    "min_c4_sentences": (5, "c4", "sentences in the lines C4 keeps"),
    "max_lorem_ipsum": (0, "c4", "'lorem ipsum' in the text (0: refused)"),
    "max_curly_brackets": (0, "c4", "'{' in the text (0: refused)"),
}  # fmt: skip
# What each threshold reads of the signals.
_MEASURES = {
    "min_words": "words",
    "max_words": "words",
    "min_mean_word_length": "mean_word_length",
    "max_mean_word_length": "mean_word_length",
    "max_symbol_ratio": "symbol_ratio",
    "max_bullet_lines": "bullet_lines",
    "max_ellipsis_lines": "ellipsis_lines",
    "min_alpha_words": "alpha_words",
    "min_stop_words": "stop_words",
    "max_dup_lines": "dup_lines",
    "max_dup_line_chars": "dup_line_chars",
    "max_dup_paragraphs": "dup_paragraphs",
    "max_dup_paragraph_chars": "dup_paragraph_chars",
    **{f"max_top_{n}gram": f"top_{n}gram" for n in (2, 3, 4)},
    **{f"max_dup_{n}gram": f"dup_{n}gram" for n in range(5, 11)},
    "min_c4_sentences": "c4_sentences",
    "max_lorem_ipsum": "lorem_ipsum",
    "max_curly_brackets": "curly_brackets",
}
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_BULLETS = ("•", "-", "*", "‣", "◦", "▪")
_ELLIPSES = ("...", "…")
_SYMBOLS_ONLY = set(string.punctuation) | {"…", "•", "“", "”", "‘", "’", "–", "—"}
_TERMINAL = (".", "!", "?", '"', "'", "”", "’")
_C4_POLICY = (
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
)
_C4_MIN_LINE_WORDS = 3
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")


def signals(text: str) -> dict[str, float | int]:
    """Every measure the rule sets read, rounded to 4 places (fractions) for storage."""
    words = text.split()
    kept = [w for w in words if not set(w) <= _SYMBOLS_ONLY]
    lines = [line for line in text.split("\n") if line.strip()]
    paragraphs = [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]
    n_words, n_lines, chars = max(len(words), 1), max(len(lines), 1), max(len(text), 1)
    symbols = text.count("#") + sum(text.count(e) for e in _ELLIPSES)
    line_dups, line_dup_chars = _repeated(lines)
    para_dups, para_dup_chars = _repeated(paragraphs)
    out: dict[str, float | int] = {
        "words": len(kept),
        "mean_word_length": sum(len(w) for w in kept) / len(kept) if kept else 0.0,
        "symbol_ratio": symbols / n_words,
        "bullet_lines": sum(line.lstrip().startswith(_BULLETS) for line in lines) / n_lines,
        "ellipsis_lines": sum(line.rstrip().endswith(_ELLIPSES) for line in lines) / n_lines,
        "alpha_words": sum(any(c.isalpha() for c in w) for w in words) / n_words,
        "stop_words": sum(w.lower() in STOP_WORDS for w in words),
        "dup_lines": line_dups / n_lines,
        "dup_line_chars": line_dup_chars / chars,
        "dup_paragraphs": para_dups / max(len(paragraphs), 1),
        "dup_paragraph_chars": para_dup_chars / chars,
    }
    for n in (2, 3, 4):
        out[f"top_{n}gram"] = _top_ngram_chars(words, n) / chars
    for n in range(5, 11):
        out[f"dup_{n}gram"] = _repeated_ngram_chars(words, n) / chars
    out.update(_c4(text, lines))
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def _repeated(parts: Sequence[str]) -> tuple[int, int]:
    """How many of ``parts`` repeat an earlier one, and their characters."""
    seen: set[str] = set()
    count = chars = 0
    for part in parts:
        if part in seen:
            count += 1
            chars += len(part)
        else:
            seen.add(part)
    return count, chars


def _top_ngram_chars(words: Sequence[str], n: int) -> int:
    """Characters covered by the most frequent ``n``-gram's occurrences, when it occurs twice or more."""
    if len(words) < n:
        return 0
    counts = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    gram, times = counts.most_common(1)[0]
    return len(gram) * times if times > 1 else 0


def _repeated_ngram_chars(words: Sequence[str], n: int) -> int:
    """Characters in ``n``-grams that repeat an earlier one, scanning left to right and stepping over
    a repeat (so overlapping repeats are not counted twice), as Gopher counts them."""
    seen: set[tuple[str, ...]] = set()
    chars, i = 0, 0
    while i <= len(words) - n:
        gram = tuple(words[i : i + n])
        if gram in seen:
            chars += sum(len(w) for w in gram) + n - 1
            i += n
        else:
            seen.add(gram)
            i += 1
    return chars


def _c4(text: str, lines: Sequence[str]) -> dict[str, float | int]:
    """C4's line filter (terminal punctuation, at least three words, no javascript or policy
    boilerplate) and what it leaves: sentences, and the document-level refusals."""
    lowered = text.lower()
    kept = []
    for line in lines:
        stripped = line.strip()
        low = stripped.lower()
        if not stripped.endswith(_TERMINAL) or len(stripped.split()) < _C4_MIN_LINE_WORDS:
            continue
        if "javascript" in low or any(p in low for p in _C4_POLICY):
            continue
        kept.append(stripped)
    return {
        "c4_lines_kept": len(kept) / max(len(lines), 1),
        "c4_sentences": sum(len(_SENTENCE_END.findall(line)) for line in kept),
        "lorem_ipsum": int("lorem ipsum" in lowered),
        "curly_brackets": int("{" in text),
    }


def verdicts(
    measured: Mapping[str, Any], rules: Sequence[str], thresholds: Mapping[str, float]
) -> dict[str, bool]:
    """Whether the document passes each of ``rules`` under ``thresholds``."""
    return {rule: not failed(measured, rule, thresholds) for rule in rules}


def failed(measured: Mapping[str, Any], rule: str, thresholds: Mapping[str, float]) -> list[str]:
    """The thresholds of ``rule`` a document falls outside, e.g. ``["min_words (12 < 50)"]``."""
    out = []
    for name, (_, owner, _) in THRESHOLDS.items():
        if owner != rule:
            continue
        value, bound = measured[_MEASURES[name]], thresholds[name]
        low = name.startswith("min_")
        if (value < bound) if low else (value > bound):
            out.append(f"{name} ({value:g} {'<' if low else '>'} {bound:g})")
    return out


def resolve_thresholds(overrides: Mapping[str, float]) -> dict[str, float]:
    """The defaults with ``overrides``; an unknown name is a ConfigError naming the known ones."""
    unknown = sorted(set(overrides) - set(THRESHOLDS))
    if unknown:
        raise ConfigError(f"--threshold: unknown threshold {unknown[0]!r}; known: {', '.join(THRESHOLDS)}")
    return {name: float(overrides.get(name, default)) for name, (default, _, _) in THRESHOLDS.items()}
