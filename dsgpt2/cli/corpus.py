"""The corpus commands: ingest, index, dedup, curate, validate, info."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from dsgpt2.cli.common import (
    add_config,
    check_writable,
    load_config_arg,
    usage,
)
from dsgpt2.db.config import collection_name_problem
from dsgpt2.settings.argtypes import comma_list, non_negative_int, part_of, positive_int, unit_fraction

log = logging.getLogger("dsgpt2")


def add_ingest(sub: Any) -> None:
    p = sub.add_parser(
        "ingest",
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
    add_config(p)
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="FILE",
        help="input files (.txt, .jsonl, .csv, optionally .gz; .parquet, .arrow) or `datasets` directories",
    )
    p.add_argument(
        "--sample",
        choices=["stdlib", "stdlib-chat"],
        help="ingest a built-in sample (no download): stdlib documentation, or conversations about it",
    )
    p.add_argument("--limit", type=positive_int, help="with --sample: only the first N documents")
    p.add_argument("--collection", help="target collection (default: the first of COLLECTIONS in the config)")
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "text", "jsonl", "csv", "conversation", "parquet", "arrow", "dataset"],
        help="input format; auto goes by the file extension, and knows Parquet and Arrow by their first "
        "bytes (default: auto)",
    )
    p.add_argument(
        "--field",
        default="text",
        help="jsonl, parquet, arrow, dataset: the field holding the text (default: text)",
    )
    p.add_argument(
        "--keep_fields",
        type=comma_list,
        default=(),
        metavar="A,B,...",
        help="also store these columns (jsonl: keys) on each document, e.g. id,url,dump,language_score",
    )
    p.add_argument("--column", default="text", help="csv: the column holding the text (default: text)")
    p.add_argument(
        "--split",
        default="line",
        choices=["line", "paragraph"],
        help="text files: one document per line or per blank-line separated paragraph (default: line)",
    )
    p.add_argument(
        "--batch_size", type=positive_int, default=1000, help="documents per insert (default: 1000)"
    )
    p.add_argument(
        "--encoding",
        default="utf-8",
        help="encoding of the input files, e.g. latin-1 or cp1252; bytes not valid in it become "
        "U+FFFD and are counted (default: utf-8)",
    )
    p.add_argument(
        "--strict", action="store_true", help="stop at the first unusable record, naming its file and line"
    )
    p.add_argument(
        "--report",
        metavar="FILE.jsonl",
        help="write where each skipped record is, one JSON object a line: file and line (Parquet, Arrow: "
        "row_group and row) and the reason, for the records this run read; the log names the first few",
    )
    p.add_argument(
        "--dedup",
        action="store_true",
        help="skip a record whose text the corpus already holds (this collection and the config's), "
        "counted as duplicate",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ingest)


def add_dedup(sub: Any) -> None:
    p = sub.add_parser(
        "dedup",
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
    add_config(p)
    p.add_argument("--exact", action="store_true", help="exact duplicates, by text_hash")
    p.add_argument("--near", action="store_true", help="near duplicates, by MinHash LSH")
    p.add_argument(
        "--threshold",
        type=unit_fraction,
        default=0.8,
        help="--near: the Jaccard similarity of word n-gram sets from which two texts are near "
        "duplicates (default: 0.8)",
    )
    p.add_argument("--ngram", type=positive_int, default=5, help="--near: words per shingle (default: 5)")
    p.add_argument(
        "--num_perm",
        type=positive_int,
        default=128,
        help="--near: MinHash permutations; the bands are chosen from them for --threshold (default: 128)",
    )
    _add_pass_options(p)
    p.set_defaults(func=cmd_dedup)


def cmd_dedup(args: argparse.Namespace) -> int:
    from dsgpt2.curation.dedup import dedup_exact
    from dsgpt2.curation.minhash import LshParams
    from dsgpt2.curation.neardup import dedup_near
    from dsgpt2.db.mongo import connect

    if not (args.exact or args.near):
        raise usage("dedup", "say which duplicates: --exact, --near, or both")
    try:
        params = LshParams(threshold=args.threshold, ngram=args.ngram, num_perm=args.num_perm)
    except ValueError as exc:
        raise usage("dedup", str(exc)) from None
    config = load_config_arg(args)
    names = _collections(args, config, "dedup")
    split = _split(args)
    conn = connect(config)
    lines = []
    if args.exact:
        lines += dedup_exact(conn, names, args.batch_size, not args.no_progress, split).lines()
    if args.near:
        lines += dedup_near(conn, names, params, args.batch_size, not args.no_progress, split).lines()
    if split.parts > 1:
        lines.append(
            f"part {split.part + 1}/{split.parts} done: once every part is, run once without --part to mark"
        )
    print("\n".join(lines))
    return 0


def add_curate(sub: Any) -> None:
    from dsgpt2.curation.quality import RULES, THRESHOLDS

    listed = "; ".join(f"{name} ({rule}, default {default:g}): {what}" for name, (default, rule, what)
                       in THRESHOLDS.items())  # fmt: skip
    p = sub.add_parser(
        "curate",
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
    p.add_argument(
        "action",
        nargs="?",
        choices=["report"],
        help="report: print and plot what dedup and curate marked per collection, with examples "
        "(reads the marks; judges nothing)",
    )
    add_config(p)
    p.add_argument(
        "--rules",
        type=comma_list,
        default=RULES,
        metavar="A,B",
        help=f"rule sets (default: {','.join(RULES)})",
    )
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="change one threshold (repeatable), e.g. min_words=30; `--help` lists them",
    )
    p.add_argument("--plot", default="runs/curation.png", help="report: the PNG (default: runs/curation.png)")
    p.add_argument(
        "--examples", type=non_negative_int, default=2, help="report: examples per reason (default: 2)"
    )
    p.add_argument("--json", action="store_true", help="report: print JSON instead of lines")
    _add_pass_options(p)
    p.set_defaults(func=cmd_curate)


def cmd_curate(args: argparse.Namespace) -> int:
    from dsgpt2.curation.curate import curate
    from dsgpt2.curation.quality import RULES, resolve_thresholds
    from dsgpt2.db.mongo import connect

    if args.action == "report":
        return _curation_report(args)
    unknown = [r for r in args.rules if r not in RULES]
    if unknown:
        raise usage("curate", f"--rules: unknown rule set {unknown[0]!r}; known: {', '.join(RULES)}")
    overrides = {}
    for item in args.threshold:
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
    config = load_config_arg(args)
    names = _collections(args, config, "curate")
    report = curate(
        connect(config),
        names,
        list(args.rules),
        thresholds,
        args.batch_size,
        not args.no_progress,
        _split(args),
    )
    print("\n".join(report.lines()))
    return 0


def _curation_report(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from pathlib import Path

    from dsgpt2.curation import report as curation_report
    from dsgpt2.db.mongo import connect

    config = load_config_arg(args)
    names = _collections(args, config, "curate")
    plot = Path(args.plot)
    check_writable(plot, "--plot")
    parts = curation_report.summarize(connect(config), names, args.examples)
    curation_report.plot(parts, plot)
    if args.json:
        print(json.dumps({"collections": [asdict(p) for p in parts], "plot": str(plot)}, indent=2))
    else:
        print("\n".join([*curation_report.report_lines(parts), f"plot: {plot}"]))
    return 0


def _add_pass_options(p: argparse.ArgumentParser) -> None:
    """The options of a pass over the collections (dedup, curate)."""
    p.add_argument(
        "--collection", action="append", help="only these collections (repeatable; default: the config's)"
    )
    p.add_argument(
        "--batch_size",
        type=positive_int,
        default=1000,
        help="documents per read and bulk write (default: 1000)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="processes for the per-document work, each on its own idx range (default: 1)",
    )
    p.add_argument(
        "--part",
        type=part_of,
        metavar="R/M",
        help="only the R-th of M idx ranges of each collection: machine R of M runs its part",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")


def _split(args: argparse.Namespace) -> Any:
    from dsgpt2.curation.passes import Split

    part, parts = args.part or (1, 1)
    return Split(workers=args.workers, part=part - 1, parts=parts)


def _collections(args: argparse.Namespace, config: Any, command: str) -> list[str]:
    """--collection (repeatable), else the config's COLLECTIONS; a bad name is a usage error."""
    names = args.collection or list(config.collections)
    for name in names:
        problem = collection_name_problem(name)
        if problem:
            raise usage(command, f"--collection {name!r} is not a collection name: {problem}")
    return names


def add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index",
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
    add_config(p)
    p.add_argument("--collection", required=True, help="the collection to number")
    p.add_argument("--field", default="text", help="the field holding each document's text (default: text)")
    p.add_argument(
        "--batch_size",
        type=positive_int,
        default=1000,
        help="documents numbered per bulk write (default: 1000)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_index)


def add_validate(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help="check idx, indexes and counts of the collections",
        description=(
            "Check each collection for what training relies on: integer idx values 0..n-1, each once, "
            "a unique index on idx, and a matching count in meta_info. Prints each problem with its "
            "fix; exits 1 when there is one. --fix creates a missing index and records the count."
        ),
    )
    add_config(p)
    p.add_argument(
        "--collection", action="append", help="check only this collection (repeatable; default: all)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--fix", action="store_true", help="create a missing idx index and record counts")
    p.set_defaults(func=cmd_validate)


def add_info(sub: Any) -> None:
    p = sub.add_parser(
        "info",
        help="show the configured collections, their counts and ingest history",
        description="Show what the config points at: hosts, database, collections and meta_info.",
    )
    add_config(p)
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_info)


def cmd_index(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.numbering import index_collection
    from dsgpt2.db.mongo import connect

    config = load_config_arg(args)
    problem = collection_name_problem(args.collection)
    if problem:
        raise usage("index", f"--collection {args.collection!r} is not a collection name: {problem}")
    report = index_collection(
        connect(config), args.collection, args.field, args.batch_size, not args.no_progress
    )
    print("\n".join(report.lines()))
    if config.text_field != args.field:
        setting = json.dumps({"TEXT_FIELD": args.field})[1:-1]
        print(f"note: {args.config} reads TEXT_FIELD {config.text_field!r}; set {setting} in it to train "
              f"on {args.collection!r}")  # fmt: skip
    if args.collection not in config.collections:
        print(f"note: {args.collection!r} is not in the COLLECTIONS of {args.config}; add it to train on it")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from dsgpt2.corpus.ingest import builtin_source, file_source, ingest
    from dsgpt2.db.mongo import connect

    if not args.inputs and not args.sample:
        raise usage("ingest", "give input FILEs or --sample stdlib")
    if args.limit and not args.sample:
        raise usage("ingest", "--limit goes with --sample")
    config = load_config_arg(args)
    collection = config.collections[0] if args.collection is None else args.collection
    problem = collection_name_problem(collection)
    if problem:
        raise usage("ingest", f"--collection {collection!r} is not a collection name: {problem}")
    sources = [builtin_source(args.sample, args.limit)] if args.sample else []
    sources += [
        file_source(
            path,
            args.format,
            field=args.field,
            column=args.column,
            split=args.split,
            encoding=args.encoding,
            keep_fields=args.keep_fields,
        )
        for path in args.inputs
    ]
    conn = connect(config)
    log.info("ingesting %d source(s) into %s.%s", len(sources), config.db, collection)
    report = ingest(
        conn,
        collection,
        sources,
        batch_size=args.batch_size,
        strict=args.strict,
        progress=not args.no_progress,
        dedup=args.dedup,
        report_file=args.report,
    )
    for line in report.lines():
        print(line)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from dsgpt2.db.mongo import connect
    from dsgpt2.db.validate import fix_collection, validate_corpus
    from dsgpt2.errors import CorpusValidationError

    config = load_config_arg(args)
    conn = connect(config)
    names = args.collection or list(config.collections)
    if args.fix:
        for name in names:
            for line in fix_collection(conn, name):
                print(line)
    reports = validate_corpus(conn, names)
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        for r in reports:
            print("\n".join(r.lines()))
    bad = [r.name for r in reports if not r.ok]
    if bad:
        raise CorpusValidationError(f"problems found in {', '.join(bad)}; apply the fixes above")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from dsgpt2.db.mongo import MongoWrapper, connect, read_meta, require_collections

    config = load_config_arg(args)
    require_collections(connect(config), args.config)
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
                "sources": [
                    {k: s.get(k) for k in ("label", "records", "inserted", "complete")}
                    for s in meta.get(name, {}).get("sources", {}).values()
                ],
            }
            for name, count, weight in zip(config.collections, wrapper.counts, weights, strict=True)
        ],
    }
    if args.json:
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
    from dsgpt2.db.mongo import with_retries

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
