"""The curation commands, each a pass over the collections in place: dedup, curate (and its report),
decontaminate, langid, redact. They share the pass's options (:class:`PassSettings`) and one runner."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from dsgpt2.cli.common import (
    Command,
    check_writable,
    collection_names,
    config_option,
    load_connection,
    usage,
    verbose_option,
)
from dsgpt2.curation.minhash import NUM_PERM
from dsgpt2.curation.passes import Pass, PassSettings
from dsgpt2.curation.quality import RULES, THRESHOLDS
from dsgpt2.settings.argtypes import comma_list
from dsgpt2.settings.options import (
    NON_NEGATIVE_INT,
    POSITIVE_INT,
    RATIO,
    Checked,
    Range,
    from_namespace,
    option,
)

NGRAM = Range(int, 5)  # dsgpt2.curation.decontaminate.MIN_NGRAM: shorter n-grams match ordinary prose


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """The connection config and the log level: every pass command's first flags."""

    config: str = config_option()
    verbose: bool = verbose_option()


@dataclass(frozen=True, kw_only=True)
class DedupSettings(Checked):
    """``dsgpt2 dedup``: which duplicates, and how near is near."""

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
        check=NUM_PERM,
    )


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
    ngram: int = option(13, "words per n-gram shared with an evaluation text (GPT-3's 13)", check=NGRAM)


@dataclass(frozen=True, kw_only=True)
class RedactSettings(Checked):
    """``dsgpt2 redact``: the connection, and whether documents a run trained on may change."""

    force: bool = option(
        False,
        "redact documents a run has trained on all the same (their texts change under its checkpoints)",
    )


def run_passes(command: str, config_path: str, passes: PassSettings, steps: list[Pass]) -> int:
    """Run each of ``steps`` over the collections of ``config_path`` (or ``--collection``) and print the
    reports, then what a run over part of the idx ranges leaves to another."""
    from dsgpt2.curation.passes import part_line, run_pass
    from dsgpt2.db.client import connect

    config = load_connection(config_path)
    names = collection_names(passes.collection, config, command)
    conn, split = connect(config), passes.split
    lines: list[str] = []
    for step in steps:
        report = run_pass(conn, names, step, batch_size=passes.batch_size, progress=not passes.no_progress,
                          split=split)  # fmt: skip
        lines += report.lines()
    lines += part_line(steps[-1], split)
    print("\n".join(lines))
    return 0


def cmd_dedup(args: argparse.Namespace) -> int:
    from dsgpt2.curation.dedup import Hashing
    from dsgpt2.curation.minhash import LshParams
    from dsgpt2.curation.neardup import Signing

    settings, passes = from_namespace(DedupSettings, args), from_namespace(PassSettings, args)
    config = from_namespace(ConnectionSettings, args).config
    if not (settings.exact or settings.near):
        raise usage("dedup", "say which duplicates: --exact, --near, or both")
    steps: list[Pass] = [Hashing()] if settings.exact else []
    if settings.near:
        params = LshParams(threshold=settings.threshold, ngram=settings.ngram, num_perm=settings.num_perm)
        steps.append(Signing(params))
    return run_passes("dedup", config, passes, steps)


def cmd_curate(args: argparse.Namespace) -> int:
    from dsgpt2.curation.curate import Curation
    from dsgpt2.curation.quality import resolve_thresholds

    settings, passes = from_namespace(CurateSettings, args), from_namespace(PassSettings, args)
    config = from_namespace(ConnectionSettings, args).config
    if settings.action == "report":
        return _curation_report(config, settings, passes)
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
    thresholds = resolve_thresholds(overrides)
    return run_passes("curate", config, passes, [Curation(list(settings.rules), thresholds)])


def _curation_report(config_path: str, settings: CurateSettings, passes: PassSettings) -> int:
    from dataclasses import asdict

    from dsgpt2.curation import report as curation_report
    from dsgpt2.db.client import connect

    config = load_connection(config_path)
    names = collection_names(passes.collection, config, "curate")
    plot = Path(settings.plot)
    check_writable(plot, "--plot")
    parts = curation_report.summarize(connect(config, create=False), names, settings.examples)
    curation_report.plot(parts, plot)
    if settings.json:
        print(json.dumps({"collections": [asdict(p) for p in parts], "plot": str(plot)}, indent=2))
    else:
        print("\n".join([*curation_report.report_lines(parts), f"plot: {plot}"]))
    return 0


def cmd_decontaminate(args: argparse.Namespace) -> int:
    from dsgpt2.curation.decontaminate import Decontamination, load_sets

    settings, passes = from_namespace(DecontaminateSettings, args), from_namespace(PassSettings, args)
    config = from_namespace(ConnectionSettings, args).config
    if not settings.against:
        raise usage("decontaminate", "give the evaluation files: --against FILE...")
    names: list[str | None] = list(settings.name or [None] * len(settings.against))
    if len(names) != len(settings.against):
        raise usage(
            "decontaminate",
            f"--name given {len(names)} times for {len(settings.against)} --against files: one per file",
        )
    sets = load_sets(settings.against, names, settings.ngram)
    return run_passes("decontaminate", config, passes, [Decontamination(sets, settings.ngram)])


def cmd_langid(args: argparse.Namespace) -> int:
    from dsgpt2.curation.language import Labelling

    config, passes = from_namespace(ConnectionSettings, args).config, from_namespace(PassSettings, args)
    return run_passes("langid", config, passes, [Labelling()])


def cmd_redact(args: argparse.Namespace) -> int:
    from dsgpt2.curation.pii import Redaction

    settings, passes = from_namespace(RedactSettings, args), from_namespace(PassSettings, args)
    config = from_namespace(ConnectionSettings, args).config
    return run_passes("redact", config, passes, [Redaction(force=settings.force)])


DEDUP = Command(
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
    settings=(ConnectionSettings, DedupSettings, PassSettings),
    handler=cmd_dedup,
)

_LISTED = "; ".join(f"{name} ({rule}, default {default:g}): {what}"
                    for name, (default, rule, what) in THRESHOLDS.items())  # fmt: skip
CURATE = Command(
    "curate",
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
    settings=(ConnectionSettings, CurateSettings, PassSettings),
    handler=cmd_curate,
)

DECONTAMINATE = Command(
    "decontaminate",
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
    settings=(ConnectionSettings, DecontaminateSettings, PassSettings),
    handler=cmd_decontaminate,
)

LANGID = Command(
    "langid",
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
    settings=(ConnectionSettings, PassSettings),
    handler=cmd_langid,
)

REDACT = Command(
    "redact",
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
    settings=(ConnectionSettings, RedactSettings, PassSettings),
    handler=cmd_redact,
)
