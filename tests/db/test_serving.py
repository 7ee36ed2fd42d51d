"""``dsgpt2 db serve``: the embedded server in the foreground, as a container runs mongod (the compose
stack's mongo service where no mongo image can be pulled): a deployment's user and password, the name
other hosts reach it by, found by the commands of its own machine, stopped by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, write_config
from dsgpt2.collective import free_port
from dsgpt2.db import embedded, procfs
from pace import deadline, wait_for


@pytest.mark.slow
def test_serve_runs_the_server_in_the_foreground_with_the_deployments_user(tmp_path: Path) -> None:
    import pymongo

    directory, port, password = tmp_path / "db", free_port(), "s3cret-of-the-stack"
    env = {**os.environ, "MONGO_PASSWORD": password}
    argv = [sys.executable, "-m", "dsgpt2", "db", "serve", f"local://{directory}", "--host", "0.0.0.0",
            "--port", str(port), "--user", "trainer", "--advertise", "db.example"]  # fmt: skip
    out = tmp_path / "serve.log"
    with (
        open(out, "w") as log,
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) as proc,
    ):
        try:
            wait_for(lambda: "listening on" in out.read_text(), 60, "the server to listen", proc)
            first = out.read_text().splitlines()[0]
            assert first == (f"local://{directory}: serving on 0.0.0.0:{port} as db.example:{port} "
                             f"(pid {proc.pid}); Ctrl-C or SIGTERM stops it")  # fmt: skip
            # The deployment's user with its password; a wrong one refused; no password, no reads.
            uri = f"mongodb://trainer:{password}@127.0.0.1:{port}/?authSource=admin&directConnection=true"
            with pymongo.MongoClient(uri, serverSelectionTimeoutMS=10000) as client:
                client.corpus.docs.insert_one({"idx": 0})
                hello = client.admin.command("hello")
                # Drivers connect to the member it names: the name the other hosts reach it by.
                assert hello["me"] == f"db.example:{port}" and hello["hosts"] == [f"db.example:{port}"]
            wrong = f"mongodb://trainer:nope@127.0.0.1:{port}/?authSource=admin&directConnection=true"
            with (
                pymongo.MongoClient(wrong, serverSelectionTimeoutMS=5000) as client,
                pytest.raises(pymongo.errors.OperationFailure),
            ):
                client.admin.command("ping")
            # This process became the server (its pid), and the machine's own commands find it by its
            # directory: status, and a command naming local://DIR that reads what the stack wrote.
            status = run_cli("db", "status", f"local://{directory}", "--json")
            assert json.loads(status.stdout)["pid"] == proc.pid, status.stdout
            cfg = write_config(tmp_path / "c.json", MONGO_CONNECTION_STRING=f"local://{directory}",
                               MONGO_CONNECTION_DB="corpus", COLLECTIONS=["docs"])  # fmt: skip
            connection = embedded.ensure(directory, create=False)
            with pymongo.MongoClient(connection, serverSelectionTimeoutMS=10000) as client:
                assert client.corpus.docs.count_documents({}) == 1
            assert embedded.running(directory).pid == proc.pid  # type: ignore[union-attr]
            assert cfg.exists()
            # A second server on the same directory: refused in one line, naming the one that runs.
            twice = run_cli("db", "serve", f"local://{directory}", "--port", str(free_port()))
            assert twice.returncode == 2 and len(twice.stderr.strip().splitlines()) == 1, twice.stderr
            assert f"a server already runs on it (pid {proc.pid}, port {port})" in twice.stderr
            # Another directory on the port it holds: one line before anything starts, not a traceback.
            busy = run_cli("db", "serve", f"local://{tmp_path / 'other'}", "--port", str(port))
            assert busy.returncode == 2 and len(busy.stderr.strip().splitlines()) == 1, busy.stderr
            assert f"--port {port} on 127.0.0.1 is in use by another program" in busy.stderr
            proc.send_signal(signal.SIGTERM)
            proc.wait(deadline(30))
        finally:
            if proc.poll() is None:
                proc.kill()
    assert password not in out.read_text()
    assert embedded.running(directory) is None
    # Stopped, its data is the directory's as ever: the next command starts a background server on it.
    code = (
        "import sys, pymongo\n"
        "from dsgpt2.db import embedded\n"
        "directory = embedded.local_dir(sys.argv[1])\n"
        "with pymongo.MongoClient(embedded.ensure(directory), serverSelectionTimeoutMS=10000) as client:\n"
        "    print(client.corpus.docs.count_documents({}), client.admin.command('hello')['me'])\n"
        "embedded.stop(directory)\n"
    )
    after = subprocess.run([sys.executable, "-c", code, f"local://{directory}"], capture_output=True,
                           text=True, timeout=deadline(60), check=False)  # fmt: skip
    count, me = after.stdout.split()
    assert after.returncode == 0 and count == "1" and me.startswith("127.0.0.1:"), after.stderr[-2000:]


def test_serve_refuses_a_user_without_a_password_and_its_flags_elsewhere(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MONGO_PASSWORD"}
    directory = tmp_path / "db"
    done = run_cli("db", "serve", f"local://{directory}", "--user", "trainer", env=env)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "--user trainer needs its password in $MONGO_PASSWORD (--password_env)" in line
    other = run_cli(
        "db", "serve", f"local://{directory}", "--user", "t", "--password_env", "STACK_PW", env=env
    )
    assert other.returncode == 2 and "needs its password in $STACK_PW" in other.stderr
    assert not directory.exists()  # refused before anything was made
    anywhere = run_cli("db", "serve", f"local://{directory}", "--port", "0")
    assert anywhere.returncode == 2 and "--port 0: a served database needs a fixed port" in anywhere.stderr
    flags = run_cli("db", "status", f"local://{directory}", "--port", "27018", "--advertise", "x")
    assert flags.returncode == 2 and "--port, --advertise: only for dsgpt2 db serve" in flags.stderr


def test_a_server_is_its_pid_and_start_time_not_a_reused_pid(tmp_path: Path) -> None:
    here = os.getpid()
    started = procfs.start_time(here)
    assert started is not None and started > 0
    assert embedded.is_server(here, tmp_path, started)
    # The pid now names another process (a reused pid): one started at another time.
    assert not embedded.is_server(here, tmp_path, started + 1)
    # A server file without the start time (written before it was recorded): the command line decides.
    assert not embedded.is_server(here, tmp_path)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "data")]
    with subprocess.Popen(sleeper) as old:
        try:
            until = time.monotonic() + deadline(30)
            while not embedded.is_server(old.pid, tmp_path) and time.monotonic() < until:
                time.sleep(0.01)  # its command line is the new one once its exec is through
            assert embedded.is_server(old.pid, tmp_path)
        finally:
            old.kill()
        old.wait()
    assert not embedded.is_server(old.pid, tmp_path, started)


def test_a_command_waits_for_a_served_database_still_opening_its_data(tmp_path: Path) -> None:
    """Between `dsgpt2 db serve` becoming the server and the server listening (WiredTiger opening the
    data), a command that needs the database finds its process and waits for it, rather than start a
    second server on the same data."""
    directory = tmp_path / "db"
    made = "import sys\nfrom pathlib import Path\nfrom dsgpt2.db import embedded\nd = Path(sys.argv[1])\n"
    made += "embedded.ensure(d)\nembedded.stop(d)\n"
    subprocess.run([sys.executable, "-c", made, str(directory)], check=True, timeout=deadline(60))
    port = free_port()
    opening = (
        "import socket, sys, time\n"
        "time.sleep(1.5)\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
        "time.sleep(60)\n"
    )
    # A process whose command line does not name the data, as `dsgpt2 db serve`'s does not before its
    # exec into the server: the server file names it by its pid and start time, as that command writes it.
    with subprocess.Popen([sys.executable, "-c", opening, str(port)]) as server:
        try:
            state = embedded.ServerState(server.pid, port, started=procfs.start_time(server.pid))
            (directory / "server.json").write_text(state.record())
            uri = embedded.ensure(directory)
            assert f"@127.0.0.1:{port}/" in uri
            assert json.loads((directory / "server.json").read_text())["pid"] == server.pid
        finally:
            server.kill()
