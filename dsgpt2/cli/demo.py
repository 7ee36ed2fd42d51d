"""The demo command: the whole pipeline in process on the built-in sample."""

from __future__ import annotations

import argparse
import logging

from dsgpt2.cli.common import Command, load_connection
from dsgpt2.cli.pipeline import DemoSettings
from dsgpt2.files import check_writable_dir
from dsgpt2.settings.options import from_namespace

log = logging.getLogger("dsgpt2")


def cmd_demo(args: argparse.Namespace) -> int:
    from dsgpt2.cli.pipeline import run_demo, summary_lines

    s = from_namespace(DemoSettings, args)
    check_writable_dir(s.out, "--out")  # before the first stage, not at its first file
    server = load_connection(s.config) if s.config else None
    summary = run_demo(
        s.out,
        limit=s.limit,
        progress=not s.no_progress,
        steps=s.steps,
        chat_steps=s.chat_steps,
        server=server,
    )
    print("\n".join(summary_lines(summary, s.out)))
    return 0


DEMO = Command(
    "demo",
    help="run the whole pipeline on the built-in sample corpus, in process",
    description="Run every stage on the built-in sample corpus against the embedded database in OUT/db "
    "(local://, started for the demo and stopped after it): no server to set up, no download. "
    "Prints a summary and writes OUT/summary.json.",
    settings=(DemoSettings,),
    handler=cmd_demo,
)
