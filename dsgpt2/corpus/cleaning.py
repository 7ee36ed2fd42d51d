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
_SPACES = re.compile(r"(?<=\S)[ \t\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_TRAILING = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")


def clean_text(text: str) -> str:
    """Clean one document's text by the rules of :data:`CLEANER_VERSION` (see module doc)."""
    text = _SURROGATE.sub("\ufffd", text)
    text = unicodedata.normalize("NFC", text)
    text = _NEWLINES.sub("\n", text)
    text = _INVISIBLE.sub("", text)
    text = _INDENT.sub(lambda m: m[0].replace("\t", "    "), text)
    text = _SPACES.sub(" ", text)
    text = _TRAILING.sub("", text)
    text = _BLANKS.sub("\n\n", text)
    return text.strip()
