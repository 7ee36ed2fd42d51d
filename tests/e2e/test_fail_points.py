"""Faults the way MongoDB's drivers test them: ``failCommand`` fail points on the test server, under every
command that writes or reads the corpus outside training (training's own: tests/train/test_run_faults.py).

Error codes 91 (ShutdownInProgress), 189 (PrimarySteppedDown), 10107 (NotWritablePrimary) and 11600
(InterruptedAtShutdown) and dropped connections are what a replica set's failover looks like to a client.
Armed for ``times: 2`` (pymongo retries a read or a write once itself), dsgpt2's own retries must carry
the command through to the result of a run without faults; armed for good, the command ends with one line
and a re-run, once the server answers, ends as a straight run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli, store_config
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from wire_server import fail_point

N = 600


@pytest.fixture
def corpus(tmp_path: Path) -> Any:
    """A config on the test server (fail points off again afterwards) and a JSONL file of ``N`` records,
    every 10th an exact copy of the one before."""
    cfg, _ = store_config(tmp_path, ["docs"])
    lines = tmp_path / "docs.jsonl"
    texts = [f"document {j}: words about the number {j}" for j in (i - (i % 10 == 9) for i in range(N))]
    lines.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    uri = json.loads(cfg.read_text())["MONGO_CONNECTION_STRING"]
    yield cfg, lines, uri
    fail_point(uri, "off")


def _docs(cfg: Path) -> list[dict[str, Any]]:
    conn = Connection(load_config(cfg))
    return sorted(
        conn.db["docs"].find({}, {"_id": 0, "idx": 1, "filt_text": 1, "dup_of": 1}), key=lambda d: d["idx"]
    )


def _ingest(cfg: Path, lines: Path) -> Any:
    return run_cli("ingest", "--config", str(cfg), "--collection", "docs", "--batch_size", "50",
                   "--no_progress", str(lines))  # fmt: skip


@pytest.mark.parametrize("fault", [{"errorCode": 91}, {"errorCode": 10107}, {"closeConnection": True}])
def test_ingest_goes_on_through_transient_write_errors(corpus: Any, fault: dict[str, Any]) -> None:
    cfg, lines, uri = corpus
    fail_point(uri, {"skip": 3, "times": 4}, failCommands=["insert"], **fault)
    done = _ingest(cfg, lines)
    assert done.returncode == 0, done.stderr
    assert "transient MongoDB error" in done.stderr  # past pymongo's own retry: ours
    docs = _docs(cfg)
    assert [d["idx"] for d in docs] == list(range(N))  # every record once, idx contiguous
    assert len({d["filt_text"] for d in docs}) == N - N // 10


def test_ingest_past_its_retries_ends_with_one_line_and_resumes_exactly(corpus: Any) -> None:
    cfg, lines, uri = corpus
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "RETRIES": 2, "RETRY_BACKOFF_S": 0.01}))
    fail_point(uri, {"skip": 4}, failCommands=["insert"], errorCode=11600)
    failed = _ingest(cfg, lines)
    assert failed.returncode == 3, failed.stderr  # the server's fault, not the input's: resumable
    last = failed.stderr.strip().splitlines()[-1]
    assert (
        "failed 3 times" in last
        and "re-run the same command to resume" in last
        and "Traceback" not in failed.stderr
    )
    assert 0 < len(_docs(cfg)) < N
    fail_point(uri, "off")
    again = _ingest(cfg, lines)
    assert again.returncode == 0 and "resumed after record" in again.stdout, again.stderr
    assert [d["idx"] for d in _docs(cfg)] == list(range(N))


@pytest.mark.slow
@pytest.mark.parametrize("code", [189, 11600])
def test_curation_passes_go_on_through_transient_errors(corpus: Any, code: int) -> None:
    cfg, lines, uri = corpus
    assert _ingest(cfg, lines).returncode == 0
    for args in (("dedup", "--exact", "--batch_size", "100"), ("curate", "--batch_size", "100")):
        fail_point(uri, {"skip": 2, "times": 6}, failCommands=["find", "aggregate", "update"], errorCode=code)
        done = run_cli(*args, "--config", str(cfg), "--no_progress")
        assert done.returncode == 0, done.stderr
        assert "transient MongoDB error" in done.stderr, args
    fail_point(uri, "off")
    docs = _docs(cfg)
    assert sum("dup_of" in d for d in docs) == N // 10  # the same marks as a run without faults
    conn = Connection(load_config(cfg))
    assert conn.db["docs"].count_documents({"passes": {"$exists": True}}) == N


def test_vocab_download_goes_on_through_transient_errors(corpus: Any, tmp_path: Path) -> None:
    cfg, lines, uri = corpus
    assert _ingest(cfg, lines).returncode == 0
    fail_point(uri, {"skip": 1, "times": 4}, failCommands=["find", "aggregate"], errorCode=91)
    out = tmp_path / "shards"
    done = run_cli(
        "vocab", "download", "--config", str(cfg), "--out", str(out), "--chunk", "100", "--no_progress"
    )
    assert done.returncode == 0, done.stderr
    fail_point(uri, "off")
    exported = [
        json.loads(line) for p in sorted(out.glob("shard-*.jsonl")) for line in p.read_text().splitlines()
    ]
    assert sorted(r["idx"] for r in exported) == list(range(N))  # every document once


@pytest.mark.parametrize(
    "args", [("dedup", "--exact", "--batch_size", "100"), ("vocab", "download", "--chunk", "100")], ids=str
)
def test_a_pass_or_download_past_its_retries_ends_with_exit_3_and_resumes(
    corpus: Any, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """Past its retries a command ends as training does when the server goes: one line, exit 3 (the
    server's fault, the work done kept), not 2, which says the input was wrong; run again, it ends as a
    straight run."""
    cfg, lines, uri = corpus
    assert _ingest(cfg, lines).returncode == 0
    data = json.loads(cfg.read_text())
    cfg.write_text(json.dumps({**data, "RETRIES": 1, "RETRY_BACKOFF_S": 0.01}))
    out = ("--out", str(tmp_path / "shards")) if args[0] == "vocab" else ()
    command = (*args, "--config", str(cfg), *out, "--no_progress")
    fail_point(uri, {"skip": 1}, failCommands=["find", "aggregate", "update"], errorCode=11600)
    failed = run_cli(*command)
    assert failed.returncode == 3, failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert "failed 2 times" in last and "Traceback" not in failed.stderr, failed.stderr
    fail_point(uri, "off")
    again = run_cli(*command)
    assert again.returncode == 0, again.stderr
    if out:
        shards = sorted((tmp_path / "shards").glob("shard-*.jsonl"))
        idx = sorted(json.loads(r)["idx"] for p in shards for r in p.read_text().splitlines())
        assert idx == list(range(N))
    else:
        assert sum("dup_of" in d for d in _docs(cfg)) == N // 10


def test_an_evaluation_record_is_written_once_through_transient_errors(
    corpus: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from dsgpt2.db.client import EVAL_RESULTS
    from dsgpt2.db.meta import record_eval

    cfg, _, uri = corpus
    conn = Connection(load_config(cfg))
    fail_point(uri, {"times": 2}, failCommands=["update"], errorCode=189)
    stored = record_eval(conn, {"metrics": {"loss": 1.25}})
    records = list(conn.db[EVAL_RESULTS].find())
    assert [r["_id"] for r in records] == [stored] and records[0]["metrics"] == {"loss": 1.25}
    assert "transient MongoDB error" in caplog.text
