"""The decontaminate command: documents sharing a word n-gram with an evaluation set, marked in place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import config_option, load_connection, usage, verbose_option
from dsgpt2.cli.corpus import PassSettings, _collections
from dsgpt2.settings.options import Range, add_options, check_fields, from_namespace, option

NGRAM = Range(int, 5)  # dsgpt2.curation.decontaminate.MIN_NGRAM: shorter n-grams match ordinary prose


@dataclass(frozen=True, kw_only=True)
class DecontaminateSettings:
    """``dsgpt2 decontaminate``: the evaluation files, their set names and the n-gram size."""

    config: str = config_option()
    verbose: bool = verbose_option()
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

    def __post_init__(self) -> None:
        check_fields(self)


def add_decontaminate(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, DecontaminateSettings)
    add_options(p, PassSettings)
    p.set_defaults(func=cmd_decontaminate)


def cmd_decontaminate(args: argparse.Namespace) -> int:
    from dsgpt2.curation.decontaminate import decontaminate, load_sets
    from dsgpt2.db.client import connect

    settings, passes = from_namespace(DecontaminateSettings, args), from_namespace(PassSettings, args)
    if not settings.against:
        raise usage("decontaminate", "give the evaluation files: --against FILE...")
    names: list[str | None] = list(settings.name or [None] * len(settings.against))
    if len(names) != len(settings.against):
        raise usage(
            "decontaminate",
            f"--name given {len(names)} times for {len(settings.against)} --against files: one per file",
        )
    sets = load_sets(settings.against, names, settings.ngram)
    config = load_connection(settings.config)
    collections = _collections(passes.collection, config, "decontaminate")
    report = decontaminate(
        connect(config),
        collections,
        sets,
        settings.ngram,
        passes.batch_size,
        progress=not passes.no_progress,
        split=passes.split,
    )
    lines = report.lines()
    split = passes.split
    if split.parts > 1:
        lines.append(f"part {split.part + 1}/{split.parts} done: the sets are recorded as checked once a "
                     "run without --part has read what the parts left")  # fmt: skip
    print("\n".join(lines))
    return 0
