"""The curation commands, each a pass of registered steps over the collections in place: dedup, curate (and
its report), decontaminate, langid, redact, and any step a plugin registers. Each command is made from
the registry (:data:`dsgpt2.curation.steps.STEPS`): its help and options are its steps'; they share the
pass's options (:class:`PassSettings`) and one runner."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dsgpt2.cli.common import (
    Command,
    check_writable,
    collection_names,
    config_option,
    load_connection,
    usage,
    verbose_option,
)
from dsgpt2.curation.curate import CurateSettings
from dsgpt2.curation.passes import PassSettings
from dsgpt2.curation.steps import Step, commands
from dsgpt2.settings.options import from_namespace


@dataclass(frozen=True, kw_only=True)
class ConnectionSettings:
    """The connection config and the log level: every pass command's first flags."""

    config: str = config_option()
    verbose: bool = verbose_option()


def run_passes(command: str, config_path: str, passes: PassSettings, steps: list[Step]) -> int:
    """Run each of ``steps`` over the collections of ``config_path`` (or ``--collection``) and print the
    reports, then what a run over part of the idx ranges leaves to another."""
    from dsgpt2.curation.passes import part_line, run_pass
    from dsgpt2.db.client import connect

    config = load_connection(config_path)
    names = collection_names(passes.collection, config, command)
    conn, split = connect(config), passes.split
    lines: list[str] = []
    for step in steps:
        report = run_pass(conn, names, step, batch_size=passes.batch_size, progress=not passes.no_progress,
                          split=split)  # fmt: skip
        lines += report.lines()
    lines += part_line(steps[-1], split)
    print("\n".join(lines))
    return 0


def run_steps(command: str, args: argparse.Namespace) -> int:
    """``dsgpt2 COMMAND``: the registered steps of ``command`` that its settings ask for, in order, over
    the collections (a command's own action first, where it has one and it is asked: ``curate
    report``)."""
    kinds = commands()[command]
    settings = {cls: from_namespace(cls, args) for kind in kinds for cls in kind.settings}
    passes = from_namespace(PassSettings, args)
    config = from_namespace(ConnectionSettings, args).config
    action = ACTIONS.get(command)
    if action is not None and (code := action(config, settings, passes)) is not None:
        return code
    steps = [step for kind in kinds if (step := kind.build(settings)) is not None]
    if not steps:
        raise usage(command, kinds[0].none_asked or "nothing to do")
    return run_passes(command, config, passes, steps)


def _curation_report(config_path: str, given: dict[type, Any], passes: PassSettings) -> int | None:
    """``dsgpt2 curate report``, when asked."""
    from dataclasses import asdict

    from dsgpt2.curation import report as curation_report
    from dsgpt2.db.client import connect

    settings: CurateSettings = given[CurateSettings]
    if settings.action != "report":
        return None
    plot = Path(settings.plot)
    check_writable(plot, "--plot", {"--config": config_path})
    config = load_connection(config_path)
    names = collection_names(passes.collection, config, "curate")
    parts = curation_report.summarize(connect(config, create=False), names, settings.examples)
    curation_report.plot(parts, plot)
    if settings.json:
        print(json.dumps({"collections": [asdict(p) for p in parts], "plot": str(plot)}, indent=2))
    else:
        print("\n".join([*curation_report.report_lines(parts), f"plot: {plot}"]))
    return 0


# What a command does instead of its steps when its settings ask (None: run the steps).
ACTIONS: dict[str, Callable[[str, dict[type, Any], PassSettings], int | None]] = {"curate": _curation_report}


def pass_command(name: str) -> Command:
    """The command ``name`` made from its registered steps: their help, their options between the
    connection's and the pass's."""
    kinds = commands()[name]
    about = next(kind.about for kind in kinds if kind.about is not None)
    own = tuple(dict.fromkeys(cls for kind in kinds for cls in kind.settings))
    return Command(
        name,
        help=about.help,
        description=about.description,
        epilog=about.epilog,
        settings=(ConnectionSettings, *own, PassSettings),
        handler=partial(run_steps, name),
    )


def added_commands(known: Sequence[Command]) -> list[Command]:
    """The commands of steps registered besides those of ``known`` (a plugin's), in their order."""
    names = {c.name for c in known}
    return [pass_command(name) for name in commands() if name not in names]


DEDUP = pass_command("dedup")
CURATE = pass_command("curate")
DECONTAMINATE = pass_command("decontaminate")
LANGID = pass_command("langid")
REDACT = pass_command("redact")
