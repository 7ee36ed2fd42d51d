"""Every suggestion an error message makes exists: each ``--flag`` it names is a flag of the command
printing it (or of the command the message names just before it), each ``dsgpt2 COMMAND`` it names is
a command. The messages come from the user errors each command can be driven into cheaply (bad paths,
empty directories, missing collections, bad flags), run as a user runs them; the library's messages
that only one command can print are checked without running it."""

from __future__ import annotations

import argparse
import ast
import json
import re
import socket
from functools import cache
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, seed, store_config, tiny_export, write_config
from dsgpt2.cli.main import build_parser
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.settings.options import flag_strings, subcommands

# The deepspeed launcher's own flags (``deepspeed --num_gpus 2 ds_trainer.py ...``).
LAUNCHER = {"--num_gpus", "--num_nodes", "--hostfile", "--master_addr", "--master_port", "--include",
            "--exclude", "--module", "--launcher", "--force_multi", "--bind_cores_to_rank"}  # fmt: skip


@cache
def command_flags(command: str) -> frozenset[str]:
    """The flags ``dsgpt2 COMMAND`` accepts (``train``: the trainer's), hyphens read as underscores."""
    if command == "train":
        from dsgpt2.train.config import trainer_parser

        parser: argparse.ArgumentParser = trainer_parser()
    else:
        parser = build_parser()
        for word in command.split():
            parser = subcommands(parser)[word]
    return frozenset(f.replace("-", "_") for f in flag_strings(parser))


@cache
def command_names() -> dict[str, frozenset[str]]:
    """Each command and its subcommands (``vocab``: download, train)."""
    return {name: frozenset(subcommands(p)) for name, p in subcommands(build_parser()).items()}


# Programs whose flags a message may name with them (``pip install flash-attn --no-build-isolation``).
OTHER_PROGRAMS = {"pip", "pip3", "uv", "mongod", "mongosh", "docker"}
PREFIX = re.compile(r"^.*?(?:dsgpt2(?: [a-z_]+){0,2}|ds_trainer\.py): (?:error|interrupted): ")
PUNCT = ",;:.)"


def _scope(command: str) -> str:
    """Whose flags follow a command: ``dsgpt2 launch`` passes its arguments to the deepspeed launcher."""
    return "deepspeed" if command == "launch" else command


def suggestions(message: str, printer: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The flags ``message`` names, each with the command it belongs to, and the commands it names that
    do not exist. A flag belongs to the command printing the message unless it follows a command the
    message names (``dsgpt2 vocab train --out X``, ``ds_trainer.py --load_dir D``): inside backticks,
    up to the closing one; otherwise over the flags, their values and placeholders that follow it, up to
    the end of the clause."""
    message = PREFIX.sub("", message, count=1)
    # argparse quotes what the user typed wrong: not a suggestion.
    message = re.sub(r"unrecognized arguments: [^(]*", "", message)
    flags: list[tuple[str, str]] = []
    unknown: list[str] = []
    words = re.findall(r"`|[^\s`]+", message)
    in_tick = False
    scope: str | None = None  # the command a flag here belongs to, when the message named one
    scope_tick = False  # that command was named inside backticks
    after_flag = False
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "`":
            in_tick = not in_tick
            if not in_tick and scope_tick:
                scope = None
            continue
        bare = word.strip("('\"").rstrip(PUNCT)
        ends_clause = word[-1] in PUNCT and not word.endswith("...")
        nxt = words[i] if i < len(words) else ""
        if bare in command_names() and nxt.startswith("--") and not scope_tick:
            # "`ingest --dedup`", "dedup --near: signing": a command named by itself, its flag after it.
            scope, scope_tick, after_flag = _scope(bare), in_tick, True
            continue
        if bare in OTHER_PROGRAMS:
            scope, scope_tick, after_flag = "other", in_tick, True
            continue
        if bare in ("dsgpt2", "ds_trainer.py", "deepspeed"):
            if bare == "dsgpt2":
                name = words[i].strip("`").rstrip(PUNCT) if i < len(words) else ""
                if not re.fullmatch(r"[a-z][a-z_]*", name):
                    continue  # "dsgpt2" alone: the program, no command
                i += 1
                if name not in command_names():
                    # "a dsgpt2 database" is prose; "`dsgpt2 nope`" or "dsgpt2 nope --x" a command.
                    if in_tick or (i < len(words) and words[i].startswith("--")):
                        unknown.append(f"dsgpt2 {name}")
                    continue
                subs = command_names()[name]
                if subs and i < len(words) and words[i].rstrip(PUNCT) in subs:
                    name = f"{name} {words[i].rstrip(PUNCT)}"
                    ends_clause = words[i][-1] in PUNCT
                    i += 1
                elif subs:
                    unknown.append(f"dsgpt2 {name} (without one of {', '.join(sorted(subs))})")
                else:
                    ends_clause = words[i - 1][-1] in PUNCT
            else:
                name = "train" if bare == "ds_trainer.py" else "deepspeed"
            scope, scope_tick, after_flag = _scope(name), in_tick, True
            if ends_clause and not in_tick:
                scope = None
            continue
        match = re.match(r"--[a-z][a-z0-9_-]*", bare)
        if match:
            flags.append((scope or printer, match.group(0)))
            after_flag = True
        elif scope not in (None, "other") and not scope_tick:
            placeholder = bare.isupper() or "/" in bare or "." in bare or bare.startswith(("<", "$"))
            if not (after_flag or placeholder):
                scope = None
            after_flag = False
        if ends_clause and not scope_tick:
            scope = None
    return flags, unknown


def bad_advice(text: str, printer: str) -> list[str]:
    """What the lines of ``text`` suggest that does not exist, printed by ``dsgpt2 PRINTER``."""
    problems = []
    for line in text.splitlines():
        flags, unknown = suggestions(line, printer)
        problems += [f"{line!r}: names {u}, no such command" for u in unknown]
        for owner, flag in flags:
            if owner == "other":
                continue
            if owner == "deepspeed":
                if flag not in LAUNCHER and flag.replace("-", "_") not in command_flags("train"):
                    problems.append(f"{line!r}: {flag} is not a flag of the deepspeed launcher")
            elif flag.replace("-", "_") not in command_flags(owner):
                problems.append(f"{line!r}: {flag} is not a flag of `dsgpt2 {owner}`")
    return problems


@pytest.mark.parametrize(
    ("message", "printer", "expected"),
    [
        ("dsgpt2 export: error: no checkpoint; pass --load_dir", "export", ["--load_dir"]),
        ("dsgpt2: error: no checkpoint; pass --ckpt_dir", "export", []),
        ("dsgpt2: error: missing meta; run dsgpt2 validate --fix", "evaluate", []),
        ("dsgpt2: error: x; run `dsgpt2 vocab train --out T --input D` then pass --fix", "validate", []),
        ("dsgpt2: error: x; run `dsgpt2 vocab train --fix`", "validate", ["--fix"]),
        ("dsgpt2: error: x (dsgpt2 ingest --config C --collection a FILE...) or pass --fix", "validate", []),
        ("dsgpt2: error: x: dsgpt2 validate --fix to record it, then --split", "info", ["--split"]),
        ("dsgpt2: error: x; run `dsgpt2 frobnicate`", "info", ["dsgpt2 frobnicate"]),
        ("dsgpt2: error: x is not a dsgpt2 database (no y there)", "db", []),
        ("dsgpt2: error: x (pip install flash-attn --no-build-isolation)", "train", []),
        ("dsgpt2: error: x: `ingest --dedup` does not see them until `dsgpt2 dedup --exact`", "ingest", []),
        ("dsgpt2: error: x: --dedup does not see them until `dsgpt2 dedup --exact`", "dedup", ["--dedup"]),
        ("dsgpt2: error: x; run dsgpt2 vocab --out", "info", ["dsgpt2 vocab", "--out"]),
        ("ds_trainer.py: error: x; resume with ds_trainer.py --load_dir D, or --fix", "info", ["--fix"]),
        ("dsgpt2: error: x (see `dsgpt2 db --help`)", "export", []),
        ("dsgpt2 export: error: unrecognized arguments: --nope 3 (see `dsgpt2 export --help`)", "export", []),
        ("dsgpt2: error: x; give it with deepspeed --master_addr H ds_trainer.py --ckpt_dir C", "info", []),
    ],
)
def test_the_advice_reader_knows_whose_flag_it_is(message: str, printer: str, expected: list[str]) -> None:
    """A reader that finds nothing finds nothing wrong either: it is checked on messages it must fault."""
    problems = bad_advice(message, printer)
    assert len(problems) == len(expected), problems
    for problem, needle in zip(problems, expected, strict=True):
        assert needle in problem


# ---------------------------------------------------------------------------------------------------
# The user errors each command can be driven into, cheaply.


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> dict[str, str]:
    """Paths to give the commands: a corpus, a config naming a collection that does not exist, a model
    and its tokenizer, an empty directory, a file, checkpoint directories that hold no usable
    checkpoint."""
    base = tmp_path_factory.mktemp("advice")
    cfg, _ = store_config(base, ["a"])
    conn = Connection(load_config(cfg))
    seed(conn, "a", sample_texts[:200])
    seed(conn, "b", sample_texts[:50], meta=False, index=False)  # no count, no idx index
    nope = write_config(base / "nope.json", **json.loads(cfg.read_text()) | {"COLLECTIONS": ["nope"]})
    unindexed = write_config(base / "b.json", **json.loads(cfg.read_text()) | {"COLLECTIONS": ["b"]})
    typo = write_config(base / "typo.json", **json.loads(cfg.read_text()) | {"COLLECTIONS": ["a_"]})
    model = tiny_export(base / "chat", sample_texts[:200])
    plain = tiny_export(base / "plain", sample_texts[:200], speakers=())
    (base / "empty").mkdir()
    (base / "file.txt").write_text("one line\n")
    latest = base / "latest_bad"
    latest.mkdir()
    (latest / "latest").write_text("global_step9\n")
    damaged = base / "damaged" / "global_step5"
    damaged.mkdir(parents=True)
    marker = {"step": 5, "files": {"mp_rank_00_model_states.pt": {"size": 3, "sha256": "0" * 64}}}
    (damaged / "dsgpt2_complete.json").write_text(json.dumps(marker))
    return {
        "CFG": str(cfg), "NOPE": str(nope), "TYPO": str(typo), "UNINDEXED": str(unindexed),
        "MODEL": str(model), "PLAIN": str(plain), "TOK": str(base / "chat" / "tok"),
        "EMPTY": str(base / "empty"),
        "FILE": str(base / "file.txt"), "UNDER_FILE": str(base / "file.txt" / "out"),
        "MISSING": str(base / "missing"), "LATEST_BAD": str(latest),
        "DAMAGED": str(damaged.parent), "OUT": str(base / "out"),
        "BASE": str(base), "DS": str(ROOT / "configs" / "ds_config_cpu.json"),
    }  # fmt: skip


def test_evaluate_on_a_collection_that_does_not_exist_says_so(world: dict[str, str]) -> None:
    """One line naming it and the collections there are, before the model loads; not an empty split
    and advice to run `validate --fix`."""
    for flags, fix in (
        (["--config", world["CFG"], "--collection", "a", "--collection", "nope"], "fix --collection"),
        (["--config", world["NOPE"]], f"fix COLLECTIONS in {re.escape(world['NOPE'])}"),
    ):
        result = run_cli("evaluate", "--model", world["MODEL"], *flags)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert re.fullmatch(
            rf"dsgpt2: error: collection 'nope' does not exist in database '\w+' at \S+ \(it holds a, "
            rf"b\); {fix}, or ingest into it first: dsgpt2 ingest --config \S+ --collection nope FILE\.\.\.",
            line,
        ), line


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


M = ["--model", "MODEL"]
T = ["--config_train", "CFG", "--vocab_dir", "TOK", "--model_select", "tiny", "--deepspeed_config", "DS"]
CASES: list[tuple[str, list[str]]] = [
    # export
    ("export", ["--ckpt_dir", "EMPTY", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "MISSING", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "LATEST_BAD", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "DAMAGED", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "EMPTY", "--ckpt_id", "best", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "EMPTY", "--ckpt_id", "global_step3", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "MODEL", "--out", "OUT"]),
    ("export", ["--ckpt_dir", "EMPTY", "--out", "OUT", "--bogus"]),
    # evaluate
    ("evaluate", [*M, "--config", "CFG", "--collection", "nope"]),
    ("evaluate", [*M, "--config", "NOPE"]),
    ("evaluate", [*M, "--config", "MISSING"]),
    ("evaluate", ["--model", "EMPTY", "--config", "CFG"]),
    ("evaluate", ["--model", "MISSING", "--config", "CFG"]),
    ("evaluate", ["--model", "LATEST_BAD", "--config", "CFG"]),
    ("evaluate", ["--model", "DAMAGED", "--config", "CFG"]),
    ("evaluate", ["--model", "DAMAGED", "--ckpt_id", "best", "--config", "CFG"]),
    ("evaluate", [*M, "--ckpt_id", "global_step3", "--config", "CFG"]),
    ("evaluate", [*M, "--config", "CFG", "--hellaswag", "MISSING"]),
    ("evaluate", [*M, "--config", "CFG", "--hellaswag", "FILE"]),
    ("evaluate", [*M, "--config", "CFG", "--report", "EMPTY"]),
    ("evaluate", [*M, "--config", "CFG", "--vocab_dir", "EMPTY"]),
    ("evaluate", [*M, "--config", "CFG", "--start", "9", "--stop", "3"]),
    ("evaluate", [*M, "--config", "CFG", "--split", "validation", "--tr_ratio", "1"]),
    # generate
    ("generate", ["--model", "EMPTY", "hello"]),
    ("generate", ["--model", "DAMAGED", "hello"]),
    ("generate", [*M]),
    ("generate", [*M, "--prompts_file", "MISSING"]),
    ("generate", [*M, "--stream", "--json", "hello"]),
    ("generate", [*M, "--max_new_tokens", "5000", "hello"]),
    ("generate", [*M, "--temperature", "0", "--num_samples", "2", "hello"]),
    ("generate", [*M, "--vocab_dir", "MISSING", "hello"]),
    # chat
    ("chat", ["--model", "EMPTY"]),
    ("chat", ["--model", "PLAIN"]),
    ("chat", [*M, "--user", "nobody"]),
    # serve
    ("serve", ["--model", "EMPTY"]),
    ("serve", ["--model", "LATEST_BAD"]),
    ("serve", [*M, "--max_tokens_limit", "8", "--max_new_tokens", "9"]),
    ("serve", [*M, "--host", "192.0.2.1"]),
    ("serve", [*M, "--port", "BUSY"]),
    # ingest
    ("ingest", ["--config", "CFG", "MISSING"]),
    ("ingest", ["--config", "CFG"]),
    ("ingest", ["--config", "CFG", "--limit", "5", "FILE"]),
    ("ingest", ["--config", "CFG", "--collection", "bad$name", "FILE"]),
    ("ingest", ["--config", "MISSING", "FILE"]),
    ("ingest", ["--config", "CFG", "--format", "csv", "--collection", "c1", "FILE"]),
    ("ingest", ["--config", "CFG", "--keep_fields", "x", "--collection", "c3", "FILE"]),
    ("ingest", ["--config", "CFG", "--collection", "c4", "--split", "nope", "FILE"]),
    # index
    ("index", ["--config", "CFG", "--collection", "nope"]),
    ("index", ["--config", "NOPE"]),
    # dedup
    ("dedup", ["--config", "CFG"]),
    ("dedup", ["--config", "NOPE", "--exact"]),
    ("dedup", ["--config", "CFG", "--collection", "nope", "--near"]),
    ("dedup", ["--config", "CFG", "--exact", "--part", "3/2"]),
    # curate
    ("curate", ["--config", "NOPE", "report"]),
    ("curate", ["--config", "CFG", "--collection", "nope", "report"]),
    ("curate", ["--config", "CFG", "--rules", "nope"]),
    ("curate", ["--config", "CFG", "--threshold", "2"]),
    ("curate", ["--config", "CFG", "--threshold", "min_wordz=3"]),
    ("curate", ["--config", "CFG", "mark"]),
    # langid
    ("langid", ["--config", "NOPE"]),
    ("langid", ["--config", "CFG", "--collection", "nope"]),
    ("langid", ["--config", "CFG", "--collection", "bad$name"]),
    ("langid", ["--config", "CFG", "--part", "3/2"]),
    # redact
    ("redact", ["--config", "NOPE"]),
    ("redact", ["--config", "CFG", "--collection", "nope"]),
    ("redact", ["--config", "CFG", "--collection", "bad$name"]),
    ("redact", ["--config", "CFG", "--workers", "0"]),
    # decontaminate
    ("decontaminate", ["--config", "CFG"]),
    ("decontaminate", ["--config", "CFG", "--against", "MISSING"]),
    ("decontaminate", ["--config", "CFG", "--against", "FILE"]),
    ("decontaminate", ["--config", "CFG", "--against", "FILE", "--ngram", "4"]),
    ("decontaminate", ["--config", "CFG", "--against", "FILE", "--name", "a.b"]),
    ("decontaminate", ["--config", "CFG", "--against", "FILE", "--name", "a", "--name", "b"]),
    # validate
    ("validate", ["--config", "NOPE"]),
    ("validate", ["--config", "UNINDEXED"]),
    ("validate", ["--config", "CFG", "--collection", "nope"]),
    # info
    ("info", ["--config", "NOPE"]),
    ("info", ["--config", "FILE"]),
    # drop
    ("drop", ["--config", "CFG", "--collection", "a"]),
    ("drop", ["--config", "CFG", "--collection", "nope", "--yes"]),
    ("drop", ["--config", "CFG", "--collection", "meta_info", "--yes"]),
    # vocab
    ("vocab download", ["--config", "CFG", "--out", "FILE"]),
    ("vocab download", ["--config", "NOPE", "--out", "OUT"]),
    ("vocab download", ["--config", "CFG", "--out", "MODEL"]),
    ("vocab train", ["--out", "OUT"]),
    ("vocab train", ["--input", "MISSING", "--out", "OUT"]),
    ("vocab train", ["--input", "EMPTY", "--out", "OUT"]),
    ("vocab train", ["--from_mongo", "--out", "OUT"]),
    ("vocab train", ["--from_mongo", "--config", "NOPE", "--out", "OUT"]),
    ("vocab train", ["--from_mongo", "--config", "CFG", "--out", "MODEL"]),
    ("vocab train", ["--from_mongo", "--out", "gridfs:tok"]),
    ("vocab train", ["--from_mongo", "--config", "CFG", "--out", "UNDER_FILE"]),
    ("vocab push", ["TOK", "--config", "CFG", "--out", "OUT"]),
    ("vocab push", ["TOK", "--config", "CFG", "--out", "gridfs:a b"]),
    ("vocab push", ["MISSING", "--config", "CFG", "--out", "gridfs:tok"]),
    # tokenize
    ("tokenize", ["--config_train", "CFG", "--vocab_dir", "MISSING", "--cache_dir", "OUT"]),
    ("tokenize", ["--config_train", "NOPE", "--vocab_dir", "TOK", "--cache_dir", "OUT"]),
    ("tokenize", ["--config_train", "MISSING", "--vocab_dir", "TOK", "--cache_dir", "OUT"]),
    ("tokenize", ["--config_train", "CFG", "--vocab_dir", "TOK", "--cache_dir", "FILE"]),
    # plan
    ("plan", ["--model_select", "nope"]),
    ("plan", ["--gpu_memory", "0.001"]),
    ("plan", ["--model_select", "tiny", "--num_gpus", "0"]),
    # lineage
    ("lineage", ["--config", "CFG", "--ckpt_dir", "EMPTY", "--doc", "a:1"]),
    ("lineage", ["--config", "CFG", "--ckpt_dir", "DAMAGED", "--doc", "a:1"]),
    ("lineage", ["--config", "CFG", "--ckpt_dir", "EMPTY", "--doc", "nonsense"]),
    ("lineage", ["--config", "NOPE", "--ckpt_dir", "LATEST_BAD", "--doc", "nope:1"]),
    ("lineage", ["--config", "CFG", "--ckpt_dir", "gridfs:none", "--doc", "a:1"]),
    # db
    ("db", ["--config", "CFG", "status"]),
    ("db", ["--config", "MISSING", "stop"]),
    # train (fails before any step)
    ("train", ["--config_train", "CFG", "--vocab_dir", "TOK", "--model_select", "tiny"]),
    ("train", ["--config_train", "MISSING", "--vocab_dir", "TOK"]),
    ("train", ["--config_train", "CFG", "--vocab_dir", "MISSING", "--model_select", "tiny"]),
    ("train", ["--config_train", "CFG", "--vocab_dir", "gridfs:none", "--model_select", "tiny"]),
    ("train", ["--config_train", "CFG", "--vocab_dir", "TOK", "--model_select", "nope"]),
    ("train", ["--config_train", "CFG", "--vocab_dir", "TOK", "--no_resume", "--load_dir", "EMPTY"]),
    ("train", [*T, "--config_train", "NOPE", "--ckpt_dir", "OUT"]),
    ("train", [*T, "--load_dir", "EMPTY", "--ckpt_dir", "OUT"]),
    ("train", [*T, "--ckpt_dir", "DAMAGED"]),
    ("train", [*T, "--ckpt_dir", "LATEST_BAD"]),
    ("train", [*T, "--load_dir", "DAMAGED", "--ckpt_id", "best", "--ckpt_dir", "OUT"]),
    ("train", [*T, "--init_from", "EMPTY", "--ckpt_dir", "OUT"]),
    ("train", [*T, "--init_from", "gridfs:run", "--ckpt_dir", "OUT"]),
    ("train", [*T, "--ckpt_dir", "UNDER_FILE"]),
]
# Commands the table must cover (every one the issue names, and the trainer).
COVERED = {"export", "evaluate", "generate", "chat", "serve", "train", "ingest", "index", "dedup", "langid",
           "curate", "validate", "info", "vocab download", "vocab train", "vocab push", "tokenize", "plan",
           "lineage", "db", "redact", "decontaminate", "drop"}  # fmt: skip


def test_the_table_covers_every_command() -> None:
    assert {command for command, _ in CASES} == COVERED
    every = {f"{c} {s}".strip() for c, subs in command_names().items() for s in (subs or [""])}
    # demo's errors are those of the stages it runs; launch's arguments are the deepspeed launcher's.
    assert every - COVERED - {"demo", "launch"} == set()


def _argv(args: list[str], world: dict[str, str], port: int) -> list[str]:
    return [str(port) if a == "BUSY" else world.get(a, a) for a in args]


@pytest.mark.parametrize(("command", "args"), CASES, ids=[f"{c} {' '.join(a)}" for c, a in CASES])
def test_every_suggestion_in_an_error_names_what_exists(
    world: dict[str, str], command: str, args: list[str]
) -> None:
    listener, port = _busy_port()
    with listener:
        result = run_cli(*command.split(), *_argv(args, world, port), cwd=Path(world["BASE"]))
    assert result.returncode in (1, 2), (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert bad_advice(result.stderr + "\n" + result.stdout, command) == []


# ---------------------------------------------------------------------------------------------------
# The library's messages, read from the source: those only some commands can print.

# Modules whose messages only these commands print (a shared module is left to the cases above).
OWNERS = {
    "dsgpt2/corpus/ingest.py": ["ingest"],
    "dsgpt2/corpus/readers.py": ["ingest"],
    "dsgpt2/corpus/ingest_report.py": ["ingest"],
    "dsgpt2/corpus/columnar.py": ["ingest"],
    "dsgpt2/db/numbering.py": ["index"],
    "dsgpt2/curation/neardup.py": ["dedup", "ingest"],
    "dsgpt2/curation/dedup.py": ["dedup", "ingest"],
    "dsgpt2/curation/minhash.py": ["dedup"],
    "dsgpt2/curation/quality.py": ["curate"],
    "dsgpt2/curation/curate.py": ["curate"],
    "dsgpt2/curation/report.py": ["curate"],
    "dsgpt2/curation/decontaminate.py": ["decontaminate"],
    "dsgpt2/curation/language.py": ["langid"],
    "dsgpt2/curation/passes.py": ["dedup", "curate", "decontaminate", "langid", "redact"],
    "dsgpt2/tokenizer/texts.py": ["vocab download", "vocab train"],
    "dsgpt2/infer/export.py": ["export"],
    "dsgpt2/infer/serve.py": ["serve"],
    "dsgpt2/infer/openai_api.py": ["serve"],
    "dsgpt2/infer/chat.py": ["chat", "serve"],
    "dsgpt2/infer/evaluate.py": ["evaluate"],
    "dsgpt2/infer/loading.py": ["evaluate", "generate", "chat", "serve"],
    "dsgpt2/model/hellaswag.py": ["evaluate", "train"],
    "dsgpt2/checkpoints/lineage.py": ["lineage"],
    "dsgpt2/train/plan.py": ["plan"],
    "dsgpt2/checkpoints/checkpointer.py": ["train"],
    "dsgpt2/collective.py": ["train"],
    "dsgpt2/optim/ds_config.py": ["train"],
    "dsgpt2/train/engine.py": ["train"],
    "dsgpt2/train/feed.py": ["train"],
    "dsgpt2/train/metrics.py": ["train"],
    "dsgpt2/optim/schedule.py": ["train"],
    "dsgpt2/train/trainer.py": ["train"],
    "dsgpt2/train/validator.py": ["train"],
    "dsgpt2/data/mixture.py": ["train"],
}
LOG_CALLS = {"debug", "info", "warning", "error", "exception", "critical"}


def _text(node: ast.AST) -> str | None:
    """The text of a string expression, ``X`` for each value formatted into it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None or right is not None:
            return (left or "X") + (right or "X")
    return None


def library_messages() -> list[tuple[str, int, str, list[str]]]:
    """(file, line, message, the commands that print it) for each error and log message of a module in
    OWNERS, each ``usage(COMMAND, ...)`` call, and each message raised inside a ``cmd_NAME`` function."""
    commands = {f"cmd_{c.replace(' ', '_')}": c for c in (*command_names(), "vocab download", "vocab train")}
    found = []
    for path in sorted((ROOT / "dsgpt2").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for top in tree.body:
            owner = OWNERS.get(rel)
            if isinstance(top, ast.FunctionDef) and top.name in commands:
                owner = [commands[top.name]]
            for node in ast.walk(top):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if name == "usage" and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
                    text = _text(node.args[1])
                    if text is not None:
                        found.append((rel, node.lineno, text, [node.args[0].value]))
                elif owner and (name.endswith("Error") or name in LOG_CALLS) and node.args:
                    text = _text(node.args[0])
                    if text is not None and "--" in text:
                        found.append((rel, node.lineno, text, owner))
    return found


def test_the_library_reader_finds_the_messages() -> None:
    found = {(f, text) for f, _, text, _ in library_messages()}
    assert ("dsgpt2/cli/infer.py", "give PROMPT arguments or --prompts_file") in found
    assert any(f == "dsgpt2/checkpoints/checkpointer.py" and "--no_resume" in t for f, t in found)
    assert len(found) > 60


def test_every_flag_a_library_message_suggests_exists_for_the_commands_that_print_it() -> None:
    problems = []
    for path, line, text, printers in library_messages():
        for printer in printers:
            problems += [f"{path}:{line}: {p}" for p in bad_advice(text, printer)]
    assert problems == []


TYPO_COMMANDS = [
    ("info", ["--config", "TYPO"]),
    ("validate", ["--config", "TYPO"]),
    ("index", ["--config", "TYPO", "--collection", "a_"]),
    ("dedup", ["--config", "TYPO", "--exact"]),
    ("curate", ["--config", "TYPO", "report"]),
    ("langid", ["--config", "TYPO"]),
    ("vocab download", ["--config", "TYPO", "--out", "OUT"]),
    ("evaluate", ["--model", "MODEL", "--config", "TYPO"]),
    ("tokenize", ["--config_train", "TYPO", "--vocab_dir", "TOK", "--cache_dir", "OUT"]),
    ("train", [*T, "--config_train", "TYPO", "--ckpt_dir", "OUT"]),
]


@pytest.mark.parametrize(("command", "args"), TYPO_COMMANDS, ids=[c for c, _ in TYPO_COMMANDS])
def test_a_missing_collection_gets_one_answer_from_every_command(
    world: dict[str, str], command: str, args: list[str]
) -> None:
    """A misspelt collection: what the database holds, the closest name, and the fixes with the user's
    own --config, in the same line from every command that reads the corpus (not "empty", not a bare
    "not found")."""
    result = run_cli(*command.split(), *_argv(args, world, 0), cwd=Path(world["BASE"]))
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    line = result.stderr.strip().splitlines()[-1]
    typo = world["TYPO"]
    assert line.split(": error: ", 1)[1] == (
        f"collection 'a_' does not exist in database '{line.split(chr(39))[3]}' at "
        f"{line.split(' at ', 1)[1].split(' ')[0]} (it holds a, b; did you mean 'a'?); fix COLLECTIONS in "
        f"{typo}, or ingest into it first: dsgpt2 ingest --config {typo} --collection a_ FILE..."
    ), line
