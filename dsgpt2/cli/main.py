"""The ``dsgpt2`` command: parse, build, run. The table of commands (:data:`COMMANDS`) gives each
subcommand its flags and the function in the modules of :mod:`dsgpt2.cli` that runs it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from dsgpt2 import __version__
from dsgpt2.cli import corpus, curation, db, demo, infer, train, vocab
from dsgpt2.cli.common import Command, section_names
from dsgpt2.exits import ignore_late_interrupts, run_command
from dsgpt2.heap import start_up
from dsgpt2.log import setup_logging
from dsgpt2.progress import interval_seconds
from dsgpt2.settings.argtypes import OneLineErrorParser, accept_hyphen_spellings
from dsgpt2.settings.runfile import parse_args

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


def run_trainer(argv: Sequence[str], prog: str = "dsgpt2 train") -> int:
    """``dsgpt2 train`` and ``ds_trainer.py``: the trainer's own parser (it imports DeepSpeed, so only
    when asked for), which knows the other commands' tables of an experiment file."""
    with start_up():  # torch and the trainer's modules: see dsgpt2.heap
        from dsgpt2.train.trainer import main as train

    return train(list(argv), prog=prog, sections=SECTIONS)


def run_launcher(argv: Sequence[str]) -> int:
    from dsgpt2.train.launch import main as launch

    return launch(list(argv))


TRAIN = Command(
    "train",
    help="train the model (the same trainer as ds_trainer.py; `dsgpt2 train --help` lists its flags)",
    own_parser=run_trainer,
)
LAUNCH = Command(
    "launch",
    help="the deepspeed launcher, ended by Ctrl-C or SIGTERM as one process is: every rank saves, "
    "exit 0 (`dsgpt2 launch --help`)",
    own_parser=run_launcher,
    # Every argument is the deepspeed launcher's (and its script's): the script it starts reads the file.
    run_file=False,
)

# Every dsgpt2 command, in the order `dsgpt2 --help` lists them: the one list of them. The parser, the
# tables an experiment file may hold and the reference pages are made from it.
COMMANDS: tuple[Command, ...] = (
    TRAIN,
    corpus.INGEST,
    corpus.INDEX,
    curation.DEDUP,
    curation.CURATE,
    curation.DECONTAMINATE,
    corpus.VALIDATE,
    corpus.INFO,
    corpus.DROP,
    curation.LANGID,
    curation.REDACT,
    vocab.VOCAB,
    train.TOKENIZE,
    train.PLAN,
    train.LINEAGE,
    infer.EXPORT,
    infer.EVALUATE,
    infer.GENERATE,
    infer.CHAT,
    infer.SERVE,
    demo.DEMO,
    db.DB,
    LAUNCH,
)
SECTIONS = section_names(COMMANDS)


def every_command() -> tuple[Command, ...]:
    """:data:`COMMANDS`, then the commands of curation steps registered since (a plugin's)."""
    return (*COMMANDS, *curation.added_commands(COMMANDS))


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(
        prog="dsgpt2", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"dsgpt2 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in every_command():
        command.add_to(sub)
    return accept_hyphen_spellings(parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dsgpt2`` command; user errors print one line and return their exit code."""
    program = argv is None  # the process's own command (not a call from Python)
    argv = _local_rank_last(list(sys.argv[1:] if argv is None else argv))
    own = {c.name: c.own_parser for c in COMMANDS if c.own_parser is not None}
    if argv[:1] and argv[0] in own:
        return own[argv[0]](argv[1:])
    args = parse_args(build_parser(), argv, sections=section_names(every_command()))
    setup_logging(verbose=getattr(args, "verbose", False))
    func: Callable[[argparse.Namespace], int] = args.func

    def command() -> int:
        if not getattr(args, "no_progress", True):
            interval_seconds()  # a bad DSGPT2_PROGRESS_SECONDS is refused before any work
        return func(args)

    try:
        return run_command("dsgpt2", command)
    finally:
        if program:
            ignore_late_interrupts()


def _local_rank_last(argv: list[str]) -> list[str]:
    """``deepspeed --module dsgpt2 train ...`` runs ``python -m dsgpt2 --local_rank=N train ...``:
    the launcher's flag goes before the command, where only the command's parser knows it."""
    lead = [t for t in argv[:1] if t.startswith("--local_rank=")]
    return [*argv[len(lead) :], *lead]
