"""The cleaner that turns a document's original text (``form``) into ``filt_text``.

Rules, in order (version ``CLEANER_VERSION``; bump it when a rule changes, so
that meta_info tells which collections were cleaned by which rules):

1. lone surrogates (undecodable bytes) become U+FFFD;
2. Unicode NFC normalisation (composed accents; full-width forms are kept);
3. ``\\r\\n``, ``\\r``, NEL, U+2028 and U+2029 become ``\\n``;
4. control characters other than ``\\n``/``\\t`` and invisible format characters
   (zero-width space, BOM, soft hyphen, word joiner) are removed;
   ZWJ/ZWNJ stay, emoji sequences and some scripts need them;
5. leading tabs become four spaces; other runs of spaces, tabs and Unicode
   spaces inside a line become one space (indentation is kept: it carries
   meaning in code and lists);
6. trailing spaces are removed from every line, runs of three or more line
   breaks become one blank line, and the text is stripped.
"""

from __future__ import annotations

import re
import unicodedata

CLEANER_VERSION = "1"

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_NEWLINES = re.compile(r"\r\n?|[\x85\u2028\u2029]")
_INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u200b\u2060\ufeff]")
_INDENT = re.compile(r"^[ \t]+", re.MULTILINE)
_SPACE = " \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000"
# Runs of spaces that rule 5 changes: two or more, or one that is not " " (a single " " stays as it
# is). Starting with a character class, not a look-behind, lets the regex engine skip ahead to
# candidates; the run's left neighbour is checked in _collapse.
_SPACES = re.compile(f"[{_SPACE}]{{2,}}|[{_SPACE[1:]}]")
# The common case, text whose only spaces are " ": runs of two or more, found by their literal
# prefix (the engine searches for "  " instead of trying a match at every word gap).
_ODD_SPACE = re.compile(f"[{_SPACE[1:]}]")
_DOUBLE = re.compile("  +")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")


def _collapse(m: re.Match[str]) -> str:
    # Inside a line (after a non-space) a run becomes one space; at a line's start it is indentation.
    # The left neighbour is never another space (runs are matched whole) nor a line break other than
    # \n (rules 3 and 4 ran first).
    start = m.start()
    return m[0] if start == 0 or m.string[start - 1] == "\n" else " "


def clean_text(text: str) -> str:
    """Clean one document's text by the rules of :data:`CLEANER_VERSION` (see module doc)."""
    # Each rule runs only where its characters occur: `in` and isascii() scan at memory speed, a
    # regex substitution tries a match at every candidate (most documents need few of the rules).
    if not text.isascii():
        text = _SURROGATE.sub("\ufffd", text)
        text = unicodedata.normalize("NFC", text)
        text = _NEWLINES.sub("\n", text)
    elif "\r" in text:
        text = _NEWLINES.sub("\n", text)
    text = _INVISIBLE.sub("", text)
    if "\t" in text:
        text = _INDENT.sub(lambda m: m[0].replace("\t", "    "), text)
    if _ODD_SPACE.search(text):
        text = _SPACES.sub(_collapse, text)
    elif "  " in text:
        text = _DOUBLE.sub(_collapse, text)
    if " \n" in text or "\t\n" in text:
        text = _TRAILING.sub("", text)
    if "\n\n\n" in text:
        text = _BLANKS.sub("\n\n", text)
    return text.strip()
