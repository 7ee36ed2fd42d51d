"""``dsgpt2 decontaminate``: documents that share a word n-gram with an evaluation set, marked in place.

Every evaluation text is normalised as GPT-3 and datatrove's n-gram decontamination do (lowercase,
punctuation stripped, whitespace collapsed, words) and each of its N-word n-grams goes into one
table in memory (evaluation sets are small). Each document is then read once, in idx order, in
batches (:mod:`dsgpt2.curation.passes`): a document holding one of those n-grams gets
``contaminated: {SET: "the n-gram"}`` (the first such n-gram of the text, for each set it shares one
with), and every document read gets ``decont: {SET: KEY}``, the set's run key (the normaliser's
version, N and the set's n-grams). A pass selects the documents whose key for a set is not this
run's, so it is resumable (killed, it continues with the documents not yet checked), incremental
(documents ingested after a run are the only ones the next run reads) and a set whose texts or N
changed is checked again everywhere. ``{"contaminated": {"$exists": false}}`` as a FILTER leaves the
marked documents out of training.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsgpt2.curation.steps import STEPS, About, CollectionPart, Reason, Report, Split, Step
from dsgpt2.db.client import Connection, UpdateMany, UpdateOne
from dsgpt2.db.filters import conjoin
from dsgpt2.db.meta import write_meta
from dsgpt2.db.summaries import aggregate_summary, read_windows
from dsgpt2.documents import CHECKED, CONTAMINATED, TURNS, document_text
from dsgpt2.errors import ConfigError, usage_error
from dsgpt2.files import not_a_file
from dsgpt2.settings.options import Checked, Range, option

META = "decontaminate"  # meta_info: {SET: {key, ngram, files, items, at}} after each complete run
NORMALISER_VERSION = 1
MIN_NGRAM = 5
DEFAULT_NGRAM = 13

_PUNCT = re.compile(r"[^\w\s]|_")
_LABEL_KEYS = ("label", "gold", "gold_index", "answer", "answerKey")


def words(text: str) -> list[str]:
    """``text`` lowercased, punctuation replaced by spaces, split into words."""
    return _PUNCT.sub(" ", text.lower()).split()


def ngrams(tokens: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    """The ``n``-word windows of ``tokens`` (none when there are fewer than ``n``)."""
    for i in range(len(tokens) - n + 1):
        yield tuple(tokens[i : i + n])


# ---------------------------------------------------------------- evaluation files


def set_name(path: Path) -> str:
    """A set's default name: the file's name without .gz, .jsonl, .json."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a set (it is a field name on the documents), or None."""
    if not name:
        return "it is empty"
    if "." in name or name.startswith("$"):
        return "a set's name holds no '.' and does not start with '$'"
    return None


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _hellaswag(obj: dict[str, Any]) -> str | None:
    """The context and the gold ending of a HellaSwag example (llm.c's layout), or None."""
    ctx, endings, label = obj.get("ctx"), obj.get("endings"), obj.get("label")
    if not (isinstance(ctx, str) and isinstance(endings, list) and endings):
        return None
    if not all(isinstance(e, str) for e in endings):
        return None
    try:
        gold = endings[int(label)]
    except (TypeError, ValueError, IndexError):
        return None
    return f"{ctx} {gold}"


def _strings(value: Any) -> Iterator[str]:
    """Every string inside ``value`` (dict values and list items, depth first)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _task_doc(doc: dict[str, Any], target: Any = None) -> str | None:
    """An lm-eval task document's text: its string fields, a list of choices cut to the gold one
    where a label says which (the wrong choices are not the test's text), and the target."""
    hs = _hellaswag(doc)
    if hs is not None:
        return hs
    labels = (doc[k] for k in _LABEL_KEYS if isinstance(doc.get(k), int) and not isinstance(doc[k], bool))
    label = next(labels, None)
    parts: list[str] = []
    for key, value in doc.items():
        if isinstance(value, list) and label is not None and 0 <= label < len(value) and key != "label":
            parts.extend(_strings(value[label]))
        elif key not in _LABEL_KEYS or isinstance(value, str):
            parts.extend(_strings(value))
    if isinstance(target, str | list):
        parts.extend(_strings(target))
    text = " ".join(p for p in parts if p.strip())
    return text or None


# Each layout: how it is known from a record, and the record's evaluation text.
def _layout(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    if {"ctx", "endings", "label"} <= obj.keys():
        return "hellaswag"
    if isinstance(obj.get("doc"), dict):
        return "lm-eval"
    if isinstance(obj.get("text"), str):
        return "text"
    return None


def _text_of(layout: str, obj: dict[str, Any]) -> str | None:
    if layout == "hellaswag":
        return _hellaswag(obj)
    if layout == "lm-eval":
        doc = obj.get("doc")
        return _task_doc(doc, obj.get("target")) if isinstance(doc, dict) else None
    text = obj.get("text")
    return text if isinstance(text, str) else None


LAYOUTS = {
    "hellaswag": "HellaSwag (ctx, endings, label: the layout `evaluate --hellaswag` reads)",
    "lm-eval": "lm-eval task documents ({doc: {...}, target}, as --log_samples writes them)",
    "text": 'plain text ({"text": ...})',
}


def read_texts(path: Path) -> tuple[str, list[str]]:
    """The layout of the evaluation file ``path`` (known from its first record) and its texts.

    Raises:
        ConfigError: a missing or empty file, an unknown layout, a line that is not JSON or not of
            the file's layout: one line naming the file (and the line).
    """
    known = "; ".join(LAYOUTS.values())
    why = not_a_file(path)
    if why is not None:
        raise ConfigError(f"--against {path}: {why}; give the evaluation set's file")
    layout: str | None = None
    texts: list[str] = []
    try:
        with _open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise ConfigError(f"--against {path}: line {number} is not JSON") from None
                if layout is None:
                    layout = _layout(obj)
                    if layout is None:
                        raise ConfigError(f"--against {path}: unknown layout (line {number}); known: {known}")
                text = _text_of(layout, obj) if isinstance(obj, dict) else None
                if text is None:
                    raise ConfigError(
                        f"--against {path}: line {number} is not a record of the file's layout, "
                        f"{LAYOUTS[layout]}"
                    )
                texts.append(text)
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise ConfigError(f"--against {path}: cannot read it as UTF-8 JSON lines ({exc})") from None
    if layout is None:
        raise ConfigError(f"--against {path}: the file is empty (no evaluation record)")
    return layout, texts


@dataclass
class EvalSet:
    """One evaluation set: its name, files, items and the n-grams of its texts."""

    name: str
    files: list[str] = field(default_factory=list)
    items: int = 0
    grams: set[tuple[str, ...]] = field(default_factory=set)
    short: int = 0  # items with fewer than N words: nothing of them can be found

    def key(self, n: int) -> str:
        """The run key: what a document checked against this set was checked by."""
        h = hashlib.sha256(json.dumps([NORMALISER_VERSION, n]).encode())
        for gram in sorted(self.grams):
            h.update(" ".join(gram).encode())
            h.update(b"\n")
        return h.hexdigest()[:16]


def load_sets(files: Sequence[Path], names: Sequence[str | None], n: int) -> list[EvalSet]:
    """The evaluation sets of ``files`` (a file's set is its name in ``names``, else its stem; files of
    one name make one set), each with the ``n``-grams of its texts."""
    sets: dict[str, EvalSet] = {}
    for path, given in zip(files, names, strict=True):
        name = given or set_name(path)
        problem = name_problem(name)
        if problem:
            flag = "--name" if given else f"--against {path}: the set's name {name!r} (give --name)"
            raise ConfigError(f"{flag} {name!r}: {problem}" if given else f"{flag}: {problem}")
        _, texts = read_texts(path)
        s = sets.setdefault(name, EvalSet(name))
        s.files.append(str(path))
        for text in texts:
            s.items += 1
            before = len(s.grams)
            tokens = words(text)
            s.grams.update(ngrams(tokens, n))
            if len(tokens) < n and len(s.grams) == before:
                s.short += 1
    return list(sets.values())


# ---------------------------------------------------------------- the pass


def find(tokens: Sequence[str], n: int, table: Mapping[tuple[str, ...], Any]) -> dict[str, str]:
    """For each set of ``table`` (n-gram → the sets holding it) the first n-gram of ``tokens`` it holds."""
    found: dict[str, str] = {}
    for i in range(len(tokens) - n + 1):
        owners = table.get(tuple(tokens[i : i + n]))
        if owners:
            for owner in owners:
                found.setdefault(owner, " ".join(tokens[i : i + n]))
    return found


@dataclass
class CollectionDecont(CollectionPart):
    checked: int = 0  # by this run
    contaminated: dict[str, int] = field(default_factory=dict)  # set → documents marked with it
    examples: list[str] = field(default_factory=list)


@dataclass
class DecontReport(Report):
    collections: list[CollectionDecont]
    ngram: int
    sets: list[EvalSet]

    def lines(self) -> list[str]:
        out = []
        for s in self.sets:
            short = f" ({s.short} items shorter than {self.ngram} words)" if s.short else ""
            out.append(f"{s.name}: {s.items} items, {len(s.grams)} distinct {self.ngram}-grams{short}")
        for c in self.collections:
            counts = ", ".join(f"{k} {v}" for k, v in c.contaminated.items())
            out.append(
                f"{c.name}: {c.documents} documents, {c.checked} checked by this run; contaminated: {counts}"
            )
            out.extend(f"  e.g. {e}" for e in c.examples)
        out.append(f"({self.seconds:.1f}s)")
        out.append(
            f'to train without them, add to the config: "FILTER": {{"{CONTAMINATED}": {{"$exists": false}}}}'
        )
        return out


@dataclass(frozen=True, kw_only=True)
class DecontaminateSettings(Checked):
    """``dsgpt2 decontaminate``: the evaluation files, their set names and the n-gram size."""

    against: tuple[Path, ...] = option(
        (),
        "evaluation files (JSON lines, optionally .gz): HellaSwag as `evaluate --hellaswag` reads it, "
        'lm-eval task documents ({"doc": {...}, "target": ...}), or {"text": ...} records',
        metavar="FILE",
    )
    name: tuple[str, ...] | None = option(
        None,
        "the set's name of each --against file, in order (repeatable; default: the file's name without "
        ".jsonl, .json, .gz)",
        repeat=True,
    )
    # Shorter n-grams than MIN_NGRAM match ordinary prose.
    ngram: int = option(
        DEFAULT_NGRAM,
        "words per n-gram shared with an evaluation text (GPT-3's 13)",
        check=Range(int, MIN_NGRAM),
    )


@STEPS.register("decontaminate")
@dataclass
class Decontamination(Step):
    """The step: each document checked for an ``ngram``-word n-gram of each evaluation set of ``sets``."""

    sets: list[EvalSet]
    ngram: int = DEFAULT_NGRAM
    # n-gram → the sets holding it; made from ``sets`` (and sent to worker processes with them).
    table: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict, repr=False)
    keys: dict[str, str] = field(default_factory=dict, repr=False)  # each set's run key, made once

    command = "decontaminate"
    about = About(
        help="mark documents that share an n-gram of N words with an evaluation set (contaminated)",
        description=(
            "Normalise every evaluation text as GPT-3 and datatrove do (lowercase, punctuation stripped, "
            "whitespace collapsed), keep its N-word n-grams in memory, then read each document once in "
            'idx order and mark those holding one with contaminated: {SET: "the n-gram"}. Each '
            "document read records the set's run key in decont.SET: killed and re-run, the pass "
            "continues; run again after an ingest, it reads only the new documents; a set whose texts "
            "or N changed is checked again everywhere. Nothing is deleted: the FILTER "
            '{"contaminated": {"$exists": false}} trains without them, `dsgpt2 curate report` counts '
            "them per set and `dsgpt2 evaluate --hellaswag FILE` says how many of the set named as "
            "FILE the run's training split held."
        ),
        epilog=(
            "examples:\n"
            "  dsgpt2 decontaminate --config c.json --against hellaswag_val.jsonl\n"
            "  dsgpt2 decontaminate --config c.json --against mmlu.jsonl.gz --name mmlu --ngram 8 --workers 4"
        ),
    )
    settings = (DecontaminateSettings,)
    marks = (CONTAMINATED, CHECKED)
    reasons = (
        Reason("contaminated", {CONTAMINATED: {"$exists": True}}, "dsgpt2 decontaminate --against FILE",
               (META,)),
    )  # fmt: skip
    verb = "decontaminate"
    writing = "decontaminate"
    part_note = "the sets are recorded as checked once a run without --part has read what the parts left"

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys = {s.name: s.key(self.ngram) for s in self.sets}
        if not self.table:
            for s in self.sets:
                for gram in s.grams:
                    self.table[gram] = (*self.table.get(gram, ()), s.name)

    @classmethod
    def build(cls, settings: Mapping[type, Any]) -> Decontamination:
        s: DecontaminateSettings = settings[DecontaminateSettings]
        if not s.against:
            raise usage_error("decontaminate", "give the evaluation files: --against FILE...")
        names: list[str | None] = list(s.name or [None] * len(s.against))
        if len(names) != len(s.against):
            raise usage_error(
                "decontaminate",
                f"--name given {len(names)} times for {len(s.against)} --against files: one per file",
            )
        return cls(load_sets(s.against, names, s.ngram), s.ngram)

    def key(self) -> dict[str, str]:
        """Each set's run key, by name."""
        return self.keys

    def todo(self) -> dict[str, Any]:
        # A document not yet checked against one of several sets is picked by `pending`: as an `$or`
        # here, a batch's query would have no one index to ride (see `conjoin`).
        keys = self.key()
        if len(keys) == 1:
            ((name, key),) = keys.items()
            return {"idx": {"$exists": True}, f"{CHECKED}.{name}": {"$ne": key}}
        return {"idx": {"$exists": True}}

    def pending(self, doc: dict[str, Any]) -> bool:
        checked = doc.get(CHECKED)
        checked = checked if isinstance(checked, dict) else {}
        return any(checked.get(name) != key for name, key in self.key().items())

    def fields(self, text_field: str) -> dict[str, int]:
        return {text_field: 1, TURNS: 1, CONTAMINATED: 1, CHECKED: 1}

    def process(self, batch: list[dict[str, Any]], text_field: str) -> list[Any]:
        """The checked documents' marks: the clean ones get the keys by runs of consecutive idx, one
        update per run on the idx index (far fewer writes than one per document; idx being unique, a
        run of idx values all read holds no document this pass has not read); every other document gets
        its checks set with its marks set or (none left) removed, so that ``{"contaminated": {"$exists":
        false}}`` selects exactly the clean documents."""
        keys = self.key()
        clean: list[int] = []
        ops: list[Any] = []
        for doc in batch:
            text = document_text(doc, text_field)
            found = find(words(text), self.ngram, self.table) if text else {}
            if not found and not doc.get(CONTAMINATED):
                clean.append(int(doc["idx"]))  # the common case: nothing to mark, nothing to take off
                continue
            marks = {k: v for k, v in (doc.get(CONTAMINATED) or {}).items() if k not in keys}
            marks.update(found)
            checked = {**(doc.get(CHECKED) or {}), **keys}
            if marks:
                ops.append(UpdateOne({"_id": doc["_id"]}, {"$set": {CHECKED: checked, CONTAMINATED: marks}}))
            else:
                ops.append(
                    UpdateOne({"_id": doc["_id"]}, {"$set": {CHECKED: checked}, "$unset": {CONTAMINATED: ""}})
                )
        checks = {"$set": {f"{CHECKED}.{s}": k for s, k in keys.items()}}
        return [UpdateMany({"idx": {"$gte": lo, "$lte": hi}}, checks) for lo, hi in _runs(clean)] + ops

    def finish(self, conn: Connection, name: str, done: int, split: Split) -> CollectionDecont:
        part = CollectionDecont(name, checked=done)
        _summarize(conn, part, [s.name for s in self.sets])
        if split.parts == 1:  # a run over every idx range: the set has been checked everywhere
            keys = self.key()
            for s in self.sets:
                record = {"key": keys[s.name], "ngram": self.ngram, "files": s.files, "items": s.items}
                write_meta(conn, name, {f"{META}.{s.name}": {**record, "at": time.time()}})
        return part

    def report(self, parts: list[Any]) -> DecontReport:
        return DecontReport(parts, ngram=self.ngram, sets=list(self.sets))


def _runs(values: list[int]) -> list[tuple[int, int]]:
    """``values`` (ascending) as runs of consecutive integers, ``(first, last)`` each."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _summarize(conn: Connection, part: CollectionDecont, sets: Sequence[str]) -> None:
    facets: dict[str, list[dict[str, Any]]] = {"documents": [{"$count": "n"}]}
    for i, s in enumerate(sets):
        marked = {f"{CONTAMINATED}.{s}": {"$exists": True}}
        facets[f"set{i}"] = [{"$match": marked}, {"$count": "n"}]
        facets[f"example{i}"] = [{"$match": marked}, {"$sort": {"idx": 1}}, {"$limit": 1},
                                 {"$project": {"idx": 1, CONTAMINATED: 1}}]  # fmt: skip
    pipeline = [{"$match": {"idx": {"$exists": True}}}, {"$facet": facets}]
    (row,) = aggregate_summary(conn, part.name, pipeline, f"decontaminate: counting {part.name}")
    part.documents = int(row["documents"][0]["n"]) if row["documents"] else 0
    for i, s in enumerate(sets):
        part.contaminated[s] = int(row[f"set{i}"][0]["n"]) if row[f"set{i}"] else 0
        for doc in row[f"example{i}"]:
            part.examples.append(f"{part.name}:{doc['idx']} shares with {s}: {doc[CONTAMINATED][s]!r}")


def contaminated_counts(conn: Connection, name: str) -> dict[str, int]:
    """Per set, the documents of ``name`` marked as sharing an n-gram with it (one aggregation)."""
    pipeline = [
        {"$match": {CONTAMINATED: {"$exists": True}, "idx": {"$exists": True}}},
        {"$project": {"sets": {"$objectToArray": f"${CONTAMINATED}"}}},
        {"$unwind": "$sets"},
        {"$group": {"_id": "$sets.k", "n": {"$sum": 1}}},
    ]
    rows = aggregate_summary(conn, name, pipeline, f"counting the contaminated documents of {name}")
    return {r["_id"]: int(r["n"]) for r in sorted(rows, key=lambda r: r["_id"])}


def iter_marked(
    conn: Connection, name: str, set_name_: str, query: dict[str, Any] | None = None
) -> Iterable[int]:
    """The idx of the documents of ``name`` marked with ``set_name_`` (and matching ``query``)."""
    q = conjoin({f"{CONTAMINATED}.{set_name_}": {"$exists": True}, "idx": {"$exists": True}}, query or {})
    windows = read_windows(
        conn, name, q, {"idx": 1, "_id": 0}, f"reading the contaminated documents of {name}"
    )
    return [int(d["idx"]) for docs in windows for d in docs]
