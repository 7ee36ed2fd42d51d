"""The vocabulary commands: vocab download, vocab train."""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from dsgpt2.cli.common import (
    Command,
    Flags,
    config_option,
    load_connection,
    no_progress_option,
    usage,
    verbose_option,
)
from dsgpt2.settings.options import OneOf, from_namespace, option
from dsgpt2.tokenizer.bpe import VocabSettings
from dsgpt2.tokenizer.texts import DownloadSettings, Draw

log = logging.getLogger("dsgpt2")
SOURCE = OneOf(required=True)  # vocab train reads shards or the collections
SOURCE_FLAGS = ["input", "from_mongo", "config", "verbose", "out", "overwrite"]


@dataclass(frozen=True, kw_only=True)
class VocabDownloadSettings:
    """``dsgpt2 vocab download``: the connection and where the shards go (the draw and the work:
    :class:`Draw`, :class:`DownloadSettings`)."""

    config: str = config_option()
    verbose: bool = verbose_option()
    out: Path = option(Path("runs/vocab_corpus"), "shard directory")
    no_progress: bool = no_progress_option()


@dataclass(frozen=True, kw_only=True)
class VocabTrainSettings:
    """``dsgpt2 vocab train``: the texts it learns from and where the tokenizer goes (how it learns:
    :class:`VocabSettings`)."""

    input: Path | None = option(
        None, "shard directory written by `vocab download`", metavar="DIR", one_of=SOURCE
    )
    from_mongo: bool = option(False, "stream texts from the collections of --config", one_of=SOURCE)
    config: str | None = config_option("connection config (with --from_mongo)", required=False)
    verbose: bool = verbose_option()
    out: Path = option(Path("runs/tokenizer"), "tokenizer directory")
    overwrite: bool = option(
        False, "replace a tokenizer already at --out (runs trained with it will refuse the new one)"
    )
    no_progress: bool = no_progress_option()


def cmd_vocab_download(args: argparse.Namespace) -> int:
    from dsgpt2.tokenizer.texts import download

    target = from_namespace(VocabDownloadSettings, args)
    draw, settings = from_namespace(Draw, args), from_namespace(DownloadSettings, args)
    config = load_connection(target.config)
    report = download(config, target.out, **asdict(draw), **asdict(settings), progress=not target.no_progress)
    print("\n".join(report.lines()))
    return 0


def cmd_vocab_train(args: argparse.Namespace) -> int:
    from dsgpt2.documents import SkipTally
    from dsgpt2.tokenizer.bpe import check_vocab_out, train_vocab
    from dsgpt2.tokenizer.texts import mongo_texts, shard_texts

    source = from_namespace(VocabTrainSettings, args)
    check_vocab_out(source.out, source.overwrite)  # before any query

    settings, draw = from_namespace(VocabSettings, args), from_namespace(Draw, args)
    if source.from_mongo:
        if not source.config:
            raise usage("vocab train", "--from_mongo needs --config")
        config = load_connection(source.config)
        texts, wrapper = mongo_texts(config, draw.fraction, draw.count, draw.seed)
        skipped = wrapper.skipped
        origin = f"{config.display_uri} {config.db}.{','.join(config.collections)}"
    else:
        if draw.sampled:
            raise usage("vocab train", "--fraction/--count go with --from_mongo; sample at `vocab download`")
        skipped = SkipTally()
        texts = shard_texts(source.input, skipped=skipped)
        origin = f"shards in {source.input}"
    report = train_vocab(
        texts,
        source.out,
        settings,
        origin,
        skipped=skipped,
        progress=not source.no_progress,
        overwrite=source.overwrite,
    )
    print("\n".join(report.lines()))
    return 0


VOCAB = Command(
    "vocab",
    help="export the vocabulary corpus and train the BPE tokenizer",
    description="Build the vocabulary: `vocab download` exports text shards, `vocab train` learns BPE.",
    steps=(
        Command(
            "download",
            help="export (a sample of) the collections to local text shards",
            description=(
                "Export the configured collections, all documents or a seeded sample, to "
                "OUT/shard-NNNNN.jsonl ({idx, text} per line) in parallel worker processes, each with its "
                "own MongoDB client. Finished shards are recorded in OUT/manifest.json: a re-run (after a "
                "crash, say) writes only the missing ones."
            ),
            settings=(
                Flags(VocabDownloadSettings, only=["config", "verbose", "out"]),
                Draw,
                DownloadSettings,
                Flags(VocabDownloadSettings, only=["no_progress"]),
            ),
            handler=cmd_vocab_download,
        ),
        Command(
            "train",
            help="train the byte-level BPE tokenizer from shards or straight from MongoDB",
            description=(
                "Train a byte-level BPE tokenizer (GPT-2 style) on the shards of `vocab download` or, with "
                "--from_mongo, on texts streamed from the collections. OUT then holds vocab.json, "
                "merges.txt, tokenizer.json and tokenizer_config.json: "
                "transformers.AutoTokenizer.from_pretrained(OUT) loads it. Special tokens take the first "
                "ids: <|endoftext|> 0, <|pad|> 1, then <|SPEAKER|> per --speakers, then <unusedN>."
            ),
            settings=(
                Flags(
                    VocabTrainSettings, only=["input", "from_mongo", "config", "verbose", "out", "overwrite"]
                ),
                Draw,
                VocabSettings,
                Flags(VocabTrainSettings, only=["no_progress"]),
            ),
            handler=cmd_vocab_train,
        ),
    ),
)
