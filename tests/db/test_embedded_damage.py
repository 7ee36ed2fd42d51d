"""``local://DIR`` after a stop at the wrong moment or a damaged file: a server that no server.json names
(a first command stopped while it made the database, a server.json overwritten) is found and stopped
rather than keeping the data locked for an hour; data without the engine's own record is refused rather
than set aside under a new, empty database."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from dsgpt2.db import embedded, procfs
from pace import alive, deadline, wait_for


def _servers_on(directory: Path) -> list[int]:
    data = str(directory / "data")
    return [pid for pid, words in procfs.own_processes() if embedded.served_data(words) == Path(data)]


def test_the_first_server_of_a_command_stopped_while_it_made_the_database_is_found_and_stopped(
    local_db: Any,
) -> None:
    """A first command killed while its login-less server made the database's user leaves that server
    running on a port nothing records, holding the data: status names it, the next command stops it."""
    cfg, directory = local_db
    embedded.check_directory(directory)
    stray = embedded._launch(directory, embedded.server_command(), 0, auth=False)  # as provision starts it
    assert not (directory / "server.json").exists() and not (directory / "secret").exists()
    assert embedded.strays(directory) == [stray.pid]
    status = run_cli("db", "status", str(directory))
    assert "not running" in status.stdout and f"(pid {stray.pid}) holds its data" in status.stdout, (
        status.stdout
    )
    ingest = run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "20")
    assert ingest.returncode == 0, ingest.stderr
    assert f"a server (pid {stray.pid}) that no server.json names held its data" in ingest.stderr
    wait_for(lambda: not alive(stray.pid), 10, "the stray server's end")
    assert _servers_on(directory) == [json.loads((directory / "server.json").read_text())["pid"]]


def test_a_server_whose_server_json_was_damaged_is_stopped_by_db_stop_or_the_next_command(
    local_db: Any,
) -> None:
    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "20").returncode == 0
    first = json.loads((directory / "server.json").read_text())["pid"]
    (directory / "server.json").write_text("garbage")
    info = run_cli("info", "--config", str(cfg))
    assert info.returncode == 0 and "stdlib: 20 documents" in info.stdout, info.stderr
    wait_for(lambda: not alive(first), 10, "the unnamed server's end")
    second = json.loads((directory / "server.json").read_text())["pid"]
    assert _servers_on(directory) == [second]
    (directory / "server.json").write_text("garbage")
    stopped = run_cli("db", "stop", str(directory))
    assert stopped.returncode == 0 and f"stopped (pid {second})" in stopped.stdout, stopped.stdout
    end_by = time.monotonic() + deadline(10)
    while _servers_on(directory) and time.monotonic() < end_by:
        time.sleep(0.1)
    assert _servers_on(directory) == []


def test_data_without_the_engines_own_record_is_refused_and_left_as_it_is(local_db: Any) -> None:
    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "20").returncode == 0
    assert run_cli("db", "stop", str(directory)).returncode == 0
    (directory / "data" / "WiredTiger.turtle").unlink()
    before = sorted(p.name for p in (directory / "data").iterdir())
    info = run_cli("info", "--config", str(cfg))
    assert info.returncode == 2 and info.stderr.count("\n") == 1, info.stderr
    assert "its data holds tables but not WiredTiger.turtle" in info.stderr
    assert "begin an empty database" in info.stderr and "Traceback" not in info.stderr
    assert sorted(p.name for p in (directory / "data").iterdir()) == before  # nothing set aside


def test_a_damaged_table_file_is_one_line_naming_the_servers_log(local_db: Any) -> None:
    """A table file cut short (a copy interrupted, a disk's fault): the server answers every read of it
    with InternalError, which had ended each command in the driver's traceback."""
    cfg, directory = local_db
    assert run_cli("ingest", "--config", str(cfg), "--sample", "stdlib", "--limit", "20").returncode == 0
    assert run_cli("db", "stop", str(directory)).returncode == 0
    table = directory / "data" / "secantus_collections.wt"
    with open(table, "r+b") as f:
        f.truncate(table.stat().st_size // 2)
    for command in (("info",), ("validate",)):
        result = run_cli(*command, "--config", str(cfg))
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
        assert "the database server failed a command with an internal error" in result.stderr
        assert "server.log" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_a_pipe_folder_or_junk_among_the_servers_own_files_is_said_not_waited_on(tmp_path: Path) -> None:
    """A named pipe as server.json, secret or the directory's marker hung every command on the database;
    a server.json of another shape, a folder or non-UTF-8 bytes as secret ended in a traceback."""
    import os

    from dsgpt2.errors import ConfigError, MongoUnavailableError

    directory = tmp_path / "db"
    directory.mkdir()
    (directory / "server.json").write_text("[1, 2]")
    assert embedded._read_state(directory) is None
    (directory / "server.json").unlink()
    os.mkfifo(directory / "server.json")
    assert embedded._read_state(directory) is None
    damages = ((b"\xff\xfe", "cannot be read ('utf-8' codec"), ("pipe", "a named pipe, not a regular"),
               ("folder", "a directory, not a file"))  # fmt: skip
    for damage, said in damages:
        secret = directory / "secret"
        if secret.is_dir():
            secret.rmdir()
        else:
            secret.unlink(missing_ok=True)
        if damage == "pipe":
            os.mkfifo(secret)
        elif damage == "folder":
            secret.mkdir()
        else:
            secret.write_bytes(damage)
        with pytest.raises(MongoUnavailableError, match=r"its password file ") as err:
            embedded._secret(directory)
        assert said in str(err.value) and "move it away, and run the command again" in str(err.value)
    os.mkfifo(directory / embedded.MARKER)
    with pytest.raises(ConfigError, match=rf"{embedded.MARKER} is damaged"):
        embedded.check_directory(directory)
