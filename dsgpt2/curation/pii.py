"""PII redaction: e-mail addresses, IP addresses and phone numbers in the text training reads replaced by
placeholders, in place (``dsgpt2 redact``, ``dsgpt2 ingest --pii``).

:func:`redact` is pure: ``redact(text) -> (text, counts)``. The placeholders are of the kind datatrove's
PII formatter writes (realistic values, not ``<EMAIL>`` tags, so the model reads ordinary text), but
taken from the ranges reserved for documentation: ``example.com`` (RFC 2606), 192.0.2.0/24,
198.51.100.0/24 and 203.0.113.0/24 (RFC 5737), 2001:db8::/32 (RFC 3849) and the fictional 555-01XX
telephone numbers. Those are nobody's, so the rules leave them alone wherever they occur: redacting a
redacted text changes nothing, which makes the redaction idempotent.

What is left alone (the lookalikes), by rule:

- e-mail: a domain of at least two labels whose last is two or more letters (``x = a@b`` and
  ``A@B.T`` are code), not followed by ``(`` or ``[`` (a method call on a matrix product), not an SSH
  remote (``git@github.com:owner/repo``), not a reserved domain (example.com/.net/.org, .example,
  .test, .invalid, .localhost);
- IPv4: exactly four dot-separated numbers 0-255 without leading zeros, not touching another digit,
  letter or dotted number (``1.2.3.4.5``, ``v1.2.3.4``), not after a word that numbers things
  (version, release, build, section, chapter, figure, table, step, §, ...), and globally routable
  (private, loopback and reserved addresses are no one's: datatrove's default, ``only_remove_public_ips``);
- IPv6: parsed by :mod:`ipaddress`, in the global unicast range 2000::/3 (so ``std::vector``,
  ``10:30:45``, MAC addresses and ``fe80::1`` are not addresses) and globally routable;
- phone: ``+`` and a country code followed by 7-14 more digits in groups, or a North American
  ``(212) 555-1234`` / ``212-555-1234`` / ``212.555.1234``, or a national number that starts with one 0
  and has 10-11 digits in groups (``020 7946 0958``); never after ISBN, never touching other digits,
  so dates (2024-01-15, 15/01/2024), decimals, ISBNs and ordinary numbers do not qualify.

A document redacted carries ``pii``: ``{"v": PII_VERSION, "email": n, "ip": n, "phone": n}``; a pass
selects the documents whose ``pii.v`` is not this version, so it is resumable, and a new version of the
rules redacts the documents again (from the text as it is: what the older rules replaced stays
replaced, the counts add up).
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsgpt2.curation.steps import STEPS, About, AtIngest, CollectionPart, Report, Split, Step
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta, write_meta
from dsgpt2.db.summaries import aggregate_summary, first_numbered
from dsgpt2.documents import FORM, HASH, PII, TEXT, TURNS, document_hash, turns_text
from dsgpt2.errors import CorpusError
from dsgpt2.settings.options import Checked, option

# Raised when a rule changes: documents redacted under another version are redacted again.
PII_VERSION = 1
KINDS = ("email", "ip", "phone")

# Cycled through, one after the other, within a text (deterministic: the same text, the same result).
EMAILS = ("email@example.com", "firstname.lastname@example.org")
IPV4S = ("192.0.2.1", "198.51.100.7", "203.0.113.42")
IPV6S = ("2001:db8::1",)
PHONES = ("+1-202-555-0143", "(202) 555-0178")

_EMAIL = re.compile(
    r"(?<![\w.+-])[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*"
    r"@((?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+([A-Za-z]{2,24}))(?![\w-]|\.[A-Za-z0-9])"
)
_RESERVED_DOMAIN = re.compile(
    r"(?:^|\.)(?:example\.(?:com|net|org)|[^.]+\.example|[^.]+\.(?:test|invalid|localhost)|"
    r"example|test|invalid|localhost)$",
    re.IGNORECASE,
)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_IPV4 = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w]|\.\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:]|\.\d)")
# A word that numbers things, just before a dotted number: then it is no address.
_NUMBERING = re.compile(
    r"(?:\b(?:v|ver|version|versions|release|rel|build|rev|revision|firmware|kernel|update|patch|"
    r"section|sections|sec|chapter|figure|fig|table|step|clause|item|rule|paragraph|article|art|"
    r"no|number|isbn|oid)\.?|§|==|>=|<=|~=|@)\s*$",
    re.IGNORECASE,
)
_GROUP = r"[ .-]"
_PHONE = re.compile(
    r"(?<![\w+/.-])(?:"
    r"\+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){2,6}"  # +44 20 7946 0958, +1 (212) 555-1234
    r"|(?:1[ .-])?(?:\(\d{3}\) ?|\d{3}[.-])\d{3}[.-]\d{4}"  # (212) 555-1234, 212-555-1234
    r"|\d{3} \d{3} \d{4}"  # 212 555 1234
    r"|0[1-9]\d{0,3}(?:[ /-]\d{2,8}){1,4}"  # 020 7946 0958, 030/1234567
    r")(?![\w/-]|[.,]\d)"
)
_NOT_PHONE_BEFORE = re.compile(r"(?:\bisbn(?:-1[03])?:?|\bissn:?|\bdoi:?|\barxiv:?)\s*$", re.IGNORECASE)


def _cycle(choices: Sequence[str]) -> Callable[[], str]:
    state = {"i": 0}

    def take() -> str:
        value = choices[state["i"] % len(choices)]
        state["i"] += 1
        return value

    return take


def _email(m: re.Match[str], text: str) -> bool:
    domain = m.group(1)
    after = text[m.end() : m.end() + 1]
    if after in ("(", "["):
        return False  # self.w@self.x.data(...): code
    if after == ":" and re.match(r":[\w~./-]+", text[m.end() :]):
        return False  # git@github.com:owner/repo.git: an SSH remote
    return not _RESERVED_DOMAIN.search(domain)


def _public(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6 and ip not in _GLOBAL_UNICAST:
        return False
    return bool(ip.is_global)


_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


def _numbered(text: str, start: int) -> bool:
    return bool(_NUMBERING.search(text[max(0, start - 24) : start]))


def _phone(m: re.Match[str], text: str) -> bool:
    raw = m.group(0)
    digits = re.sub(r"\D", "", raw)
    if raw.startswith("+"):
        if not 8 <= len(digits) <= 15:
            return False
    elif raw.startswith("0"):
        if not 10 <= len(digits) <= 11:
            return False
    elif len(digits) not in (10, 11):
        return False
    if re.search(r"55501\d\d$", digits):
        return False  # a fictional number (555-0100 to 555-0199): the placeholders themselves
    return not _NOT_PHONE_BEFORE.search(text[max(0, m.start() - 12) : m.start()])


def _replace(
    text: str, pattern: re.Pattern[str], keep: Callable[[re.Match[str], str], bool], take: Callable[[], str]
) -> tuple[str, int]:
    found = 0

    def one(m: re.Match[str]) -> str:
        nonlocal found
        if not keep(m, text):
            return m.group(0)
        found += 1
        return take()

    return pattern.sub(one, text), found


def redact(text: str) -> tuple[str, dict[str, int]]:
    """``text`` with its e-mail addresses, IP addresses and phone numbers replaced by placeholders (see
    the module doc), and how many of each kind were replaced: ``{"email": n, "ip": n, "phone": n}``.
    Idempotent: ``redact(redact(t)[0])`` changes nothing and counts nothing."""
    counts = dict.fromkeys(KINDS, 0)
    if not any(c in text for c in "@.:-+( "):
        return text, counts
    # Each pattern only where its one necessary character is: most texts hold no "@" and no "::".
    if "@" in text:
        text, counts["email"] = _replace(text, _EMAIL, _email, _cycle(EMAILS))
    v6 = 0
    if "::" in text or text.count(":") >= 7:
        text, v6 = _replace(text, _IPV6, lambda m, _t: _public(m.group(0)), _cycle(IPV6S))
    text, v4 = _replace(
        text, _IPV4, lambda m, t: _public(m.group(0)) and not _numbered(t, m.start()), _cycle(IPV4S)
    )
    counts["ip"] = v4 + v6
    text, counts["phone"] = _replace(text, _PHONE, _phone, _cycle(PHONES))
    return text, counts


def redact_document(doc: dict[str, Any], text_field: str) -> dict[str, Any] | None:
    """The fields to ``$set`` on ``doc`` to redact it: its text field (a conversation: its turns and the
    ``speaker: text`` lines of them), ``text_hash`` of the new text, ``pii`` (the counts, added to
    those of an earlier version's, and ``v``), and ``form`` (the original) when it has none. None when
    the document holds no text."""
    before = doc.get(PII) if isinstance(doc.get(PII), dict) else {}
    counts = {k: int(before.get(k, 0)) for k in KINDS}
    out: dict[str, Any] = {}
    turns = doc.get(TURNS)
    value = doc.get(text_field)
    if isinstance(turns, list) and turns and all(isinstance(t, dict) for t in turns):
        # A conversation: its turns redacted one by one, and the text training reads made of them again.
        new_turns = []
        for turn in turns:
            text = turn.get("text")
            if isinstance(text, str):
                text, found = redact(text)
                counts = {k: counts[k] + found[k] for k in KINDS}
            new_turns.append({**turn, "text": text})
        out[TURNS] = new_turns
        if isinstance(value, str):
            out[text_field] = turns_text(new_turns)
        original = value if isinstance(value, str) else turns_text(turns)
    elif isinstance(value, str):
        out[text_field], found = redact(value)
        counts = {k: counts[k] + found[k] for k in KINDS}
        original = value
    else:
        return None
    if FORM not in doc:
        out[FORM] = original
    out[HASH] = document_hash({**doc, **out}, text_field)
    out[PII] = {"v": PII_VERSION, **counts}
    return out


# ------------------------------------------------------------------------------------------ the pass


@dataclass
class CollectionRedaction(CollectionPart):
    redacted: int = 0  # by this run
    found: dict[str, int] = field(default_factory=dict)  # kind → items replaced, in the whole collection


@dataclass
class RedactionReport(Report):
    collections: list[CollectionRedaction]

    def lines(self) -> list[str]:
        out = []
        for c in self.collections:
            kinds = ", ".join(f"{k} {c.found.get(k, 0)}" for k in KINDS)
            out.append(f"{c.name}: {c.documents} documents, {c.redacted} redacted by this run; "
                       f"replaced in all: {kinds}")  # fmt: skip
        out.append(f"({self.seconds:.1f}s)")
        return out


def trained_prefix_at_risk(conn: Connection, name: str) -> str | None:
    """Why redacting ``name`` now would change documents a run trained on (meta_info's ``trained``
    note), or None: the trained prefix holds no document this version has not redacted."""
    trained = read_meta(conn, [name]).get(name, {}).get("trained")
    if not isinstance(trained, dict) or not int(trained.get("mark") or 0):
        return None
    mark = int(trained["mark"])
    todo = {"idx": {"$lt": mark}, f"{PII}.v": {"$ne": PII_VERSION}}
    hit = first_numbered(conn, name, todo, {"idx": 1}, f"redact: reading {name}")
    if hit is None:
        return None
    return (
        f"{name}: run {trained.get('run')!r} trained on its first {mark} documents, and redacting them "
        "changes the texts it trained on (its growth check at resume finds the prefix changed); redact "
        "before training, or pass --force to redact them all the same"
    )


@dataclass(frozen=True, kw_only=True)
class RedactSettings(Checked):
    """``dsgpt2 redact``: whether documents a run trained on may change."""

    force: bool = option(
        False,
        "redact documents a run has trained on all the same (their texts change under its checkpoints)",
    )


@STEPS.register("redact")
@dataclass
class Redaction(Step):
    """The step: e-mail addresses, IP addresses and phone numbers replaced in each document's text (the
    config's TEXT_FIELD, or ``redacts``); with ``force``, in documents a run trained on too."""

    force: bool = False
    redacts: str | None = None

    command = "redact"
    about = About(
        help="replace e-mail addresses, IP addresses and phone numbers in the documents' text (pii)",
        description=(
            "Replace the e-mail addresses, public IPv4 and IPv6 addresses and phone numbers in the text "
            "training reads (filt_text, or TEXT_FIELD; a conversation's turns) by placeholders from the "
            "ranges reserved for documentation (email@example.com, 192.0.2.1, 2001:db8::1, "
            "+1-202-555-0143), keep the original in `form`, and store the count of each kind in `pii` "
            '(e.g. {"v": 1, "email": 2, "ip": 0, "phone": 1}). Version numbers, dates, decimals, '
            "ISBNs, private addresses and e-mail-like code are left alone. Killed and re-run, it "
            "continues; run again, it redacts only the documents ingested since. A collection a run has "
            "trained on is refused while its trained documents are not redacted (their texts would "
            "change under the checkpoints): redact before training, or pass --force."
        ),
        epilog=(
            "examples:\n  dsgpt2 redact --config c.json\n"
            "  dsgpt2 redact --config c.json --collection web --workers 4\n"
            "  dsgpt2 ingest --config c.json --pii web.jsonl   # redacted as it is ingested"
        ),
    )
    settings = (RedactSettings,)
    marks = (PII, FORM, HASH)
    at_ingest = AtIngest(
        "pii",
        "replace e-mail addresses, IP addresses and phone numbers in the text (as `dsgpt2 redact` does; "
        "`form` keeps the original)",
    )
    verb = "redact"
    writing = "redact"
    mark = f"{PII}.v"

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Redaction:
        return cls(force=settings[RedactSettings].force)

    @classmethod
    def for_ingest(cls) -> Redaction:
        return cls(redacts=TEXT)  # the cleaned text ingest stores, whatever TEXT_FIELD names

    def key(self) -> int:
        return PII_VERSION

    def fields(self, text_field: str) -> dict[str, int]:
        return {text_field: 1, TURNS: 1, PII: 1, FORM: 1}

    def check(self, conn: Connection, names: Sequence[str]) -> None:
        if self.force:
            return
        for name in names:
            why = trained_prefix_at_risk(conn, name)
            if why:
                raise CorpusError(why)

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        # A document without text still gets its mark, so that the pass does not select it again.
        fields = redact_document(doc, self.redacts or text_field)
        return fields or {PII: {"v": PII_VERSION, **dict.fromkeys(KINDS, 0)}}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionRedaction:
        part = CollectionRedaction(name, redacted=done)
        part.documents, part.found = pii_counts(conn, name)
        write_meta(conn, name, {"redact": {"v": PII_VERSION, "at": time.time()}})
        return part

    def report(self, parts: list[Any]) -> RedactionReport:
        return RedactionReport(parts)


def pii_counts(conn: Connection, name: str) -> tuple[int, dict[str, int]]:
    """The numbered documents of ``name`` and the items of each kind replaced in them (one aggregation)."""
    group: dict[str, Any] = {"_id": None, "documents": {"$sum": 1}}
    group.update({k: {"$sum": {"$ifNull": [f"${PII}.{k}", 0]}} for k in KINDS})
    pipeline = [{"$match": {"idx": {"$exists": True}}}, {"$group": group}]
    rows = aggregate_summary(conn, name, pipeline, f"redact: counting {name}")
    if not rows:
        return 0, dict.fromkeys(KINDS, 0)
    return int(rows[0]["documents"]), {k: int(rows[0][k]) for k in KINDS}


# What `dsgpt2 curate report` counts: a ``$facet`` of its aggregation, and its row made into the totals.
_REPLACED = {"$add": [{"$ifNull": [f"${PII}.{k}", 0]} for k in KINDS]}
PII_FACET: list[dict[str, Any]] = [
    {"$match": {f"{PII}.v": {"$exists": True}}},
    {"$group": {"_id": None, "documents": {"$sum": 1},
                "changed": {"$sum": {"$cond": [{"$gt": [_REPLACED, 0]}, 1, 0]}},
                **{k: {"$sum": {"$ifNull": [f"${PII}.{k}", 0]}} for k in KINDS}}},
]  # fmt: skip


def pii_totals(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """``{"documents": documents checked, "changed": those with something replaced, "email": n, "ip": n,
    "phone": n}`` from :data:`PII_FACET`'s rows; empty when no document was checked."""
    if not rows:
        return {}
    return {k: int(rows[0].get(k) or 0) for k in ("documents", "changed", *KINDS)}
