"""The corpus commands: ingest, index, dedup, curate, validate, info."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from dsgpt2.cli.common import (
    check_writable,
    config_option,
    load_connection,
    no_progress_option,
    usage,
    verbose_option,
)
from dsgpt2.curation.quality import RULES, THRESHOLDS
from dsgpt2.db.config import collection_name_problem
from dsgpt2.settings.argtypes import comma_list, part_of
from dsgpt2.settings.options import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    RATIO,
    add_options,
    check_fields,
    from_namespace,
    option,
)

log = logging.getLogger("dsgpt2")
FORMATS = ("auto", "text", "jsonl", "csv", "conversation", "parquet", "arrow", "dataset")


@dataclass(frozen=True, kw_only=True)
class IngestSettings:
    """``dsgpt2 ingest``: what to load, from where, into which collection."""

    config: str = config_option()
    verbose: bool = verbose_option()
    inputs: tuple[str, ...] = option(
        (),
        "input files (.txt, .jsonl, .csv, optionally .gz; .parquet, .arrow) or `datasets` directories",
        positional=True,
        metavar="FILE",
    )
    sample: str | None = option(
        None,
        "ingest a built-in sample (no download): stdlib documentation, or conversations about it",
        choices=["stdlib", "stdlib-chat"],
    )
    limit: int | None = option(None, "with --sample: only the first N documents", check=POSITIVE_INT)
    collection: str | None = option(
        None, "target collection (default: the first of COLLECTIONS in the config)"
    )
    format: str = option(
        "auto",
        "input format; auto goes by the file extension, and knows Parquet and Arrow by their first bytes",
        choices=FORMATS,
    )
    field: str = option("text", "jsonl, parquet, arrow, dataset: the field holding the text")
    keep_fields: tuple[str, ...] = option(
        (),
        "also store these columns (jsonl: keys) on each document, e.g. id,url,dump,language_score",
        type=comma_list,
        metavar="A,B,...",
    )
    column: str = option("text", "csv: the column holding the text")
    split: str = option(
        "line",
        "text files: one document per line or per blank-line separated paragraph",
        choices=["line", "paragraph"],
    )
    batch_size: int = option(1000, "documents per insert", check=POSITIVE_INT)
    encoding: str = option(
        "utf-8",
        "encoding of the input files, e.g. latin-1 or cp1252; bytes not valid in it become U+FFFD and "
        "are counted",
    )
    strict: bool = option(False, "stop at the first unusable record, naming its file and line")
    report: str | None = option(
        None,
        "write where each skipped record is, one JSON object a line: file and line (Parquet, Arrow: "
        "row_group and row) and the reason, for the records this run read; the log names the first few",
        metavar="FILE.jsonl",
    )
    dedup: bool = option(
        False,
        "skip a record whose text the corpus already holds (this collection and the config's), "
        "counted as duplicate",
    )
    pii: bool = option(
        False,
        "replace e-mail addresses, IP addresses and phone numbers in the text (as `dsgpt2 redact` does; "
        "`form` keeps the original)",
    )
    no_progress: bool = no_progress_option()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class PassSettings:
    """The options of a pass over the collections (dedup, curate)."""

    collection: tuple[str, ...] | None = option(
        None, "only these collections (repeatable; default: the config's)", repeat=True
    )
    batch_size: int = option(1000, "documents per read and bulk write", check=POSITIVE_INT)
    workers: int = option(
        1, "processes for the per-document work, each on its own idx range", check=POSITIVE_INT
    )
    part: tuple[int, int] | None = option(
        None,
        "only the R-th of M idx ranges of each collection: machine R of M runs its part",
        type=part_of,
        metavar="R/M",
    )
    no_progress: bool = no_progress_option()

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def split(self) -> Any:
        """The worker processes and the share of the idx ranges this run does."""
        from dsgpt2.curation.passes import Split

        part, parts = self.part or (1, 1)
        return Split(workers=self.workers, part=part - 1, parts=parts)


@dataclass(frozen=True, kw_only=True)
class DedupSettings:
    """``dsgpt2 dedup``: which duplicates, and how near is near."""

    config: str = config_option()
    verbose: bool = verbose_option()
    exact: bool = option(False, "exact duplicates, by text_hash")
    near: bool = option(False, "near duplicates, by MinHash LSH")
    threshold: float = option(
        0.8,
        "--near: the Jaccard similarity of word n-gram sets from which two texts are near duplicates",
        check=RATIO,
    )
    ngram: int = option(5, "--near: words per shingle", check=POSITIVE_INT)
    num_perm: int = option(
        128,
        "--near: MinHash permutations; the bands are chosen from them for --threshold",
        check=POSITIVE_INT,
    )

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class CurateSettings:
    """``dsgpt2 curate``: the rule sets and thresholds, or the report of what every pass marked."""

    action: str | None = option(
        None,
        "report: print and plot what dedup and curate marked per collection, with examples "
        "(reads the marks; judges nothing)",
        positional=True,
        choices=["report"],
    )
    config: str = config_option()
    verbose: bool = verbose_option()
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

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class IndexSettings:
    """``dsgpt2 index``: the collection to number in place."""

    config: str = config_option()
    verbose: bool = verbose_option()
    collection: str = option(help="the collection to number")
    field: str = option("text", "the field holding each document's text")
    batch_size: int = option(1000, "documents numbered per bulk write", check=POSITIVE_INT)
    no_progress: bool = no_progress_option()

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True, kw_only=True)
class ValidateSettings:
    """``dsgpt2 validate``: which collections, and whether to fix what can be."""

    config: str = config_option()
    verbose: bool = verbose_option()
    collection: tuple[str, ...] | None = option(
        None, "check only this collection (repeatable; default: all)", repeat=True
    )
    json: bool = option(False, "print the report as JSON")
    fix: bool = option(False, "create a missing idx index and record counts")


@dataclass(frozen=True, kw_only=True)
class InfoSettings:
    """``dsgpt2 info``."""

    config: str = config_option()
    verbose: bool = verbose_option()
    json: bool = option(False, "print as JSON")


def add_ingest(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="load text files or the built-in sample into a collection",
        description=(
            "Load documents into a collection: each record's text is kept as `form`, cleaned into "
            "`filt_text` and numbered with `idx` after the collection's last one. Interrupted and "
            "re-run with the same arguments, it resumes without duplicating or skipping records. "
            "Text files may be gzipped. Parquet (FineWeb's layout: text, id, url, dump, ...), Arrow "
            "files and `datasets` save_to_disk directories are read in record batches (bounded "
            "memory); --keep_fields stores chosen columns on each document."
        ),
        epilog=(
            "examples:\n"
            "  dsgpt2 ingest --config c.json --sample stdlib\n"
            "  dsgpt2 ingest --config c.json --collection news news.jsonl.gz --field body\n"
            "  dsgpt2 ingest --config c.json --collection books --split paragraph books/*.txt\n"
            "  dsgpt2 ingest --config c.json --collection fineweb \\\n"
            "      --keep_fields id,url,dump,language_score fineweb/data/CC-MAIN-2024-10/*.parquet\n"
            "  dsgpt2 ingest --config c.json --collection wiki wiki_saved/   # Dataset.save_to_disk\n"
            "  dsgpt2 ingest --config c.json --collection chats --format conversation chats.jsonl"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, IngestSettings)
    p.set_defaults(func=cmd_ingest)


def add_dedup(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="mark duplicate and near-duplicate documents in place (dup_of, near_dup_of)",
        description=(
            "--exact: store text_hash (a hash of the text training reads) on every document without one "
            "and index it, group the hashes with MongoDB's aggregation pipeline over the collections, "
            "and mark every copy of a text but the first (the earliest collection in COLLECTIONS "
            'order, then the smallest idx) with dup_of: "collection:idx".\n\n'
            "--near: store lsh (MinHash LSH band values of the text's word n-grams) on every document "
            "not signed under these settings and index it, group the band values with the aggregation "
            "pipeline, confirm each candidate pair on the texts (Jaccard similarity of their n-gram "
            "sets >= --threshold), cluster the confirmed pairs and mark every document of a cluster "
            'but the first with near_dup_of: "collection:idx".\n\n'
            "Nothing is deleted; select the rest with a FILTER. Killed and re-run, a pass ends as a "
            "straight run. --workers splits hashing and signing by idx ranges across processes; "
            "--part R/M does only this machine's share of them (then one run without --part marks)."
        ),
        epilog=(
            "examples:\n  dsgpt2 dedup --config c.json --exact --near --threshold 0.8\n"
            "  dsgpt2 dedup --config c.json --near --workers 4 --part 1/2   # machine 1 of 2, then:\n"
            "  dsgpt2 dedup --config c.json --near"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, DedupSettings)
    add_options(p, PassSettings)
    p.set_defaults(func=cmd_dedup)


def cmd_dedup(args: argparse.Namespace) -> int:
    from dsgpt2.curation.dedup import dedup_exact
    from dsgpt2.curation.minhash import LshParams
    from dsgpt2.curation.neardup import dedup_near
    from dsgpt2.db.client import connect

    settings, passes = from_namespace(DedupSettings, args), from_namespace(PassSettings, args)
    if not (settings.exact or settings.near):
        raise usage("dedup", "say which duplicates: --exact, --near, or both")
    try:
        params = LshParams(threshold=settings.threshold, ngram=settings.ngram, num_perm=settings.num_perm)
    except ValueError as exc:
        raise usage("dedup", str(exc)) from None
    config = load_connection(settings.config)
    names = _collections(passes.collection, config, "dedup")
    split, progress = passes.split, not passes.no_progress
    conn = connect(config)
    lines = []
    if settings.exact:
        lines += dedup_exact(conn, names, passes.batch_size, progress, split).lines()
    if settings.near:
        lines += dedup_near(conn, names, params, passes.batch_size, progress, split=split).lines()
    if split.parts > 1:
        lines.append(
            f"part {split.part + 1}/{split.parts} done: once every part is, run once without --part to mark"
        )
    print("\n".join(lines))
    return 0


def add_curate(sub: Any, name: str) -> None:
    listed = "; ".join(f"{name} ({rule}, default {default:g}): {what}" for name, (default, rule, what)
                       in THRESHOLDS.items())  # fmt: skip
    p = sub.add_parser(
        name,
        help="store quality signals and per-rule-set verdicts on each document (Gopher, C4, repetition)",
        description=(
            "Measure each document's text (words, mean word length, symbol, bullet and ellipsis ratios, "
            "stop words, repeated lines, paragraphs and n-grams, C4's line filter) into `quality`, and "
            "judge it by each rule set of --rules into `passes` (e.g. passes.gopher: true). Killed and "
            "re-run, it continues; run with other thresholds, it judges every document again. "
            f"Thresholds: {listed}."
        ),
        epilog=(
            "examples:\n  dsgpt2 curate --config c.json --rules gopher,c4 --threshold min_words=30\n"
            "  dsgpt2 curate report --config c.json --plot curation.png   # what every pass marked"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, CurateSettings)
    add_options(p, PassSettings)
    p.set_defaults(func=cmd_curate)


def cmd_curate(args: argparse.Namespace) -> int:
    from dsgpt2.curation.curate import curate
    from dsgpt2.curation.quality import resolve_thresholds
    from dsgpt2.db.client import connect

    settings, passes = from_namespace(CurateSettings, args), from_namespace(PassSettings, args)
    if settings.action == "report":
        return _curation_report(settings, passes)
    unknown = [r for r in settings.rules if r not in RULES]
    if unknown:
        raise usage("curate", f"--rules: unknown rule set {unknown[0]!r}; known: {', '.join(RULES)}")
    overrides = {}
    for item in settings.threshold:
        name, sep, value = item.partition("=")
        try:
            overrides[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise usage("curate", f"--threshold {item!r}: give NAME=NUMBER, e.g. min_words=30")
    try:
        thresholds = resolve_thresholds(overrides)
    except ValueError as exc:
        raise usage("curate", f"--threshold: {exc}") from None
    config = load_connection(settings.config)
    names = _collections(passes.collection, config, "curate")
    report = curate(
        connect(config),
        names,
        list(settings.rules),
        thresholds,
        passes.batch_size,
        progress=not passes.no_progress,
        split=passes.split,
    )
    print("\n".join(report.lines()))
    return 0


def _curation_report(settings: CurateSettings, passes: PassSettings) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from dsgpt2.curation import report as curation_report
    from dsgpt2.db.client import connect

    config = load_connection(settings.config)
    names = _collections(passes.collection, config, "curate")
    plot = Path(settings.plot)
    check_writable(plot, "--plot")
    parts = curation_report.summarize(connect(config), names, settings.examples)
    curation_report.plot(parts, plot)
    if settings.json:
        print(json.dumps({"collections": [asdict(p) for p in parts], "plot": str(plot)}, indent=2))
    else:
        print("\n".join([*curation_report.report_lines(parts), f"plot: {plot}"]))
    return 0


def _collections(given: tuple[str, ...] | None, config: Any, command: str) -> list[str]:
    """--collection (repeatable), else the config's COLLECTIONS; a bad name is a usage error."""
    names = list(given or config.collections)
    for name in names:
        problem = collection_name_problem(name)
        if problem:
            raise usage(command, f"--collection {name!r} is not a collection name: {problem}")
    return names


def add_index(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="number a collection already in MongoDB in place (idx, unique index, meta_info)",
        description=(
            "Make a collection that another application wrote into a training collection, without a "
            "copy: each document without an idx gets the next number in _id order, the unique idx index "
            "is built (sparse: documents without idx may still be inserted) and meta_info records the "
            "count. Killed and re-run, it numbers every document exactly once; run again later, it "
            "numbers the documents added since. Training reads the documents' --field through "
            "TEXT_FIELD in the connection config."
        ),
        epilog="example:\n  dsgpt2 index --config c.json --collection articles --field body",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, IndexSettings)
    p.set_defaults(func=cmd_index)


def add_validate(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="check idx, indexes and counts of the collections",
        description=(
            "Check each collection for what training relies on: integer idx values 0..n-1, each once, "
            "a unique index on idx, and a matching count in meta_info. Prints each problem with its "
            "fix; exits 1 when there is one. --fix creates a missing index and records the count."
        ),
    )
    add_options(p, ValidateSettings)
    p.set_defaults(func=cmd_validate)


def add_info(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
        help="show the configured collections, their counts and ingest history",
        description="Show what the config points at: hosts, database, collections and meta_info.",
    )
    add_options(p, InfoSettings)
    p.set_defaults(func=cmd_info)


def cmd_index(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.numbering import index_collection
    from dsgpt2.db.client import connect

    settings = from_namespace(IndexSettings, args)
    config = load_connection(settings.config)
    name, field = settings.collection, settings.field
    problem = collection_name_problem(name)
    if problem:
        raise usage("index", f"--collection {name!r} is not a collection name: {problem}")
    report = index_collection(connect(config), name, field, settings.batch_size, not settings.no_progress)
    print("\n".join(report.lines()))
    if config.text_field != field:
        setting = json.dumps({"TEXT_FIELD": field})[1:-1]
        print(f"note: {settings.config} reads TEXT_FIELD {config.text_field!r}; set {setting} in it to "
              f"train on {name!r}")  # fmt: skip
    if name not in config.collections:
        print(f"note: {name!r} is not in the COLLECTIONS of {settings.config}; add it to train on it")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.ingest import builtin_source, file_source, ingest
    from dsgpt2.db.client import connect

    s = from_namespace(IngestSettings, args)
    if not s.inputs and not s.sample:
        raise usage("ingest", "give input FILEs or --sample stdlib")
    if s.limit and not s.sample:
        raise usage("ingest", "--limit goes with --sample")
    config = load_connection(s.config)
    collection = config.collections[0] if s.collection is None else s.collection
    problem = collection_name_problem(collection)
    if problem:
        raise usage("ingest", f"--collection {collection!r} is not a collection name: {problem}")
    sources = [builtin_source(s.sample, s.limit)] if s.sample else []
    sources += [
        file_source(
            path,
            s.format,
            field=s.field,
            column=s.column,
            split=s.split,
            encoding=s.encoding,
            keep_fields=s.keep_fields,
        )
        for path in s.inputs
    ]
    conn = connect(config)
    log.info("ingesting %d source(s) into %s.%s", len(sources), config.db, collection)
    report = ingest(
        conn,
        collection,
        sources,
        batch_size=s.batch_size,
        strict=s.strict,
        progress=not s.no_progress,
        dedup=s.dedup,
        report_file=s.report,
        pii=s.pii,
    )
    for line in report.lines():
        print(line)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from dsgpt2.db.client import connect
    from dsgpt2.db.validate import fix_collection, validate_corpus
    from dsgpt2.errors import CorpusValidationError

    settings = from_namespace(ValidateSettings, args)
    config = load_connection(settings.config)
    conn = connect(config)
    names = list(settings.collection or config.collections)
    if settings.fix:
        for name in names:
            for line in fix_collection(conn, name):
                print(line)
    reports = validate_corpus(conn, names)
    if settings.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            print("\n".join(r.lines()))
    bad = [r.name for r in reports if not r.ok]
    if bad:
        raise CorpusValidationError(f"problems found in {', '.join(bad)}; apply the fixes above")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dsgpt2.db.client import connect, require_collections
    from dsgpt2.db.meta import read_meta
    from dsgpt2.db.wrapper import MongoWrapper

    settings = from_namespace(InfoSettings, args)
    config = load_connection(settings.config)
    require_collections(connect(config), settings.config)
    wrapper = MongoWrapper(config)
    meta = read_meta(wrapper.connection, list(config.collections))
    total = max(len(wrapper), 1)
    weights = [w / sum(config.weights) for w in config.weights] or [None] * len(config.collections)
    passing = _passing(wrapper)
    info = {
        "uri": config.display_uri,
        "db": config.db,
        "documents": len(wrapper),
        "filter": config.filter_query,
        "collections": [
            {
                "name": name,
                "count": count,  # the high-water mark: [0, count) is complete
                "natural_share": count / total,
                "weight": weight,
                "passing_filter": passing.get(name),
                "last_run": _last_run(meta.get(name, {}).get("trained")),
                "growth_since_last_run": count - meta[name]["trained"]["mark"]
                if isinstance(meta.get(name, {}).get("trained"), dict)
                else None,
                "cleaner_version": meta.get(name, {}).get("cleaner_version"),
                # Counted by `dsgpt2 langid` at the end of its pass: read here without a scan.
                "languages": (meta.get(name, {}).get("langid") or {}).get("counts"),
                "sources": [
                    {k: s.get(k) for k in ("label", "records", "inserted", "complete")}
                    for s in meta.get(name, {}).get("sources", {}).values()
                ],
            }
            for name, count, weight in zip(config.collections, wrapper.counts, weights, strict=True)
        ],
    }
    if settings.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['uri']} / {info['db']}: {info['documents']} documents")
    if config.filter:
        print(f"FILTER {config.filter}")
    for c in info["collections"]:
        share = f"{c['natural_share']:.1%} of the documents"
        if c["weight"] is not None:
            share += f", weight {c['weight']:.1%} of the tokens"
        print(f"  {c['name']}: {c['count']} documents, high-water mark {c['count']} ({share}; "
              f"cleaner {c['cleaner_version'] or '-'})")  # fmt: skip
        if c["passing_filter"] is not None:
            print(f"    FILTER keeps {c['passing_filter']} ({c['passing_filter'] / max(c['count'], 1):.1%})")
        if c["last_run"]:
            run = c["last_run"]
            step = f"step {run['step']}" if run.get("step") is not None else "no checkpoint yet"
            print(f"    last run: {run['run']} ({step}, {run.get('when') or 'time unknown'}) read "
                  f"{run['mark']} documents; {c['growth_since_last_run']:+d} since")  # fmt: skip
        if c["languages"]:
            from dsgpt2.curation.language import top_languages

            print(f"    languages (at the last langid): {top_languages(c['languages'])}")
        for s in c["sources"]:
            state = "complete" if s["complete"] else f"interrupted after record {s['records']}"
            print(f"    {s['label']}: {s['inserted']} inserted, {state}")
    return 0


def _last_run(trained: Any) -> dict[str, Any] | None:
    """What meta_info says of the last run on a collection: its checkpoint directory (``run``), the
    step of its last checkpoint, when (``at``: seconds since the epoch; ``when``: UTC), its mark."""
    if not isinstance(trained, dict) or "mark" not in trained:
        return None
    import datetime

    at = trained.get("at")
    when = (
        datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        if isinstance(at, int | float)
        else None
    )
    return {"run": trained.get("run"), "step": trained.get("step"), "at": at, "when": when,
            "mark": trained["mark"]}  # fmt: skip


def _passing(wrapper: Any) -> dict[str, int]:
    """Per collection, how many of the documents below its high-water mark FILTER keeps (none without
    a FILTER)."""
    from dsgpt2.db.client import with_retries

    query = wrapper.config.filter_query
    if query is None:
        return {}
    conn, out = wrapper.connection, {}
    for name, count in zip(wrapper.collections, wrapper.counts, strict=True):
        q = {"$and": [{"idx": {"$lt": count}}, query]}
        out[name] = with_retries(
            lambda n=name, q=q: conn.db[n].count_documents(q), conn.config, f"counting {name}"
        )
    return out
