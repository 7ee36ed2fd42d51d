"""``dsgpt2 langid``: a language code and score on each document, from a model shipped in py3langid."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from dsgpt2.cli.common import config_option, load_connection, verbose_option
from dsgpt2.cli.corpus import PassSettings, _collections
from dsgpt2.settings.options import add_options, check_fields, from_namespace


@dataclass(frozen=True, kw_only=True)
class LangidSettings:
    """``dsgpt2 langid``: the connection; the pass's options are :class:`PassSettings`."""

    config: str = config_option()
    verbose: bool = verbose_option()

    def __post_init__(self) -> None:
        check_fields(self)


def add_langid(sub: Any, name: str) -> None:
    p = sub.add_parser(
        name,
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, LangidSettings)
    add_options(p, PassSettings)
    p.set_defaults(func=cmd_langid)


def cmd_langid(args: argparse.Namespace) -> int:
    from dsgpt2.curation.language import langid
    from dsgpt2.db.client import connect

    settings, passes = from_namespace(LangidSettings, args), from_namespace(PassSettings, args)
    config = load_connection(settings.config)
    names = _collections(passes.collection, config, "langid")
    split = passes.split
    report = langid(connect(config), names, passes.batch_size, progress=not passes.no_progress, split=split)
    lines = report.lines()
    if split.parts > 1:
        lines.append(
            f"part {split.part + 1}/{split.parts} done: the counts are those of the whole collection"
        )
    print("\n".join(lines))
    return 0
