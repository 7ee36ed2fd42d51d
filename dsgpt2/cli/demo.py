"""The demo command: the whole pipeline in process on the built-in sample."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    load_config_arg,
)
from dsgpt2.settings.argtypes import positive_int

log = logging.getLogger("dsgpt2")


def add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on the built-in sample corpus, in process",
        description=(
            "Run every stage on the built-in sample corpus against the embedded database in OUT/db "
            "(local://, started for the demo and stopped after it): no server to set up, no download. "
            "Prints a summary and writes OUT/summary.json."
        ),
    )
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument(
        "--config",
        metavar="JSON",
        help="run against this MongoDB server and database instead (the demo's own collections "
        "there: stdlib, stdlib_chat)",
    )
    p.add_argument("--limit", type=positive_int, help="only the first N sample documents")
    p.add_argument("--steps", type=positive_int, default=1000, help="training steps (default 1000)")
    p.add_argument(
        "--chat_steps", type=positive_int, default=150, help="conversation finetuning steps (default 150)"
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:

    from dsgpt2.cli.pipeline import run_demo, summary_lines

    out = Path(args.out)
    server = load_config_arg(args) if args.config else None
    summary = run_demo(
        out,
        limit=args.limit,
        progress=not args.no_progress,
        steps=args.steps,
        chat_steps=args.chat_steps,
        server=server,
    )
    print("\n".join(summary_lines(summary, out)))
    return 0
