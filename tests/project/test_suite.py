"""The suite's own guarantees: a hung test fails instead of holding CI; a command or a launcher's process
forked from the pre-imported interpreter behaves as a fresh process; what several test processes need is
built once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import pace
from conftest import ROOT, built_once, pyproject
from pace import deadline
from zygote import run_python


def test_every_test_has_a_deadline() -> None:
    project = pyproject()
    assert 0 < int(project["tool"]["pytest"]["ini_options"]["timeout"]) <= 600


def test_a_hung_test_fails_at_its_deadline_and_the_next_one_runs(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(
        "import threading\n\n"
        "def test_waits_on_a_thread_that_never_answers():\n"
        "    threading.Event().wait()\n\n"
        "def test_after():\n"
        "    pass\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         "--rootdir", str(tmp_path), "-o", "timeout=2", str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=deadline(120), cwd=tmp_path,
    )  # fmt: skip
    assert time.monotonic() - started < deadline(60)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "Timeout (>2.0s)" in result.stdout and "1 failed, 1 passed" in result.stdout, result.stdout[-2000:]


def test_a_forked_command_is_the_process_a_user_starts(tmp_path: Path) -> None:
    """tests/zygote.py runs ``python SCRIPT`` and ``python -m MODULE`` as forks of a pre-imported
    interpreter: its own argv, environment and directory; stdin empty; output, exit code and uncaught
    tracebacks as from a fresh ``python``, an unhandled Ctrl-C's death by SIGINT; threads joined and
    atexit hooks run at the end; a command past its deadline is killed. Its end does not tear the
    interpreter down: the fork leaves most of the server's pages untouched."""
    from zygote import _zygotes

    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, os, sys, threading, time\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print(sys.argv[1:], os.getcwd(), os.environ.get('PROBE'), repr(sys.stdin.read()), sys.path[0])\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'raise': raise ValueError('boom')\n"
        "if sys.argv[1] == 'ctrl-c': raise KeyboardInterrupt\n"
        "if sys.argv[1] == 'said': sys.exit('stopped: said why')\n"
        "def later(): time.sleep(0.3); print('joined')\n"
        "if sys.argv[1] == 'thread': threading.Thread(target=later).start()\n"
        "if sys.argv[1] == 'hang': time.sleep(600)\n"
        "sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else None)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PROBE": "yes"}
    got = run_python([str(script), "5"], cwd=tmp_path, env=env)
    assert got.returncode == 5 and got.stderr == "to stderr\n"
    assert got.stdout == f"['5'] {tmp_path} yes '' {tmp_path}\natexit ran\n"
    failed = run_python([str(script), "raise"], cwd=tmp_path, env=env)
    assert failed.returncode == 1 and failed.stderr.splitlines()[-1] == "ValueError: boom"
    assert failed.stdout.endswith("atexit ran\n")
    stopped = run_python([str(script), "ctrl-c"], cwd=tmp_path, env=env)
    assert stopped.returncode == -signal.SIGINT and stopped.stderr.splitlines()[-1] == "KeyboardInterrupt"
    said = run_python([str(script), "said"], cwd=tmp_path, env=env)
    assert said.returncode == 1 and said.stderr == "to stderr\nstopped: said why\n"
    threaded = run_python([str(script), "thread"], cwd=tmp_path, env=env)
    assert threaded.returncode == 0 and threaded.stdout.endswith("joined\natexit ran\n"), threaded.stdout
    module = run_python(["-m", "dsgpt2", "--version"], cwd=tmp_path, env=env)
    assert module.returncode == 0 and module.stdout.startswith("dsgpt2 ")
    server = _zygotes["corpus"].proc.pid
    resident = int(Path(f"/proc/{server}/statm").read_text().split()[1])
    assert _zygotes["corpus"].faults < resident / 4, (_zygotes["corpus"].faults, resident)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(script), "hang"], cwd=tmp_path, env=env, timeout=2)
    assert time.monotonic() - started < deadline(30)
    assert run_python([str(script), "0"], cwd=tmp_path, env=env).returncode == 0  # the server goes on


@pytest.mark.slow  # launches, as the rank tests (slow) do
def test_a_launch_process_is_a_fork_that_ends_as_the_process_its_parent_started(tmp_path: Path) -> None:
    """tests/forks.py's ``python``: the script or module runs in a fork of the server with the caller's
    argv, environment, directory, stdin, stdout and stderr; the fork's ``sys.executable`` forks again;
    the caller exits with the fork's code, passes SIGINT and SIGTERM on and ends as the fork did; a
    caller killed takes its fork with it; other command lines run the real interpreter."""
    from forks import _server, python_that_forks

    python = python_that_forks()
    server = _server[0].proc.pid
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(5))\n"
        "print(os.getpid(), os.getppid(), sys.argv[1:], os.getcwd(), os.environ.get('PROBE'),"
        " sys.stdin.read(), sys.executable, flush=True)\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'nested':\n"
        "    sys.exit(subprocess.run([sys.executable, '-u', __file__, '7']).returncode)\n"
        "if sys.argv[1] == 'wait': time.sleep(600)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PROBE": "yes"}
    got = subprocess.run([python, "-u", str(probe), "3"], input="typed", capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=deadline(60))  # fmt: skip
    _, parent, *rest = got.stdout.split()
    assert got.returncode == 3 and got.stderr == "to stderr\n"
    assert int(parent) == server and rest == ["['3']", str(tmp_path), "yes", "typed", python]
    nested = subprocess.run([python, str(probe), "nested"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=deadline(60))  # fmt: skip
    lines = nested.stdout.splitlines()
    assert nested.returncode == 7 and len(lines) == 2 and int(lines[1].split()[1]) == server, nested.stdout
    module = subprocess.run([python, "-m", "dsgpt2", "--version"], capture_output=True, text=True, env=env,
                            timeout=deadline(60))  # fmt: skip
    assert module.returncode == 0 and module.stdout.startswith("dsgpt2 ")
    # The environment's console scripts beside it start with it (a pipeline's `dsgpt2` on PATH forks).
    console = Path(python).with_name("dsgpt2")
    assert console.read_text().splitlines()[0] == f"#!{python}" and not console.is_symlink()
    script = subprocess.run([str(console), "--version"], capture_output=True, text=True, env=env,
                            timeout=deadline(60))  # fmt: skip
    assert script.returncode == 0 and script.stdout == module.stdout
    real = subprocess.run([python, "-c", "import os; print(os.getppid())"], capture_output=True, text=True)
    assert int(real.stdout) == os.getpid()  # -c: the interpreter itself, a child of this process
    for sig, code in ((signal.SIGINT, 5), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGKILL, None)):
        with subprocess.Popen([python, str(probe), "wait"], stdout=subprocess.PIPE, text=True,
                              env=env) as caller:  # fmt: skip
            fork = int(caller.stdout.readline().split()[0])  # type: ignore[union-attr]
            caller.send_signal(sig)
            assert caller.wait(deadline(30)) == (code if code is not None else -signal.SIGKILL)
        end = time.monotonic() + deadline(15)
        while _alive(fork) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(fork), sig


def test_ci_lints_and_tests_as_the_readme_says() -> None:
    """``.ci/run`` runs the whole ``make lint`` (ruff check, ruff's format check, shellcheck) and then
    ``make test``: a change that is not lint-clean is red like one that fails a test."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    assert commands.index("make lint") < commands.index("make test")
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check ." in lint and "ruff format --check ." in lint and "shellcheck" in lint


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_test_process_ended_by_a_signal_takes_its_servers_with_it(
    how: signal.Signals, tmp_path: Path
) -> None:
    """A test run stopped by SIGTERM (no atexit runs) or SIGKILL leaves no test server behind."""
    from wire_server import unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from wire_server import shared_server, _SHARED\n"
        "shared_server()\n"
        "print(_SHARED['proc'].pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen(
        # Its server's log in this test's directory: the process killed does not remove it.
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    ) as test_process:
        try:
            server = int(test_process.stdout.readline())  # type: ignore[union-attr]
            assert _alive(server)
            test_process.send_signal(how)
            test_process.wait(deadline(30))
            end = time.monotonic() + deadline(15)
            while _alive(server) and time.monotonic() < end:
                time.sleep(0.1)
            assert not _alive(server), f"server {server} outlived its test process"
        finally:
            test_process.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it has ended, its parent has not read it yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_fixture_built_once_is_built_by_the_first_process_to_ask_while_the_others_wait(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Three askers at once (each its own open file, as each test process has): one builds, the others
    wait for it and get the same directory; a build that failed half-way is made again, whole."""
    calls: list[Path] = []

    def build(where: Path) -> None:
        calls.append(where)
        time.sleep(0.3)
        (where / "made").write_text("whole")

    name = f"probe-{os.getpid()}-{time.monotonic_ns()}"
    tmp_path_factory.getbasetemp()  # made before the threads ask: its first making is not theirs to race
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: built_once(tmp_path_factory, name, build), range(3)))
    assert len(calls) == 1 and sorted(built for _, built in results) == [False, False, True]
    assert {(where / "made").read_text() for where, _ in results} == {"whole"}

    def broken(where: Path) -> None:
        (where / "half").write_text("")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError):
        built_once(tmp_path_factory, f"{name}-b", broken)
    where, built = built_once(tmp_path_factory, f"{name}-b", build)
    assert built and (where / "made").is_file() and not (where / "half").exists()


def test_the_reference_launch_is_timed_once_for_the_whole_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the suite's workers the controller timed it before they started: no worker times its own."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("the launch is timed by pytest-xdist's controller")
    given = float(os.environ[pace.LAUNCH_ENV])
    assert 0 < given < 600

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker timed a reference launch of its own")

    monkeypatch.setattr(pace.subprocess, "run", no_launch)
    assert pace.launch_seconds() == given
