"""Experiment files: a command's flags kept in a YAML or TOML file (``--config run.yaml``).

Every key is one of the command's flags, spelled as on the command line without the dashes
(``train_iters: 2000``, ``early_stopping: true``, ``collection: [news, wiki]``). The file's values
become the parser's defaults, so a flag typed on the command line overrides the file. A key the
command does not have, or a value of the wrong type, is one line naming the file and the key.

One file can serve several commands: top-level keys apply to the command that reads the file, and a
table named for a command (``[train]``, ``[evaluate]``, ``[vocab.train]`` in TOML; ``train:`` in
YAML) holds keys for that command alone, over the top-level ones. Tables for other commands are left
to them.

``--config FILE.json`` keeps its meaning everywhere (the MongoDB connection config); a file ending
in ``.yaml``, ``.yml`` or ``.toml`` is an experiment file, and its ``config`` key names the JSON.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from dsgpt2.errors import ConfigError
from dsgpt2.files import not_a_file
from dsgpt2.log import process_rank
from dsgpt2.settings.options import action_of, is_switch, settable_actions, subcommands, takes_many
from dsgpt2.settings.shipped import shipped_if_absent

log = logging.getLogger(__name__)

SUFFIXES = (".yaml", ".yml", ".toml")
YAML_WORDS = {False: "off", True: "on"}
FLAG = "--config"

# The flags (without their dashes) whose value came from the experiment file this process read, not
# from the command line: an error quoting one names the file (:func:`name_file_values`).
_FROM_FILE: dict[str, Path] = {}
# The flags (without dashes) the user typed under another name this parser reads them by: the trainer's
# ``--config FILE.json`` is its ``--config_train``; an error quoting one says it as typed.
_TYPED_AS: dict[str, str] = {}


def is_run_file(value: str) -> bool:
    return Path(value).suffix.lower() in SUFFIXES


def find_run_file(argv: Sequence[str]) -> tuple[list[str], Path | None]:
    """``argv`` without its ``--config FILE.yaml|.toml`` and that file (None: no experiment file)."""
    rest: list[str] = []
    found: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        value = None
        if token == FLAG and i + 1 < len(argv):
            value, step = argv[i + 1], 2
        elif token.startswith(FLAG + "="):
            value, step = token[len(FLAG) + 1 :], 1
        if value is not None and is_run_file(value):
            found.append(value)
            i += step
            continue
        rest.append(token)
        i += 1
    if len(found) > 1:
        raise ConfigError(f"{FLAG}: one experiment file at a time, got {', '.join(found)}")
    return rest, Path(found[0]) if found else None


def read_run_file(path: Path) -> dict[str, Any]:
    """The file's mapping; a missing, unreadable or malformed file is one line."""
    why = not_a_file(path)
    if why is not None:
        raise ConfigError(f"{FLAG} {path}: {why}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({exc})") from None
    if path.suffix.lower() == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{FLAG} {path}: not valid TOML ({exc})") from None
    else:
        import yaml

        try:
            data = yaml.load(text, Loader=_unique_keys_loader())  # a SafeLoader: no Python tags
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            problem = getattr(exc, "problem", None) or type(exc).__name__
            raise ConfigError(f"{FLAG} {path}: not valid YAML{at} ({problem})") from None
    if data is None or data == {}:
        # Said here: else the command's own required flags (its --config among them) go missing.
        raise ConfigError(
            f"{FLAG} {path}: the experiment file is empty; write the flags it sets as `name: value` lines"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{FLAG} {path}: expected a mapping of flag names to values, got {type(data).__name__}"
        )
    return data


def settings_for(
    data: Mapping[str, Any], command: Sequence[str], sections: Collection[str] | None, path: Path
) -> dict[str, Any]:
    """The keys that apply to ``command`` (e.g. ``("vocab", "train")``): the top-level ones, then its
    table's. ``sections``: the names of every command (their tables are not keys); None: every table
    is another command's (a parser used in code, without the table of commands)."""

    def own(table: Mapping[str, Any]) -> dict[str, Any]:
        return {str(k): v for k, v in table.items()
                if not (isinstance(v, dict) and (sections is None or k in sections))}  # fmt: skip

    out = own(data)
    table: Any = data
    for i, name in enumerate(command):
        table = table.get(name)
        if table is None:
            return out
        if not isinstance(table, dict):
            where = ".".join(command[: i + 1])
            raise ConfigError(f"{FLAG} {path}: [{where}] must be a table of flags, got {_shown(table)}")
    out.update(own(table))
    return out


def apply_run_file(
    parser: argparse.ArgumentParser,
    settings: Mapping[str, Any],
    path: Path,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, Any]]:
    """Make ``settings`` the defaults of ``parser`` (command-line flags still override them).

    ``aliases``: keys that stand for another flag (the trainer's ``config`` is ``config_train``).
    Returns, by destination, the key that set it and the default it replaced.
    """
    applied: dict[str, tuple[str, Any]] = {}
    by_name: dict[str, argparse.Action] = {}
    for action in settable_actions(parser):
        for flag in action.option_strings:
            if flag.startswith("--"):
                by_name.setdefault(flag[2:], action)
        if not action.option_strings:
            by_name.setdefault(action.dest, action)
        by_name.setdefault(action.dest, action)
    for key, value in settings.items():
        name = (aliases or {}).get(key, key)
        action = by_name.get(name) or by_name.get(name.replace("-", "_"))
        if action is None:
            known = sorted(k for k in by_name if "-" not in k)
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{FLAG} {path}: unknown key {key!r}; {hint}the keys are the flags of "
                f"`{parser.prog} --help`: {', '.join(known)}"
            )
        if (
            value is None
        ):  # `model_select:` with nothing after it, `~`: not "the default", which it silently was
            raise ConfigError(
                f"{FLAG} {path}: key {key!r} has no value (null); give it one, or leave the key out for the "
                "default"
            )
        converted = _convert(action, key, value, path)
        applied.setdefault(action.dest, (key, action.default))
        if is_switch(action):
            # A switch: true sets what the flag sets; false the opposite (or leaves the default).
            if not converted:
                if not isinstance(action.const, bool):
                    continue
                converted = not action.const
            else:
                converted = action.const
            for other in settable_actions(parser):
                if other.dest == action.dest:
                    other.default = converted
        else:
            action.default = converted
        action.required = False
        parser.set_defaults(**{action.dest: converted})
    return applied


def name_file_values(message: str) -> str:
    """``message`` with the experiment file named after it where it quotes a flag whose value the file
    set (``--warmup_iters 40: must be below --train_iters 30`` from a recipe the user did not write)."""
    for flag, typed in _TYPED_AS.items():
        message = re.sub(rf"--{re.escape(flag)}(?![\w-])", f"--{typed}", message)
    quoted = [flag for flag in _FROM_FILE if re.search(rf"--{re.escape(flag)}(?![\w-])", message)]
    if not quoted:
        return message
    files = dict.fromkeys(_FROM_FILE[flag] for flag in quoted)
    flags = ", ".join(f"--{flag}" for flag in quoted)
    return f"{message} ({flags} as set in {', '.join(map(str, files))})"


def typed_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The destinations of the options of ``parser`` that ``argv`` types."""
    typed = (action_of(parser, t.split("=", 1)[0]) for t in argv if t.startswith("-"))
    return {action.dest for action in typed if action is not None}


def drop_unserved(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    applied: Mapping[str, tuple[str, Any]],
    typed: set[str],
    path: Path,
) -> list[str]:
    """Put back the default of each option the experiment file set that serves a choice the command
    line made otherwise (the file's ``muon_momentum`` under a typed ``--optimizer adamw``: the file
    chose Muon, the flag typed after it switches that, and the file's Muon keys go with it). Returns
    the notes for the log: one per choice, naming the file and the keys dropped."""
    dropped: dict[tuple[str, str, Any], list[str]] = {}
    serving = {a.dest: a.serves for a in settable_actions(parser) if getattr(a, "serves", None)}
    for dest, (key, before) in applied.items():  # in the file's order
        if dest not in serving or dest in typed:
            continue
        choice, wanted = serving[dest]
        chosen = getattr(args, choice, None)
        if choice in typed and chosen != wanted:
            setattr(args, dest, before)
            dropped.setdefault((choice, wanted, chosen), []).append(key)
    return [
        f"{path}: {', '.join(keys)} dropped: {'it serves' if len(keys) == 1 else 'they serve'} "
        f"--{choice} {wanted}, and the command line chose --{choice} {chosen}"
        for (choice, wanted, chosen), keys in dropped.items()
    ]


def _convert(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    def wrong(expected: str) -> ConfigError:
        return ConfigError(f"{FLAG} {path}: key {key!r} must be {expected}, got {_shown(value)}")

    if is_switch(action):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if takes_many(action):
        items = value if isinstance(value, list) else [value]
        return [_one(action, key, item, path, wrong) for item in items]
    if isinstance(value, list | dict):
        raise wrong("a single value")
    return _one(action, key, value, path, wrong)


def _one(action: argparse.Action, key: str, value: Any, path: Path, wrong: Any) -> Any:
    if isinstance(value, bool) and action.choices and YAML_WORDS[value] in action.choices:
        value = YAML_WORDS[value]  # YAML reads an unquoted `off` as false: `wandb: off` means "off"
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        expected = "one of " + ", ".join(map(str, action.choices)) if action.choices else "a value"
        if isinstance(value, bool):
            raise wrong(f"{expected}, not true/false")
        raise wrong(expected)
    text = str(value)
    convert = action.type
    try:
        converted = convert(text) if callable(convert) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        if isinstance(exc, argparse.ArgumentTypeError):
            raise ConfigError(f"{FLAG} {path}: key {key!r}: {exc}") from None
        name = getattr(convert, "__name__", "value")
        expected = {"int": "an integer", "float": "a number"}.get(name, f"a valid {name}")
        raise ConfigError(f"{FLAG} {path}: key {key!r}: expected {expected}, got {value!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(
            f"{FLAG} {path}: key {key!r}: {value!r} is not one of {', '.join(map(str, action.choices))}"
        )
    return converted


def subparser_for(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.ArgumentParser, list[str]]:
    """The (sub)parser that ``argv`` reaches and the command names on the way (``["vocab", "train"]``)."""
    path: list[str] = []
    current = parser
    for token in argv:
        if token.startswith("-"):
            continue
        subs = subcommands(current)
        if token not in subs:
            break
        current = subs[token]
        path.append(token)
    return current, path


def dump_yaml(values: Mapping[str, Any]) -> str:
    """``values`` as an experiment file that gives them back (None left out: the default)."""
    import yaml

    plain = {k: _plain(v) for k, v in values.items() if v is not None}
    return yaml.safe_dump(plain, sort_keys=False, default_flow_style=None)


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str],
    command: Sequence[str] | None = None,
    sections: Collection[str] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with an experiment file named by ``--config`` applied first.

    ``command``: the command names the file's tables are looked up by (default: the subcommands
    ``argv`` names); ``sections``: every command name (``dsgpt2.cli.main.SECTIONS``; None: every table
    is another command's);
    ``aliases``: flags that ``config`` stands for in this parser (``{"config": "config_train"}``:
    ``--config FILE.json`` and the file's ``config`` key then name the connection config).
    """
    applied: dict[str, tuple[str, Any]] = {}
    target: argparse.ArgumentParser = parser
    _FROM_FILE.clear()
    _TYPED_AS.clear()
    try:
        rest, path = find_run_file(argv)
        path = None if path is None else shipped_if_absent(path)
        if aliases and "config" in aliases:
            if any(t == FLAG or t.startswith(FLAG + "=") for t in rest):
                _TYPED_AS[aliases["config"]] = "config"
            rest = [f"--{aliases['config']}" if t == FLAG else t for t in rest]
            rest = [t.replace(FLAG + "=", f"--{aliases['config']}=", 1) if t.startswith(FLAG + "=") else t
                    for t in rest]  # fmt: skip
        if path is not None:
            target, names = subparser_for(parser, rest)
            if command is not None:
                target, names = parser, list(command)
            settings = settings_for(read_run_file(path), names, sections, path)
            applied = apply_run_file(target, settings, path, aliases)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    args = parser.parse_args(rest)
    if path is not None:
        typed = typed_dests(target, rest)
        for action in settable_actions(target):
            if action.dest in applied and action.dest not in typed:
                _FROM_FILE.update((f[2:], path) for f in action.option_strings if f.startswith("--"))
        for note in drop_unserved(target, args, applied, typed, path):
            if process_rank() == 0:  # before logging is set up: the ranks of a launch all parse
                log.warning(note)
    return args


def _shown(value: Any) -> str:
    """``value`` as an error line shows it, bounded: YAML aliases can nest a few lines into a value whose
    full repr would take gigabytes (and the time to build it)."""
    import reprlib

    shown = reprlib.Repr()  # its settings as attributes: Python 3.10 and 3.11 take no arguments
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxstring, shown.maxother = 3, 4, 4, 60, 60
    return shown.repr(value)


def _unique_keys_loader() -> Any:
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently;
    TOML and the connection config's JSON refuse it): which of the two was meant is not ours to guess."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return loader.construct_mapping(node, deep=deep)

    UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeys
