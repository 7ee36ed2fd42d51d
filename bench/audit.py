"""What a command asks MongoDB, by pymongo's command monitoring: every command of every process
(DataLoader workers included), its filter and the documents it returned, and when the run's first
loss was computed.

    python -m bench.audit OUT.jsonl train DS_TRAINER_FLAGS...
    python -m bench.audit OUT.jsonl dsgpt2 SUBCOMMAND FLAGS...

Each line of OUT.jsonl is one command ({"pid", "t", "name", "collection", "filter", "sort", "limit",
"returned"}: the documents its reply carried, or a count's answer) or an event of the command:
``start`` (with the main process's pid), ``first_loss`` (the first micro-batch's loss computed),
``end``; ``t`` counts seconds from the start of this process. :func:`startup` picks what the main
process asked before its first loss (or in all, for a command without steps), :func:`bounded` says
whether a command's work is bounded by an index or by the small meta collection rather than by the
size of a collection, :func:`shape` is a command with its numbers left out (to compare two corpus
sizes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pymongo import monitoring

START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
# The connection's own talk: the handshake, authentication, sessions, server monitoring.
_SESSION = {"hello", "ismaster", "isMaster", "saslStart", "saslContinue", "ping", "endSessions", "buildInfo",
            "buildinfo", "getnonce", "authenticate"}  # fmt: skip
_COLLECTION_KEY = {"getMore": "collection"}


class Recorder(monitoring.CommandListener):
    """Appends each command, as it succeeds or fails, to ``path`` (one write per line: safe across
    the processes that inherit it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pending: dict[int, dict[str, Any]] = {}

    def _record(self, event: monitoring.CommandStartedEvent) -> dict[str, Any] | None:
        name = event.command_name
        if name in _SESSION:
            return None
        cmd = event.command
        coll = cmd.get(_COLLECTION_KEY.get(name, name))
        return {
            "pid": os.getpid(),
            "t": round(time.monotonic() - START, 4),
            "name": name,
            "collection": coll if isinstance(coll, str) else None,
            "filter": _plain(cmd.get("filter", cmd.get("query", cmd.get("pipeline", cmd.get("q"))))),
            "sort": _plain(cmd.get("sort")),
            "limit": cmd.get("limit"),
            "updates": len(cmd.get("updates", cmd.get("documents", cmd.get("deletes", [])))) or None,
        }

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        record = self._record(event)
        if record is not None:
            self.pending[event.request_id] = record

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        record = self.pending.pop(event.request_id, None)
        if record is None:
            return
        reply = event.reply
        cursor = reply.get("cursor") or {}
        batch = cursor.get("firstBatch", cursor.get("nextBatch"))
        record["returned"] = len(batch) if batch is not None else reply.get("n")
        _append(self.path, record)

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        record = self.pending.pop(event.request_id, None)
        if record is not None:
            _append(self.path, {**record, "failed": str(event.failure)[:200]})


def _plain(value: Any) -> Any:
    """A command's argument as JSON (ObjectIds and the like as their text)."""
    return json.loads(json.dumps(value, default=str)) if value is not None else None


def _append(path: str, record: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


@dataclass
class Audit:
    """One audited command: every database command of its processes, and its events."""

    commands: list[dict[str, Any]]
    events: dict[str, dict[str, Any]]

    @property
    def seconds(self) -> float:
        """Launch to the first micro-batch's loss (a run), or to the end (any other command)."""
        return float((self.events.get("first_loss") or self.events["end"])["t"])

    def startup(self) -> list[dict[str, Any]]:
        """The main process's commands before its first loss (all of them without steps)."""
        until = (self.events.get("first_loss") or {"t": float("inf")})["t"]
        main = self.events["start"]["pid"]
        return [c for c in self.commands if c["pid"] == main and c["t"] <= until]


def read(path: str) -> Audit:
    commands, events = [], {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "event" in r:
                events.setdefault(r["event"], r)
            else:
                commands.append(r)
    return Audit(commands, events)


def run(argv: list[str], out: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
        runner: Any = None) -> Audit:  # fmt: skip
    """``python -m bench.audit OUT ARGV...`` in a process of its own; its audit (it must succeed).
    ``runner(args, cwd=, env=)``: how to start ``python ARGS`` (the tests fork a pre-imported one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["-m", "bench.audit", str(out), *argv]
    if runner is None:
        result = subprocess.run([sys.executable, *args], env=env, cwd=cwd or ROOT, capture_output=True,
                                text=True, timeout=600)  # fmt: skip
    else:
        result = runner(args, cwd=cwd or ROOT, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed: {(result.stdout + result.stderr)[-3000:]}")
    return read(str(out))


def shape(command: dict[str, Any]) -> tuple[Any, ...]:
    """The command without its numbers: the same at any corpus size when nothing grows with it."""

    def strip(value: Any) -> Any:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return "#"
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        return [strip(v) for v in value] if value and not isinstance(value[0], (int, float)) else "[#]"

    return (
        command["name"],
        command["collection"],
        json.dumps(strip(command["filter"])),
        json.dumps(command["sort"]),
        command["limit"],
    )


_INDEX_OPERATORS = {"$gte", "$gt", "$lt", "$lte", "$in", "$eq"}


def _index_bounded(condition: Any) -> bool:
    """A filter on ``idx`` alone, by a range, a value or a list of values: an index walk."""
    if not isinstance(condition, dict) or set(condition) != {"idx"}:
        return False
    value = condition["idx"]
    if isinstance(value, int):
        return True
    return (
        isinstance(value, dict) and bool(value) and set(value) <= {"$gte", "$gt", "$lt", "$lte", "$in", "$eq"}
    )


def bounded(command: dict[str, Any], meta: str = "meta_info") -> bool:
    """Whether the command's work is independent of the size of the collection it reads."""
    name, flt = command["name"], command["filter"]
    if command["collection"] == meta or name in {"listIndexes", "listCollections", "create", "createIndexes"}:
        return True
    if command["collection"] in ("checkpoints.files", "tokenizers.files"):
        return True  # one small document per stored checkpoint or tokenizer file (`info` lists them)

    if name == "getMore":
        return True  # the continuation of a cursor: bounded by the command that opened it
    if name == "find":
        limited = command["limit"] is not None and 0 < command["limit"] <= 1000
        by_idx = command["sort"] in ({"idx": 1}, {"idx": -1})
        return _index_bounded(flt) or (not flt and limited and by_idx)
    if name == "count":  # with no filter, the collection's metadata count (estimated_document_count)
        return not flt or _index_bounded(flt)
    # Writes of the documents they carry (a run's note in meta_info, an evaluation's record).
    return name in {"insert", "update"} and bool(command.get("updates"))


def main(argv: list[str]) -> int:
    out, kind, *rest = argv
    open(out, "w").close()

    def event(name: str) -> None:
        _append(out, {"event": name, "pid": os.getpid(), "t": round(time.monotonic() - START, 4)})

    event("start")
    monitoring.register(Recorder(out))
    if kind == "train":
        from dsgpt2.train import trainer

        seen: list[int] = []

        def on_loss(micro: int, loss: Any) -> Any:
            if not seen:  # this process's first (a resumed run counts on from its checkpoint)
                event("first_loss")
            seen.append(micro)
            return loss

        code = trainer.main(rest, on_loss=on_loss)
    else:
        from dsgpt2.cli.main import main as cli

        code = cli(rest)
    event("end")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
