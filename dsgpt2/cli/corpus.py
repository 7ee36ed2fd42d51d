"""The corpus commands: ingest, index, validate, info, drop."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    Command,
    check_writable,
    collection_names,
    config_option,
    load_connection,
    no_progress_option,
    usage,
    verbose_option,
)
from dsgpt2.corpus.formats import FORMATS
from dsgpt2.corpus.records import ReadOptions
from dsgpt2.curation.steps import ingest_switches
from dsgpt2.db.config import collection_name_problem
from dsgpt2.db.filters import conjoin
from dsgpt2.db.summaries import count_numbered
from dsgpt2.settings.options import (
    POSITIVE_INT,
    Checked,
    from_namespace,
    option,
)

log = logging.getLogger("dsgpt2")


@dataclass(frozen=True, kw_only=True)
class IngestSettings(Checked):
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
    batch_size: int = option(1000, "documents per insert", check=POSITIVE_INT)
    strict: bool = option(False, "stop at the first unusable record, naming its file and line")
    report: str | None = option(
        None,
        "write where each skipped record is, one JSON object a line: file and line (Parquet, Arrow: "
        "row_group and row) and the reason, for the records this run read; the log names the first few",
        metavar="FILE.jsonl",
    )


def step_switches() -> type:
    """``dsgpt2 ingest``'s switch of each registered step that runs at ingest (``--dedup``, ``--pii``, a
    plugin's), as a settings class made when the parser is built."""
    fields = [(kind.at_ingest.flag, bool, option(False, kind.at_ingest.help))
              for kind in ingest_switches() if kind.at_ingest is not None]  # fmt: skip
    return make_dataclass("IngestSteps", fields, frozen=True, kw_only=True)


@dataclass(frozen=True, kw_only=True)
class ProgressSettings:
    """The progress switch, after every other flag."""

    no_progress: bool = no_progress_option()


@dataclass(frozen=True, kw_only=True)
class IndexSettings(Checked):
    """``dsgpt2 index``: the collection to number in place."""

    config: str = config_option()
    verbose: bool = verbose_option()
    collection: str = option(help="the collection to number")
    field: str = option("text", "the field holding each document's text")
    batch_size: int = option(1000, "documents numbered per bulk write", check=POSITIVE_INT)
    no_progress: bool = no_progress_option()


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


@dataclass(frozen=True, kw_only=True)
class DropSettings:
    """``dsgpt2 drop``: which collections, and the confirmation."""

    config: str = config_option()
    verbose: bool = verbose_option()
    collection: tuple[str, ...] = option(help="the collection to drop (repeatable)", repeat=True)
    yes: bool = option(False, "drop them: without it the command says what it would drop, and drops nothing")


def cmd_drop(args: argparse.Namespace) -> int:
    from dsgpt2.db.client import connect, require_collections
    from dsgpt2.db.idx import largest_idx
    from dsgpt2.db.meta import drop_collection, read_meta

    s = from_namespace(DropSettings, args)
    config = load_connection(s.config)
    conn = connect(config, create=False)
    names = list(dict.fromkeys(s.collection))
    for name in names:
        problem = config.records_problem(name)
        if problem:
            raise usage("drop", f"--collection {name}: {problem}")
    require_collections(conn, names)
    meta = read_meta(conn, names)
    held = []
    for name in names:
        top = largest_idx(conn, name, f"reading {name}: last idx")
        trained = (meta.get(name) or {}).get("trained") or {}
        by = f"; the run {trained['run']} trained on it" if trained.get("run") else ""
        held.append(f"{name} ({0 if top is None else top + 1} documents{by})")
    where = f"{config.display_uri} ({config.db})"
    if not s.yes:
        raise usage("drop", f"{', '.join(held)} in {where}: add --yes to drop them with their ingest records "
                            "and marks (nothing can bring them back)")  # fmt: skip
    for name, line in zip(names, held, strict=True):
        drop_collection(conn, name)
        print(f"dropped {line} from {where}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from dsgpt2.db.client import connect
    from dsgpt2.db.numbering import index_collection

    settings = from_namespace(IndexSettings, args)
    config = load_connection(settings.config)
    name, field = settings.collection, settings.field
    problem = collection_name_problem(name) or config.records_problem(name)
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
    from dsgpt2.corpus.formats import file_source
    from dsgpt2.corpus.ingest import ingest
    from dsgpt2.corpus.readers import builtin_source
    from dsgpt2.db.client import connect

    s, read = from_namespace(IngestSettings, args), from_namespace(ReadOptions, args)
    if not s.inputs and not s.sample:
        raise usage("ingest", "give input FILEs or --sample stdlib")
    if s.limit and not s.sample:
        raise usage("ingest", "--limit goes with --sample")
    if s.report is not None:  # before any document is stored: a re-run could not write the report then
        inputs = {"--config": s.config, **{f"input {path}": path for path in s.inputs}}
        check_writable(Path(s.report), "--report", inputs)
    config = load_connection(s.config)
    collection = config.collections[0] if s.collection is None else s.collection
    problem = collection_name_problem(collection) or config.records_problem(collection)
    if problem:
        raise usage("ingest", f"--collection {collection!r} is not a collection name: {problem}")
    sources = [builtin_source(s.sample, s.limit)] if s.sample else []
    sources += [file_source(path, s.format, read) for path in s.inputs]
    conn = connect(config)
    log.info("ingesting %d source(s) into %s.%s", len(sources), config.db, collection)
    report = ingest(
        conn,
        collection,
        sources,
        batch_size=s.batch_size,
        strict=s.strict,
        progress=not from_namespace(ProgressSettings, args).no_progress,
        steps=[kind.for_ingest() for kind in ingest_switches() if getattr(args, kind.at_ingest.flag, False)],
        report_file=s.report,
    )
    for line in report.lines():
        print(line)
    if collection not in config.collections and report.count:
        print(f"note: {collection!r} is not in the COLLECTIONS of {s.config}; add it there to train on it")
    empty = [r.label for r in report.sources if r.read == 0 and not (r.already_done or r.resumed_at)]
    if empty:
        raise usage("ingest", f"{', '.join(empty)}: no record in it; nothing was read (check the file, "
                              "--format and --field)")  # fmt: skip
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from dsgpt2.db.client import connect, require_collections
    from dsgpt2.db.validate import fix_collection, validate_corpus
    from dsgpt2.errors import CorpusValidationError

    settings = from_namespace(ValidateSettings, args)
    config = load_connection(settings.config)
    names = collection_names(settings.collection, config, "validate")  # the toolkit's own: refused
    conn = connect(config, create=False)
    require_collections(conn, names)
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
    require_collections(connect(config, create=False))
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
    info["stored_checkpoints"] = _stored_runs(wrapper.connection)
    info["stored_tokenizers"] = _stored_tokenizers(wrapper.connection)
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
        span = f"idx 0-{c['count'] - 1}" if c["count"] else "no idx yet"
        cleaned = f"text cleaner v{c['cleaner_version']}" if c["cleaner_version"] else "text cleaner unknown"
        print(f"  {c['name']}: {c['count']} documents ({span}), {share}; {cleaned}")
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
    for stored in info["stored_checkpoints"]:
        print(f"  checkpoints {stored['location']}: latest {stored['latest']}")
    for stored in info["stored_tokenizers"]:
        print(f"  tokenizer {stored['location']}: hash {stored['hash']}")
    return 0


def _stored_runs(conn: Any) -> list[dict[str, Any]]:
    """The runs whose checkpoints are in this database (``--ckpt_dir gridfs:RUN``), with their latest."""
    import tempfile
    from pathlib import Path

    from dsgpt2.checkpoints.format import CHECKPOINTS
    from dsgpt2.db.blobs import BlobStore
    from dsgpt2.stores.gridfs import SCHEME

    store = BlobStore(conn, CHECKPOINTS.name)
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in store.names(""):
            if name.endswith("/latest"):
                run = name.removesuffix("/latest")
                latest = (store.get_text(name, Path(scratch) / "latest") or "").strip()
                out.append({"location": f"{SCHEME}:{run}", "latest": latest})
    return out


def _stored_tokenizers(conn: Any) -> list[dict[str, Any]]:
    """The tokenizers kept in this database (``--vocab_dir gridfs:NAME``), with their hash."""

    from dsgpt2.db.blobs import BlobStore
    from dsgpt2.tokenizer.stored import BUCKET, MARKER, StoredTokenizer

    out = []
    for name in BlobStore(conn, BUCKET).names(""):
        if name.endswith("/" + MARKER):
            stored = StoredTokenizer(conn, name.removesuffix("/" + MARKER))
            out.append({"location": stored.location, "hash": (stored.marker() or {}).get("tokenizer")})
    return out


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

    query = wrapper.config.filter_query
    if query is None:
        return {}
    conn, out = wrapper.connection, {}
    for name, count in zip(wrapper.collections, wrapper.counts, strict=True):
        q = conjoin({"idx": {"$lt": count}}, query)
        out[name] = count_numbered(conn, name, q, f"counting {name}")
    return out


INGEST = Command(
    "ingest",
    help="load text files or the built-in sample into a collection",
    description="Load documents into a collection: each record's text is kept as `form`, cleaned into "
    "`filt_text` and numbered with `idx` after the collection's last one. Interrupted and "
    "re-run with the same arguments, it resumes without duplicating or skipping records. "
    "Text files may be gzipped. Parquet (FineWeb's layout: text, id, url, dump, ...), Arrow "
    "files and `datasets` save_to_disk directories are read in record batches (bounded "
    "memory); --keep_fields stores chosen columns on each document.",
    epilog="examples:\n"
    "  dsgpt2 ingest --config c.json --sample stdlib\n"
    "  dsgpt2 ingest --config c.json --collection news news.jsonl.gz --field body\n"
    "  dsgpt2 ingest --config c.json --collection books --split paragraph books/*.txt\n"
    "  dsgpt2 ingest --config c.json --collection fineweb \\\n"
    "      --keep_fields id,url,dump,language_score fineweb/data/CC-MAIN-2024-10/*.parquet\n"
    "  dsgpt2 ingest --config c.json --collection wiki wiki_saved/   # Dataset.save_to_disk\n"
    "  dsgpt2 ingest --config c.json --collection chats --format conversation chats.jsonl",
    settings=(IngestSettings, ReadOptions, step_switches, ProgressSettings),
    handler=cmd_ingest,
)


INDEX = Command(
    "index",
    help="number a collection already in MongoDB in place (idx, unique index, meta_info)",
    description="Make a collection that another application wrote into a training collection, without a "
    "copy: each document without an idx gets the next number in _id order, the unique idx index "
    "is built (sparse: documents without idx may still be inserted) and meta_info records the "
    "count. Killed and re-run, it numbers every document exactly once; run again later, it "
    "numbers the documents added since. Training reads the documents' --field through "
    "TEXT_FIELD in the connection config.",
    epilog="example:\n  dsgpt2 index --config c.json --collection articles --field body",
    settings=(IndexSettings,),
    handler=cmd_index,
)


VALIDATE = Command(
    "validate",
    help="check idx, indexes and counts of the collections",
    description="Check each collection for what training relies on: integer idx values 0..n-1, each once, "
    "a unique index on idx, and a matching count in meta_info. Prints each problem with its "
    "fix; exits 1 when there is one. --fix creates a missing index and records the count.",
    settings=(ValidateSettings,),
    handler=cmd_validate,
)


INFO = Command(
    "info",
    help="show the configured collections, their counts and ingest history",
    description="Show what the config points at: hosts, database, collections and meta_info.",
    settings=(InfoSettings,),
    handler=cmd_info,
)


DROP = Command(
    "drop",
    help="drop collections with their ingest records and marks",
    description="Drop collections of the database with their meta_info entries (ingest history, counts, "
    "curation records): what re-reading an input another way needs (another --encoding, --field or "
    "--split into the same name). Without --yes it names what it would drop and drops nothing. Runs "
    "that trained on a dropped collection cannot resume or replay their reading.",
    epilog="example:\n  dsgpt2 drop --config c.json --collection news --yes",
    settings=(DropSettings,),
    handler=cmd_drop,
)
