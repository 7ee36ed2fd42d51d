"""Real server faults, on the wire-protocol test server: killed, restarted, hung, slow.

The server here is a process of its own (tests/wire_server.py) that these tests SIGKILL, restart on
the same port and data file, and SIGSTOP: what a client sees when MongoDB crashes, fails over or
hangs. Each test works in a database of its own.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, make_config, run_wire_server
from dsgpt2.checkpoints.format import CHECKPOINTS
from dsgpt2.corpus.ingest import ingest
from dsgpt2.corpus.readers import builtin_source
from dsgpt2.db.blobs import BlobStore
from dsgpt2.db.client import Connection
from dsgpt2.db.config import ENV_URI, MongoConfig
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.errors import MongoUnavailableError
from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
from dsgpt2.tokenizer.texts import mongo_texts
from dsgpt2.train.metrics import read_metrics
from forks import python_that_forks
from pace import deadline, wait_for
from wire_server import PASSWORD, Proxy, WireServer
from zygote import run_python

BUCKET = CHECKPOINTS.name

pytestmark = [pytest.mark.mongo_live, pytest.mark.slow]

# Short timeouts and few retries: a lost server is given up on within seconds.
FAST_FAIL = {
    "SERVER_SELECTION_TIMEOUT_MS": 1000,
    "SOCKET_TIMEOUT_MS": 1500,
    "RETRIES": 2,
    "RETRY_BACKOFF_S": 0.2,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WireServer]:
    """A server of this module's own: these tests kill it."""
    yield from run_wire_server(tmp_path_factory, "faults")


@pytest.fixture
def up(server: WireServer) -> Iterator[WireServer]:
    """The server, running (again) when the test starts and ends."""
    if server.proc is None:
        server.start()
    yield server
    if server.proc is None:
        server.start()
    else:
        server.resume()


def write_config(path: Path, db: str, port: int, collections: list[str], **extra: Any) -> Path:
    # The password stays in the environment (ENV_URI), as a user would keep it.
    data = {
        "MONGO_CONNECTION_STRING": f"mongodb://127.0.0.1:{port}/",
        "MONGO_CONNECTION_DB": db,
        "COLLECTIONS": collections,
        **FAST_FAIL,
        **extra,
    }
    path.write_text(json.dumps(data))
    return path


def env_for(uri: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != ENV_URI}, ENV_URI: uri}


def one_clear_line(result: Any, host: str) -> str:
    """The last stderr line of a failed command: one line naming the host, no password, no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert PASSWORD not in result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert host in last, last
    return last


def seed_corpus(server: WireServer, tmp: Path, docs: int) -> tuple[MongoConfig, str]:
    db = f"faults_{uuid.uuid4().hex[:8]}"
    cfg = make_config(["stdlib"], MONGO_CONNECTION_STRING=server.uri(), MONGO_CONNECTION_DB=db, **FAST_FAIL)
    conn = Connection(cfg)
    ingest(conn, "stdlib", [builtin_source("stdlib", docs)], batch_size=100)
    conn.close()
    return cfg, db


def test_server_killed_mid_training_checkpoints_exits_3_and_resumes_exactly(
    up: WireServer, tmp_path: Path
) -> None:
    cfg, db = seed_corpus(up, tmp_path, 160)
    texts, reader = mongo_texts(cfg)
    train_vocab(texts, tmp_path / "tok", VocabSettings(vocab_size=320), "test", progress=False)
    reader.connection.close()
    config = write_config(tmp_path / "mongo.json", db, up.port, ["stdlib"])
    iters = 40

    def command(run: Path) -> list[str]:
        return [
            python_that_forks(), "ds_trainer.py",  # a fork of the pre-imported interpreter
            "--deepspeed_config", "configs/ds_config_cpu.json", "--config_train", str(config),
            "--vocab_dir", str(tmp_path / "tok"), "--model_select", "tiny", "--context_length", "32",
            "--tr_ratio", "0.9", "--chunk_docs", "2", "--num_workers", "1", "--seed", "3",
            "--train_iters", str(iters), "--eval_interval", "1000", "--save_interval", "1000",
            "--log_interval", "1", "--log_block_ids", "--wandb", "off",
            "--ckpt_dir", str(run / "ckpt"), "--workspace", str(run / "ws"),
        ]  # fmt: skip

    def steps(run: Path) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == "train"}

    env = env_for(up.uri())
    straight = run_python(command(tmp_path / "straight")[1:], cwd=ROOT, env=env)
    assert straight.returncode == 0, straight.stderr[-3000:]

    run = tmp_path / "killed"
    proc = subprocess.Popen(command(run), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    metrics = run / "ws" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 2, 120, "step 2", proc)
    up.kill()
    killed_at = time.monotonic()
    out, err = proc.communicate(timeout=deadline(120))
    # Retries: 3 attempts of up to 1 s server selection, 0.2 s and 0.4 s apart, then the save.
    assert time.monotonic() - killed_at < 30
    assert proc.returncode == 3, err[-3000:]
    last = one_clear_line(subprocess.CompletedProcess([], 3, out, err), f"127.0.0.1:{up.port}")
    assert last.startswith("ds_trainer.py: error:") and "re-run to resume" in last
    saved = max(steps(run))
    assert 2 <= saved < iters
    assert (run / "ckpt" / "latest").read_text() == f"global_step{saved}"

    up.start()  # the same port and data file
    again = run_python(command(run)[1:], cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {run / 'ckpt' / f'global_step{saved}'}" in again.stderr
    a, b = steps(tmp_path / "straight"), steps(run)
    assert sorted(a) == sorted(b) == list(range(1, iters + 1))
    for step in a:
        assert a[step]["block_ids"] == b[step]["block_ids"], step
        # Float rounding: under Muon and WSD the losses after this resume differ from the straight
        # run's by up to 1.4e-6 (relative 3e-7) by step 16 (AdamW, or Muon under cosine: equal).
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-5, step


def test_server_killed_during_a_save_to_the_database_leaves_the_previous_latest_and_resumes_exactly(
    up: WireServer, tmp_path: Path
) -> None:
    """``--ckpt_dir gridfs:RUN`` and the server SIGKILLed as the checkpoint of step 4 is uploaded: exit 3
    in one line; restarted, the stored latest is still step 2 (step 4's marker never stored) and the same
    command resumes from it to the straight run's losses."""
    cfg, db = seed_corpus(up, tmp_path, 160)
    texts, reader = mongo_texts(cfg)
    train_vocab(texts, tmp_path / "tok", VocabSettings(vocab_size=320), "test", progress=False)
    reader.connection.close()
    config = write_config(tmp_path / "mongo.json", db, up.port, ["stdlib"])

    def command(run: Path, *faults: str) -> list[str]:
        script = ["tests/inject.py", *faults, "--"] if faults else ["ds_trainer.py"]
        return [
            *script, "--deepspeed_config", "configs/ds_config_cpu.json", "--config_train", str(config),
            "--vocab_dir", str(tmp_path / "tok"), "--model_select", "tiny", "--context_length", "32",
            "--tr_ratio", "0.9", "--chunk_docs", "20", "--num_workers", "1", "--seed", "3",
            "--train_iters", "6", "--eval_interval", "1000", "--save_interval", "2",
            "--log_interval", "1", "--wandb", "off",
            "--ckpt_dir", f"gridfs:{run.name}", "--workspace", str(run / "ws"),
        ]  # fmt: skip

    def steps(run: Path) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in read_metrics(run / "ws" / "metrics.jsonl") if r["event"] == "train"}

    def trained(run: Path, *faults: str) -> subprocess.CompletedProcess:
        return run_python(command(run, *faults), cwd=ROOT, env=env_for(up.uri()))

    straight = trained(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    # A save uploads the model states, the resolved config, the manifest, the marker and latest: the
    # 7th upload is step 4's second file.
    killed = trained(tmp_path / "killed", "--die_uploading", "7", "--kill_server", str(up.pid))
    assert killed.returncode == 3, killed.stderr[-3000:]
    one_clear_line(killed, f"127.0.0.1:{up.port}")

    up.restart()  # the same port and data file (the killed process reaped first)
    store = BlobStore(
        Connection(make_config(MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db)), BUCKET
    )
    assert store.get_text("killed/latest", tmp_path / "x") == "global_step2"
    assert "killed/global_step4/dsgpt2_complete.json" not in store.names("killed/")
    again = trained(tmp_path / "killed")
    assert again.returncode == 0 and "at step 2" in again.stderr, again.stderr[-3000:]
    a, b = steps(tmp_path / "straight"), steps(tmp_path / "killed")
    for step in (3, 4, 5, 6):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-5, step


def test_ingest_killed_by_a_server_loss_lands_every_record_once_on_rerun(
    up: WireServer, tmp_path: Path
) -> None:
    db = f"faults_{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path / "mongo.json", db, up.port, ["lines"])
    source = tmp_path / "lines.txt"
    n = 300
    source.write_text("".join(f"record number {i}\n" for i in range(n)))
    command = [sys.executable, "-m", "dsgpt2", "ingest", "--config", str(config), "--collection", "lines",
               "--batch_size", "10", "--no_progress", str(source)]  # fmt: skip
    env = env_for(up.uri())
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    watcher = Connection(make_config(["lines"], MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db))

    def some_inserted() -> bool:
        return watcher.db["lines"].estimated_document_count() >= 40

    wait_for(some_inserted, 60, "the first batches", proc)
    watcher.close()
    up.kill()
    out, err = proc.communicate(timeout=deadline(60))
    assert proc.returncode == 3, err[-3000:]
    last = one_clear_line(subprocess.CompletedProcess([], 3, out, err), f"127.0.0.1:{up.port}")
    assert "re-run the same command to resume" in last

    up.start()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after record" in again.stdout
    conn = Connection(make_config(["lines"], MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db))
    docs = sorted(conn.db["lines"].find({}, {"_id": 0, "idx": 1, "filt_text": 1, "source_pos": 1}),
                  key=lambda d: d["idx"])  # fmt: skip
    assert [d["idx"] for d in docs] == list(range(n))
    assert [d["source_pos"] for d in docs] == list(range(n))
    assert [d["filt_text"] for d in docs] == [f"record number {i}" for i in range(n)]
    conn.close()


def test_vocab_download_killed_by_a_server_loss_finishes_exactly_once(up: WireServer, tmp_path: Path) -> None:
    _, db = seed_corpus(up, tmp_path, 120)
    # Answers slowed down on their way back: the download lasts long enough to lose its server.
    proxy = Proxy(up.port, delay=0.05)
    try:
        config = write_config(tmp_path / "mongo.json", db, proxy.port, ["stdlib"])
        out = tmp_path / "shards"
        command = [sys.executable, "-m", "dsgpt2", "vocab", "download", "--config", str(config),
                   "--out", str(out), "--workers", "1", "--shards", "6", "--chunk", "5",
                   "--no_progress"]  # fmt: skip
        uri = up.uri().replace(f":{up.port}/", f":{proxy.port}/")
        proc = subprocess.Popen(command, cwd=ROOT, env=env_for(uri), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip

        def one_shard_done() -> bool:
            try:
                return len(json.loads((out / "manifest.json").read_text())["done"]) >= 1
            except (FileNotFoundError, json.JSONDecodeError):
                return False

        wait_for(one_shard_done, 60, "the first shard", proc)
        up.kill()
        stdout, stderr = proc.communicate(timeout=deadline(60))
        assert proc.returncode == 3, stderr[-3000:]
        one_clear_line(subprocess.CompletedProcess([], 3, stdout, stderr), f"127.0.0.1:{proxy.port}")
        done_before = json.loads((out / "manifest.json").read_text())["done"]
        assert 1 <= len(done_before) < 6
        assert not list(out.glob(".shard-*"))

        up.start()
        proxy.delay = 0.0
        again = subprocess.run(
            command, cwd=ROOT, env=env_for(uri), capture_output=True, text=True, timeout=deadline(120)
        )
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"{len(done_before)} already done" in again.stdout
    finally:
        proxy.close()
    lines = [json.loads(x) for p in sorted(out.glob("shard-*.jsonl")) for x in p.read_text().splitlines()]
    assert [x["idx"] for x in lines] == list(range(120))
    assert not list(out.glob(".shard-*"))


def test_a_hung_server_is_retried_with_backoff_and_never_waits_forever(up: WireServer) -> None:
    db = f"faults_{uuid.uuid4().hex[:8]}"
    cfg = make_config(["a"], MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db, **FAST_FAIL)
    conn = Connection(cfg)
    conn.db["a"].insert_many([{"idx": i, "filt_text": f"text {i}"} for i in range(20)])
    conn.db["meta_info"].insert_one({"collection": "a", "count": 20})
    assert len(MongoWrapper(cfg, connection=conn).get_range(0, 20)) == 20

    # Hung for 4 s: reads time out, are retried with backoff, and succeed once it answers again
    # (far longer than pymongo's own single retry of a read can cover, even on a loaded machine).
    retrying = make_config(["a"], MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db,
                           **{**FAST_FAIL, "SERVER_SELECTION_TIMEOUT_MS": 500, "SOCKET_TIMEOUT_MS": 500,
                              "RETRIES": 10, "RETRY_BACKOFF_S": 0.3})  # fmt: skip
    wrapper = MongoWrapper(retrying, connection=Connection(retrying))
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("dsgpt2")
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.WARNING)
    logger.disabled = False
    logger.addHandler(handler)
    up.pause()
    timer = threading.Timer(4.0, up.resume)
    timer.start()
    try:
        stopped = up.wait_stopped()
        started = time.monotonic()
        texts = [d.text for d in wrapper.get_range(0, 20)]
        took = time.monotonic() - started
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
        timer.join()
    assert stopped, "the server did not stop on SIGSTOP"
    assert texts == [f"text {i}" for i in range(20)]
    assert took >= 2.5, (took, warnings)  # it waited for the server to answer again
    assert any("transient MongoDB error" in w for w in warnings), (took, warnings)
    assert PASSWORD not in "".join(warnings)
    wrapper.connection.close()

    # Hung for good: bounded retries, then one clear error naming the host.
    up.pause()
    started = time.monotonic()
    hung = Connection(cfg)
    with pytest.raises(MongoUnavailableError) as err:
        MongoWrapper(cfg, connection=hung).get_range(0, 20)
    hung.close()
    assert time.monotonic() - started < 15
    assert f"127.0.0.1:{up.port}" in str(err.value) and PASSWORD not in str(err.value)
    up.resume()
    conn.client.drop_database(db)
    conn.close()


# ---------------------------------------------------------------- server commands longer than a query


def test_a_server_command_longer_than_the_socket_timeout_runs_to_its_end(
    up: WireServer, tmp_path: Path
) -> None:
    """An index build the server takes 4 s over, past SOCKET_TIMEOUT_MS (1.5 s; a ``blockConnection`` fail
    point): no network error, a line while it waits, and the pass ends as a straight one."""
    _, db = seed_corpus(up, tmp_path, 300)
    config = write_config(tmp_path / "mongo.json", db, up.port, ["stdlib"])
    # Blocked more times than the retries: a socket timeout would end the command.
    up.fail({"times": 3}, failCommands=["createIndexes"], blockConnection=True, blockTimeMS=4000)
    command = [sys.executable, "-m", "dsgpt2", "dedup", "--config", str(config), "--exact", "--no_progress"]
    env = {**env_for(up.uri()), "DSGPT2_PROGRESS_SECONDS": "1"}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline(120)
        )
    finally:
        up.fail("off")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dedup: indexing stdlib: the server is still at it" in done.stderr
    assert "transient MongoDB error" not in done.stderr
    assert "stdlib: 300 documents, 0 hashed by this run; 2 exact duplicate(s)" in done.stdout


def test_the_start_up_count_and_the_wrappers_count_run_past_the_socket_timeout(
    up: WireServer, tmp_path: Path
) -> None:
    """The quick check's collection count (a walk of every record on the embedded engine) and the
    wrapper's count where meta_info has none, each blocked past SOCKET_TIMEOUT_MS every time it is
    asked: both answer the count."""
    from dsgpt2.db.validate import require_valid

    cfg, _ = seed_corpus(up, tmp_path, 120)
    conn = Connection(cfg)
    try:
        up.fail({"times": 10}, failCommands=["count"], blockConnection=True, blockTimeMS=2500)
        (report,) = require_valid(conn, full=False)
        assert report.documents == 120 and report.ok
        conn.db["meta_info"].update_one({"collection": "stdlib"}, {"$unset": {"count": ""}})
        up.fail({"times": 10}, failCommands=["aggregate"], blockConnection=True, blockTimeMS=2500)
        assert len(MongoWrapper(cfg, connection=conn)) == 120
    finally:
        up.fail("off")
        conn.close()


def test_a_server_that_stops_answering_during_a_long_command_ends_it_with_exit_3(
    up: WireServer, tmp_path: Path
) -> None:
    """The same wait, and the server hangs (SIGSTOP) meanwhile: the command ends within seconds with one
    line and exit 3, what it did kept; run again once the server answers, it ends as a straight run."""
    _, db = seed_corpus(up, tmp_path, 300)
    config = write_config(tmp_path / "mongo.json", db, up.port, ["stdlib"])
    up.fail({"times": 1}, failCommands=["aggregate"], blockConnection=True, blockTimeMS=60000)
    err = tmp_path / "stderr.txt"
    env = {**env_for(up.uri()), "DSGPT2_PROGRESS_SECONDS": "1"}
    command = [
        sys.executable,
        "-m",
        "dsgpt2",
        "curate",
        "--config",
        str(config),
        "--rules",
        "gopher",
        "--no_progress",
    ]
    with err.open("w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
        try:
            wait_for(lambda: "curate: counting stdlib: the server is still at it" in err.read_text(), 120,
                     "the count under way", proc)  # fmt: skip
            up.pause()
            paused = time.monotonic()
            proc.communicate(timeout=deadline(60))
            waited = time.monotonic() - paused
        finally:
            up.resume()
            up.fail("off")
            if proc.poll() is None:
                proc.kill()
    result = subprocess.CompletedProcess(command, proc.returncode, "", err.read_text())
    assert proc.returncode == 3, result.stderr[-3000:]
    last = one_clear_line(result, f"127.0.0.1:{up.port}")
    assert "stopped answering" in last and "run the same command again" in last
    assert waited < 30
    conn = Connection(make_config(["stdlib"], MONGO_CONNECTION_STRING=up.uri(), MONGO_CONNECTION_DB=db))
    assert conn.db["stdlib"].count_documents({"passes.gopher": {"$exists": True}}) == 300  # kept
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=deadline(120))
    assert again.returncode == 0 and "300 documents, 0 judged by this run" in again.stdout, again.stderr[
        -3000:
    ]
