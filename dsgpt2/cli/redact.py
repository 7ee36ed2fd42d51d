"""``dsgpt2 redact``: e-mail addresses, IP addresses and phone numbers replaced in the documents' text."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from dsgpt2.cli.common import config_option, load_connection, verbose_option
from dsgpt2.cli.corpus import PassSettings, _collections
from dsgpt2.settings.options import add_options, check_fields, from_namespace, option


@dataclass(frozen=True, kw_only=True)
class RedactSettings:
    """``dsgpt2 redact``: the connection, and whether documents a run trained on may change."""

    config: str = config_option()
    verbose: bool = verbose_option()
    force: bool = option(
        False,
        "redact documents a run has trained on all the same (their texts change under its checkpoints)",
    )

    def __post_init__(self) -> None:
        check_fields(self)


def add_redact(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, RedactSettings)
    add_options(p, PassSettings)
    p.set_defaults(func=cmd_redact)


def cmd_redact(args: argparse.Namespace) -> int:
    from dsgpt2.curation.pii import redact_collections
    from dsgpt2.db.client import connect

    settings, passes = from_namespace(RedactSettings, args), from_namespace(PassSettings, args)
    config = load_connection(settings.config)
    names = _collections(passes.collection, config, "redact")
    report = redact_collections(
        connect(config),
        names,
        passes.batch_size,
        force=settings.force,
        progress=not passes.no_progress,
        split=passes.split,
    )
    print("\n".join(report.lines()))
    return 0
