"""``dsgpt2 curate``: quality signals and verdicts stored on each document, in place.

Each document of the collections gets ``quality`` (the measures of :func:`dsgpt2.curation.quality.
signals` of the text training reads) and ``passes`` (``{"gopher": true, "c4": false, ...}`` for the
rule sets asked, and ``key``: the signals' version, the rule sets and the thresholds they were judged
by). A pass selects the documents whose ``passes.key`` is not this run's, so it is resumable (killed,
it continues with the documents not yet judged) and a run with other thresholds judges every document
again. ``{"passes.gopher": true}`` selects the documents that pass.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsgpt2.curation.quality import (
    RULES,
    SIGNALS_VERSION,
    THRESHOLDS,
    failed,
    resolve_thresholds,
    signals,
    verdicts,
)
from dsgpt2.curation.steps import STEPS, About, CollectionPart, Reason, Report, Split, Step
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import write_meta
from dsgpt2.db.summaries import aggregate_summary
from dsgpt2.documents import IDX, PASSES, QUALITY, document_text
from dsgpt2.errors import usage_error
from dsgpt2.settings.argtypes import comma_list
from dsgpt2.settings.options import NON_NEGATIVE_INT, Checked, option


def run_key(rules: Sequence[str], thresholds: Mapping[str, float]) -> str:
    """What a document's verdicts were judged by: the signals' version, the rule sets, the thresholds."""
    used = {k: v for k, v in sorted(thresholds.items())}
    blob = json.dumps([SIGNALS_VERSION, sorted(rules), used], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class CollectionCuration(CollectionPart):
    judged: int = 0  # by this run
    failing: dict[str, int] = field(default_factory=dict)  # rule set → documents that fail it
    passing_all: int = 0
    examples: list[str] = field(default_factory=list)


@dataclass
class CurationReport(Report):
    collections: list[CollectionCuration]
    rules: list[str]

    def lines(self) -> list[str]:
        out = []
        for c in self.collections:
            fails = ", ".join(f"{rule} {c.failing[rule]} ({c.failing[rule] / max(c.documents, 1):.1%})"
                              for rule in self.rules)  # fmt: skip
            out.append(f"{c.name}: {c.documents} documents, {c.judged} judged by this run; failing: {fails}; "
                       f"passing all: {c.passing_all}")  # fmt: skip
            out.extend(f"  e.g. {e}" for e in c.examples)
        out.append(f"({self.seconds:.1f}s)")
        keep = ", ".join(f'"passes.{rule}": true' for rule in self.rules)
        out.append(f'to train on the documents that pass, add to the config: "FILTER": {{{keep}}}')
        return out


@dataclass(frozen=True, kw_only=True)
class CurateSettings(Checked):
    """``dsgpt2 curate``: the rule sets and thresholds, or the report of what every pass marked."""

    action: str | None = option(
        None,
        "report: print and plot what dedup and curate marked per collection, with examples "
        "(reads the marks; judges nothing)",
        positional=True,
        choices=["report"],
    )
    rules: tuple[str, ...] = option(
        RULES, f"rule sets (default: {','.join(RULES)})", type=comma_list, metavar="A,B"
    )
    threshold: tuple[str, ...] = option(
        (),
        "change one threshold (repeatable), e.g. min_words=30; `--help` lists them",
        repeat=True,
        metavar="NAME=VALUE",
    )
    plot: str = option("runs/curation.png", "report: the PNG")
    examples: int = option(2, "report: examples per reason", check=NON_NEGATIVE_INT)
    json: bool = option(False, "report: print JSON instead of lines")


_LISTED = "; ".join(f"{name} ({rule}, default {default:g}): {what}"
                    for name, (default, rule, what) in THRESHOLDS.items())  # fmt: skip


@STEPS.register("curate")
@dataclass
class Curation(Step):
    """The step: each document measured and judged by ``rules`` under ``thresholds``."""

    rules: list[str]
    thresholds: dict[str, float]

    command = "curate"
    about = About(
        help="store quality signals and per-rule-set verdicts on each document (Gopher, C4, repetition)",
        description=(
            "Measure each document's text (words, mean word length, symbol, bullet and ellipsis ratios, "
            "stop words, repeated lines, paragraphs and n-grams, C4's line filter) into `quality`, and "
            "judge it by each rule set of --rules into `passes` (e.g. passes.gopher: true). Killed and "
            "re-run, it continues; run with other thresholds, it judges every document again. "
            f"Thresholds: {_LISTED}."
        ),
        epilog=(
            "examples:\n  dsgpt2 curate --config c.json --rules gopher,c4 --threshold min_words=30\n"
            "  dsgpt2 curate report --config c.json --plot curation.png   # what every pass marked"
        ),
    )
    settings = (CurateSettings,)
    marks = (QUALITY, PASSES)
    reasons = tuple(
        Reason(f"fails {rule}", {f"passes.{rule}": False}, f"dsgpt2 curate --rules {rule}",
               ("curate", "rules", rule))
        for rule in RULES
    )  # fmt: skip
    verb = "curate"
    writing = "curate"
    mark = "passes.key"

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Curation:
        s: CurateSettings = settings[CurateSettings]
        unknown = [r for r in s.rules if r not in RULES]
        known = ", ".join(RULES)
        if unknown:
            raise usage_error("curate", f"--rules: unknown rule set {unknown[0]!r}; known: {known}")
        if not s.rules:  # `--rules ''`: nothing would be judged, and the run would say it judged
            raise usage_error("curate", f"--rules names no rule set; give one or more of {known}")
        overrides = {}
        for item in s.threshold:
            name, sep, value = item.partition("=")
            try:
                number = float(value)
            except ValueError:
                sep = ""
            if not sep:
                raise usage_error("curate", f"--threshold {item!r}: give NAME=NUMBER, e.g. min_words=30")
            if (
                math.isnan(number) or number < 0
            ):  # NaN compares false: it would pass everything; inf: no bound
                raise usage_error(
                    "curate",
                    f"--threshold {item!r}: give a number at least 0 (inf: no bound)",
                )
            overrides[name.strip()] = number
        return cls(list(s.rules), resolve_thresholds(overrides))

    def __post_init__(self) -> None:
        self.run_key = run_key(self.rules, self.thresholds)

    def key(self) -> str:
        return self.run_key

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        text = document_text(doc, text_field)
        measured = signals(text) if text is not None else None
        judged = (
            verdicts(measured, self.rules, self.thresholds) if measured else dict.fromkeys(self.rules, False)
        )
        quality = {"v": SIGNALS_VERSION, **(measured or {})}
        return {QUALITY: quality, PASSES: {"key": self.run_key, **judged}}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionCuration:
        part = CollectionCuration(name, judged=done)
        _summarize(conn, part, self.rules, self.thresholds)
        write_meta(conn, name, {"curate": {"rules": list(self.rules), "thresholds": dict(self.thresholds),
                                           "key": self.key(), "at": time.time()}})  # fmt: skip
        return part

    def report(self, parts: list[Any]) -> CurationReport:
        return CurationReport(parts, rules=list(self.rules))


def _summarize(
    conn: Connection, part: CollectionCuration, rules: Sequence[str], thresholds: Mapping[str, float]
) -> None:
    # One pass over the collection for every count and example (a count per rule is a scan per rule).
    facets: dict[str, list[dict[str, Any]]] = {
        "documents": [{"$count": "n"}],
        "passing_all": [{"$match": {f"passes.{rule}": True for rule in rules}}, {"$count": "n"}],
    }
    for i, rule in enumerate(rules):
        failing = {f"passes.{rule}": False}
        facets[f"failing{i}"] = [{"$match": failing}, {"$count": "n"}]
        facets[f"example{i}"] = [{"$match": failing}, {"$sort": {"idx": 1}}, {"$limit": 1},
                                 {"$project": {IDX: 1, QUALITY: 1}}]  # fmt: skip
    pipeline = [{"$match": {"idx": {"$exists": True}}}, {"$facet": facets}]
    (row,) = aggregate_summary(conn, part.name, pipeline, f"curate: counting {part.name}")

    def count(facet: str) -> int:
        return int(row[facet][0]["n"]) if row[facet] else 0

    part.documents, part.passing_all = count("documents"), count("passing_all")
    for i, rule in enumerate(rules):
        part.failing[rule] = count(f"failing{i}")
        if not row[f"example{i}"]:
            continue
        doc = row[f"example{i}"][0]
        why = (
            failed(doc.get(QUALITY) or {}, rule, thresholds)
            if doc.get(QUALITY, {}).get("words") is not None
            else []
        )
        part.examples.append(f"{part.name}:{doc['idx']} fails {rule}: {', '.join(why[:3]) or 'no text'}")
