"""What the toolkit does, written down to compare two commits: a change meant to keep behaviour leaves
the file the same.

    python -m bench.behaviour OUT.json [--train]

The file holds every command's ``--help`` page; the documents, meta_info and report lines of an ingest
of every input format; the marks, meta_info and report lines of every curation pass over a two-collection
corpus (whole, in two worker processes, and in two machine parts); with ``--train``, the losses and the
block ids of seeded tiny training runs (AdamW and Muon). Times, hosts, process ids and paths are left
out; everything else is kept as the commands wrote it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# What differs between two runs of the same code: left out of the fingerprint.
VOLATILE = {"_id", "heartbeat", "updated_at", "owner", "seconds", "at", "started", "time", "wall"}
TIMES = re.compile(r"\b\d+(\.\d+)? ?(s|ms|seconds?|minutes?|docs?/s|MB/s)\b|\b\d\d:\d\d:\d\d\b")


def scrub(value: Any, root: str) -> Any:
    """``value`` without what changes from run to run: volatile keys, times in lines, the temp root."""
    if isinstance(value, dict):
        return {k: scrub(v, root) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list | tuple):
        return [scrub(v, root) for v in value]
    if isinstance(value, str):
        return TIMES.sub("<t>", value.replace(root, "<root>"))
    if isinstance(value, float):
        return round(value, 6)
    return value


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``dsgpt2 ARGV`` in this process: its exit code and what it printed."""
    from dsgpt2.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue()


def help_pages() -> dict[str, str]:
    """Every command's and subcommand's ``--help``, by its words."""
    from dsgpt2.cli.main import COMMANDS, build_parser
    from dsgpt2.settings.options import subcommands

    pages: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        pages[" ".join(words) or "dsgpt2"] = parser.format_help()
        for name, sub in subcommands(parser).items():
            walk(sub, [*words, name])

    walk(build_parser(), [])
    for command in COMMANDS:
        if command.own_parser is not None and command.name == "train":
            pages["train"] = run_cli(["train", "--help"])[1]
    return pages


def write_inputs(root: Path) -> dict[str, list[str]]:
    """One file of each input format (and a gzip, a damaged line, a kept column); the ingest flags of each."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    texts = [f"Document number {i}: the quick brown fox jumps over dog {i % 7}." for i in range(40)]
    (root / "a.txt").write_text("\n".join(texts[:10]) + "\n\n\n" + "\n".join(texts[10:15]) + "\n")
    (root / "p.txt").write_text("\n\n".join(texts[:12]) + "\n")
    lines = [json.dumps({"text": t, "url": f"u{i}"}) for i, t in enumerate(texts[:12])]
    lines[3] = "{not json"
    lines[5] = json.dumps({"body": "no text field"})
    (root / "b.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(root / "c.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": t}) for t in texts[12:20]) + "\n")
    with open(root / "d.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "content"])
        w.writerows([[i, t] for i, t in enumerate(texts[20:28])])
    chats = [{"turns": [{"speaker": "a", "text": t}, {"speaker": "b", "text": t[::-1]}]} for t in texts[:4]]
    chats.append({"query": "what?", "reply": "this."})
    chats.append({"turns": "bad"})
    (root / "e.jsonl").write_text("\n".join(json.dumps(c) for c in chats) + "\n")
    table = pa.table({"text": texts[28:40], "id": list(range(12)), "score": [i / 3 for i in range(12)]})
    pq.write_table(table, root / "f.parquet", row_group_size=5)
    feather.write_feather(table, root / "g.arrow")
    return {
        "text_line": [str(root / "a.txt")],
        "text_paragraph": [str(root / "p.txt"), "--split", "paragraph"],
        "jsonl_keep": [str(root / "b.jsonl"), "--keep_fields", "url"],
        "jsonl_gz": [str(root / "c.jsonl.gz")],
        "csv": [str(root / "d.csv"), "--column", "content", "--keep_fields", "id"],
        "conversation": [str(root / "e.jsonl"), "--format", "conversation"],
        "parquet": [str(root / "f.parquet"), "--keep_fields", "id,score"],
        "arrow": [str(root / "g.arrow"), "--format", "arrow"],
        "sample": ["--sample", "stdlib", "--limit", "150"],
        "sample_chat": ["--sample", "stdlib-chat", "--limit", "20"],
        "pii_dedup": [str(root / "b.jsonl"), str(root / "c.jsonl.gz"), "--pii", "--dedup"],
    }


def collection_state(uri: str, db: str, names: list[str]) -> dict[str, Any]:
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import MongoConfig

    conn = Connection(MongoConfig(uri=uri, db=db, collections=list(names)))
    try:
        out = {name: list(conn.db[name].find({}, {"_id": 0}).sort("idx", 1)) for name in names}
        meta = list(conn.db["meta_info"].find({}, {"_id": 0}).sort("collection", 1))
        return {"documents": out, "meta_info": meta}
    finally:
        conn.close()


def ingest_all(root: Path) -> dict[str, Any]:
    inputs = write_inputs(root)
    result: dict[str, Any] = {}
    for name, flags in inputs.items():
        cfg = root / f"{name}.json"
        uri = f"local://{root / 'db_ingest'}"
        cfg.write_text(
            json.dumps({"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": name, "COLLECTIONS": [name]})
        )
        report = root / f"{name}.report.jsonl"
        code, out = run_cli(
            ["ingest", "--config", str(cfg), *flags, "--no_progress", "--report", str(report)]
        )
        skipped = report.read_text().splitlines() if report.exists() else []
        result[name] = {
            "exit": code,
            "out": out.splitlines(),
            "skipped": skipped,
            **collection_state(uri, name, [name]),
        }
    return result


def passes_all(root: Path) -> dict[str, Any]:
    """Every pass over two collections, run whole, in two workers and in two machine parts."""
    evalset = root / "eval.jsonl"
    runs = {
        "whole": [[]],
        "workers": [["--workers", "2"]],
        "parts": [["--part", "1/2"], ["--part", "2/2"]],
    }
    commands = [
        ["dedup", "--exact"],
        ["dedup", "--near"],
        ["curate"],
        ["langid"],
        ["redact"],
        ["decontaminate", "--against", str(evalset)],
        ["curate", "report", "--plot", str(root / "c.png")],
    ]
    result: dict[str, Any] = {}
    for run, split_flags in runs.items():
        uri = f"local://{root / ('db_' + run)}"
        cfg = root / f"passes_{run}.json"
        cfg.write_text(
            json.dumps(
                {
                    "MONGO_CONNECTION_STRING": uri,
                    "MONGO_CONNECTION_DB": "corpus",
                    "COLLECTIONS": ["one", "two"],
                }
            )
        )
        steps: list[Any] = []
        for coll, limit in (("one", "300"), ("two", "200")):
            steps.append(
                run_cli(
                    [
                        "ingest",
                        "--config",
                        str(cfg),
                        "--collection",
                        coll,
                        "--sample",
                        "stdlib",
                        "--limit",
                        limit,
                        "--no_progress",
                    ]
                )
            )
        # An evaluation set sharing its text with two documents of "one".
        held = collection_state(uri, "corpus", ["one"])["documents"]["one"]
        evalset.write_text("".join(json.dumps({"text": held[i]["filt_text"]}) + "\n" for i in (10, 200)))
        for command in commands:
            for flags in split_flags if command[-1] != str(root / "c.png") else [[]]:
                extra = [] if command[:2] == ["curate", "report"] else [*flags, "--no_progress"]
                code, out = run_cli([*command, "--config", str(cfg), *extra])
                steps.append({"command": command[:2], "flags": flags, "exit": code, "out": out.splitlines()})
        result[run] = {"steps": steps, **collection_state(uri, "corpus", ["one", "two"])}
    return result


def train_runs(root: Path) -> dict[str, Any]:
    """Seeded tiny runs: each step's loss and the block ids each step trained on (from metrics.jsonl
    and `dsgpt2 lineage`)."""
    cfg = root / "train.json"
    uri = f"local://{root / 'db_train'}"
    cfg.write_text(
        json.dumps(
            {"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "corpus", "COLLECTIONS": ["stdlib"]}
        )
    )
    run_cli(["ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "600", "--no_progress"])
    vocab = root / "vocab"
    run_cli(
        [
            "vocab",
            "train",
            "--config",
            str(cfg),
            "--vocab_size",
            "600",
            "--out",
            str(vocab),
            "--no_progress",
            "--from_mongo",
        ]
    )
    result: dict[str, Any] = {}
    for optimizer in ("adamw", "muon"):
        ckpt = root / f"ckpt_{optimizer}"
        argv = [
            "train",
            "--config_train",
            str(cfg),
            "--model_select",
            "tiny",
            "--vocab_dir",
            str(vocab),
            "--ckpt_dir",
            str(ckpt),
            "--workspace",
            str(root / f"ws_{optimizer}"),
            "--train_iters",
            "6",
            "--seed",
            "7",
            "--optimizer",
            optimizer,
            "--deepspeed_config",
            "configs/recipes/ds_muon.json",
            "--eval_interval",
            "3",
            "--save_interval",
            "6",
        ]
        env = {**os.environ, "DSGPT2_PROGRESS_SECONDS": "1000"}
        proc = subprocess.run(
            [sys.executable, "-m", "dsgpt2", *argv], capture_output=True, text=True, env=env
        )
        metrics = []
        for path in sorted((root / f"ws_{optimizer}").rglob("metrics.jsonl")):
            metrics += [json.loads(line) for line in path.read_text().splitlines()]
        kept = [
            {
                k: v
                for k, v in m.items()
                if k in ("step", "loss", "val_loss", "lr", "grad_norm", "tokens", "kind", "event", "skipped")
            }
            for m in metrics
        ]
        lineage = subprocess.run(
            [
                sys.executable,
                "-m",
                "dsgpt2",
                "lineage",
                "--ckpt_dir",
                str(ckpt),
                "--doc",
                "stdlib:5",
                "--doc",
                "stdlib:40",
                "--json",
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        result[optimizer] = {
            "exit": proc.returncode,
            "metrics": kept,
            "lineage": lineage.stdout.splitlines(),
            "tail": proc.stderr.splitlines()[-3:] if proc.returncode else [],
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument(
        "--train", action="store_true", help="also seeded tiny training runs (a minute or two)"
    )
    args = parser.parse_args(argv)
    from dsgpt2.db.embedded import stop

    # One fixed place: a source's key holds its file's path.
    root = Path(tempfile.gettempdir()) / "dsgpt2-behaviour"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    found: dict[str, Any] = {"help": help_pages()}
    try:
        found["ingest"] = ingest_all(root)
        found["passes"] = passes_all(root)
        if args.train:
            found["train"] = train_runs(root)
    finally:
        for db in root.glob("db_*"):
            with contextlib.suppress(Exception):
                stop(db)
    Path(args.out).write_text(
        json.dumps(scrub(found, str(root)), indent=1, sort_keys=True, default=str) + "\n"
    )
    shutil.rmtree(root, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
