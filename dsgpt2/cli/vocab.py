"""The vocabulary commands: vocab download, vocab train, vocab push."""

from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
from dsgpt2.tokenizer.bpe import VocabSettings, tokenizer_digest
from dsgpt2.tokenizer.texts import DownloadSettings, Draw

log = logging.getLogger("dsgpt2")
SOURCE = OneOf(required=True)  # vocab train reads shards or the collections


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
    config: str | None = config_option(
        "connection config (with --from_mongo, or --out gridfs:NAME)", required=False
    )
    verbose: bool = verbose_option()
    out: Path = option(
        Path("runs/tokenizer"), "tokenizer directory, or gridfs:NAME to keep it in the database of --config"
    )
    overwrite: bool = option(
        False, "replace a tokenizer already at --out (runs trained with it will refuse the new one)"
    )
    no_progress: bool = no_progress_option()


@dataclass(frozen=True, kw_only=True)
class VocabPushSettings:
    """``dsgpt2 vocab push``: a tokenizer directory and its place in the database."""

    directory: Path = option(
        help="the tokenizer directory (vocab train's --out)", positional=True, metavar="DIR"
    )
    out: str = option(help="where it goes: gridfs:NAME (a run takes it with --vocab_dir gridfs:NAME)")
    config: str = config_option("connection config of the database")
    overwrite: bool = option(
        False, "replace a tokenizer stored under the name (runs trained with it will refuse the new one)"
    )
    verbose: bool = verbose_option()


def _stored_out(command: str, out: Path | str, config: str | None, overwrite: bool) -> Any:
    """The stored tokenizer ``out`` names (``gridfs:NAME``), refused if taken and not ``overwrite``;
    None for a directory."""
    from dsgpt2.db.client import connect
    from dsgpt2.tokenizer.stored import stored_tokenizer, tokenizer_store

    if stored_tokenizer(out) is None:
        return None
    if not config:
        raise usage(command, f"--out {out} keeps the tokenizer in the database: add --config c.json")
    stored = tokenizer_store(out, connect(load_connection(config)))
    assert stored is not None
    stored.check_free(overwrite)
    return stored


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
    stored = _stored_out("vocab train", source.out, source.config, source.overwrite)  # before any work
    if stored is None:
        check_vocab_out(source.out, source.overwrite)

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
    # A scratch directory only for a tokenizer kept in the database (one killed run would leave it behind).
    scratch = (
        tempfile.TemporaryDirectory(prefix="dsgpt2-vocab-")
        if stored is not None
        else contextlib.nullcontext("")
    )
    with scratch as where:
        out = source.out if stored is None else Path(where) / "tokenizer"
        report = train_vocab(
            texts,
            out,
            settings,
            origin,
            skipped=skipped,
            progress=not source.no_progress,
            overwrite=source.overwrite,
        )
        lines = report.lines()
        if stored is not None:  # its first line names the scratch directory
            digest = stored.push(out, overwrite=source.overwrite)
            lines[0] = _stored_line("tokenizer: it", stored.location, digest)
    print("\n".join(lines))
    return 0


def _stored_line(what: str, location: str, digest: str) -> str:
    """The line saying where a tokenizer went."""
    return f"{what} is in the database as {location} (hash {digest}); a run takes it: --vocab_dir {location}"


def cmd_vocab_push(args: argparse.Namespace) -> int:
    s = from_namespace(VocabPushSettings, args)
    # Refused by push itself where another tokenizer holds the name: the same one is already there.
    stored = _stored_out("vocab push", s.out, s.config, overwrite=True)
    if stored is None:
        raise usage("vocab push", f"--out {s.out}: give where in the database, gridfs:NAME")
    there = (s.directory / "tokenizer.json").is_file() and stored.holds(tokenizer_digest(s.directory))
    digest = stored.push(s.directory, overwrite=s.overwrite)
    pushed = f"{s.directory} (already there)" if there else str(s.directory)
    print(_stored_line(pushed, stored.location, digest))
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
        Command(
            "push",
            help="store a tokenizer directory in the database, for nodes that share only it",
            description=(
                "Upload a tokenizer directory to the GridFS bucket `tokenizers` of the database of --config, "
                "as gridfs:NAME: each file with its size and SHA-256, then a marker naming them and the "
                "tokenizer's hash (an upload that dies part-way stores no tokenizer). A run takes it with "
                "--vocab_dir gridfs:NAME, every node fetching its own copy; `vocab train --out gridfs:NAME` "
                "trains and stores in one command."
            ),
            settings=(VocabPushSettings,),
            handler=cmd_vocab_push,
        ),
    ),
)
