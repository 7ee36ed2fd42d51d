"""The vocabulary commands: vocab download, vocab train."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    add_config,
    load_config_arg,
    usage,
)
from dsgpt2.settings.options import add_options, from_namespace

log = logging.getLogger("dsgpt2")


def add_vocab(sub: Any) -> None:
    vocab = sub.add_parser(
        "vocab",
        help="export the vocabulary corpus and train the BPE tokenizer",
        description="Build the vocabulary: `vocab download` exports text shards, `vocab train` learns BPE.",
    )
    vsub = vocab.add_subparsers(dest="vocab_command", metavar="STEP", required=True)

    p = vsub.add_parser(
        "download",
        help="export (a sample of) the collections to local text shards",
        description=(
            "Export the configured collections, all documents or a seeded sample, to "
            "OUT/shard-NNNNN.jsonl ({idx, text} per line) in parallel worker processes, each with its "
            "own MongoDB client. Finished shards are recorded in OUT/manifest.json: a re-run (after a "
            "crash, say) writes only the missing ones."
        ),
    )
    add_config(p)
    p.add_argument("--out", default="runs/vocab_corpus", help="shard directory (default: runs/vocab_corpus)")
    from dsgpt2.tokenizer.texts import DownloadSettings, Draw

    add_options(p, Draw)
    add_options(p, DownloadSettings)
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_vocab_download)

    p = vsub.add_parser(
        "train",
        help="train the byte-level BPE tokenizer from shards or straight from MongoDB",
        description=(
            "Train a byte-level BPE tokenizer (GPT-2 style) on the shards of `vocab download` or, with "
            "--from_mongo, on texts streamed from the collections. OUT then holds vocab.json, "
            "merges.txt, tokenizer.json and tokenizer_config.json: "
            "transformers.AutoTokenizer.from_pretrained(OUT) loads it. Special tokens take the first "
            "ids: <|endoftext|> 0, <|pad|> 1, then <|SPEAKER|> per --speakers, then <unusedN>."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", metavar="DIR", help="shard directory written by `vocab download`")
    src.add_argument(
        "--from_mongo", action="store_true", help="stream texts from the collections of --config"
    )
    p.add_argument("--config", metavar="JSON", help="connection config (with --from_mongo)")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.add_argument("--out", default="runs/tokenizer", help="tokenizer directory (default: runs/tokenizer)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a tokenizer already at --out (runs trained with it will refuse the new one)",
    )
    from dsgpt2.tokenizer.bpe import VocabSettings

    add_options(p, Draw)
    add_options(p, VocabSettings)
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_vocab_train)


def cmd_vocab_download(args: argparse.Namespace) -> int:

    from dataclasses import asdict

    from dsgpt2.tokenizer.texts import DownloadSettings, Draw, download

    draw, settings = from_namespace(Draw, args), from_namespace(DownloadSettings, args)
    config = load_config_arg(args)
    report = download(
        config, Path(args.out), **asdict(draw), **asdict(settings), progress=not args.no_progress
    )
    print("\n".join(report.lines()))
    return 0


def cmd_vocab_train(args: argparse.Namespace) -> int:

    from dsgpt2.documents import SkipTally
    from dsgpt2.tokenizer.bpe import VocabSettings, check_vocab_out, train_vocab
    from dsgpt2.tokenizer.texts import Draw, mongo_texts, shard_texts

    check_vocab_out(Path(args.out), args.overwrite)  # before any query

    settings, draw = from_namespace(VocabSettings, args), from_namespace(Draw, args)
    if args.from_mongo:
        if not args.config:
            raise usage("vocab train", "--from_mongo needs --config")
        config = load_config_arg(args)
        texts, wrapper = mongo_texts(config, draw.fraction, draw.count, draw.seed)
        skipped = wrapper.skipped
        source = f"{config.display_uri} {config.db}.{','.join(config.collections)}"
    else:
        if draw.sampled:
            raise usage("vocab train", "--fraction/--count go with --from_mongo; sample at `vocab download`")
        skipped = SkipTally()
        texts = shard_texts(Path(args.input), skipped=skipped)
        source = f"shards in {args.input}"
    report = train_vocab(
        texts,
        Path(args.out),
        settings,
        source,
        skipped=skipped,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    print("\n".join(report.lines()))
    return 0
