"""The ``dsgpt2`` command: parse, build, run. Each subcommand maps to one function in
the modules of :mod:`dsgpt2.cli`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from dsgpt2 import __version__
from dsgpt2.cli import corpus, db, decontaminate, demo, infer, langid, redact, train, vocab
from dsgpt2.cli.common import by_command
from dsgpt2.exits import run_command
from dsgpt2.log import setup_logging
from dsgpt2.progress import interval_seconds
from dsgpt2.settings.argtypes import OneLineErrorParser, accept_hyphen_spellings
from dsgpt2.settings.runfile import COMMAND_TREE

DESCRIPTION = """\
Pretrain GPT-2 with DeepSpeed on a corpus stored in MongoDB.

Every subcommand reads a connection config (--config), a JSON file such as
  {"MONGO_CONNECTION_STRING": "mongodb://user@host:27017",
   "MONGO_CONNECTION_DB": "corpus", "COLLECTIONS": ["news", "wiki"]}
The environment variable MONGO_CONNECTION_STRING overrides the file's
connection string: keep passwords there, not in files. local://DIR is the
embedded database in the directory DIR: dsgpt2 starts its server when a command
needs it (`dsgpt2 db status|stop` show and end it).

A .yaml or .toml file given as --config is an experiment file instead: its
keys are the command's flags (flags typed after it override them), and its
`config` key names the connection config.

Typical first steps:
  dsgpt2 ingest --config configs/sample.json --sample stdlib
  dsgpt2 validate --config configs/sample.json
  dsgpt2 info --config configs/sample.json
  dsgpt2 train --config configs/recipes/demo.yaml
"""


def add_train(sub: Any, name: str) -> None:
    sub.add_parser(
        name,
        help="train the model (the same trainer as ds_trainer.py; `dsgpt2 train --help` lists its flags)",
        add_help=False,
    )


# What builds each command of the table of commands (runfile.COMMAND_TREE, which gives their order).
BUILDERS = by_command(
    add_train,
    corpus.add_ingest,
    corpus.add_index,
    corpus.add_dedup,
    corpus.add_curate,
    decontaminate.add_decontaminate,
    corpus.add_validate,
    corpus.add_info,
    langid.add_langid,
    redact.add_redact,
    vocab.add_vocab,
    train.add_tokenize,
    train.add_plan,
    train.add_lineage,
    infer.add_export,
    infer.add_evaluate,
    infer.add_generate,
    infer.add_chat,
    infer.add_serve,
    demo.add_demo,
    db.add_db,
)


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="dsgpt2", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"dsgpt2 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_TREE:
        BUILDERS[name](sub, name)
    # Not a command of the table: every argument is the deepspeed launcher's (and its script's).
    sub.add_parser(
        "launch",
        help="the deepspeed launcher, ended by Ctrl-C or SIGTERM as one process is: every rank saves, "
        "exit 0 (`dsgpt2 launch --help`)",
        add_help=False,
    )
    return accept_hyphen_spellings(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsgpt2`` command; user errors print one line and return their exit code."""
    argv = _local_rank_last(list(sys.argv[1:] if argv is None else argv))
    if argv[:1] == ["train"]:
        # The trainer's own parser (it imports DeepSpeed, so only when asked for).
        from dsgpt2.train.trainer import main as train

        return train(argv[1:], prog="dsgpt2 train")
    if argv[:1] == ["launch"]:
        # Every argument is the deepspeed launcher's (and its script's).
        from dsgpt2.train.launch import main as launch

        return launch(argv[1:])
    from dsgpt2.settings.runfile import parse_args

    args = parse_args(build_parser(), argv)
    setup_logging(verbose=getattr(args, "verbose", False))
    func: Callable[[argparse.Namespace], int] = args.func

    def command() -> int:
        if not getattr(args, "no_progress", True):
            interval_seconds()  # a bad DSGPT2_PROGRESS_SECONDS is refused before any work
        return func(args)

    return run_command("dsgpt2", command)


def _local_rank_last(argv: list[str]) -> list[str]:
    """``deepspeed --module dsgpt2 train ...`` runs ``python -m dsgpt2 --local_rank=N train ...``:
    the launcher's flag goes before the command, where only the command's parser knows it."""
    lead = [t for t in argv[:1] if t.startswith("--local_rank=")]
    return [*argv[len(lead) :], *lead]
