"""The suite's own guarantees: a hung test fails instead of holding CI; a command forked from the
pre-imported interpreter behaves as a fresh process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, pyproject
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
    tracebacks as from a fresh ``python``; atexit hooks run; a command past its deadline is killed."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print(sys.argv[1:], os.getcwd(), os.environ.get('PROBE'), repr(sys.stdin.read()), sys.path[0])\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'raise': raise ValueError('boom')\n"
        "if sys.argv[1] == 'hang': import time; time.sleep(600)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PROBE": "yes"}
    got = run_python([str(script), "5"], cwd=tmp_path, env=env)
    assert got.returncode == 5 and got.stderr == "to stderr\n"
    assert got.stdout == f"['5'] {tmp_path} yes '' {tmp_path}\natexit ran\n"
    failed = run_python([str(script), "raise"], cwd=tmp_path, env=env)
    assert failed.returncode == 1 and failed.stderr.splitlines()[-1] == "ValueError: boom"
    module = run_python(["-m", "dsgpt2", "--version"], cwd=tmp_path, env=env)
    assert module.returncode == 0 and module.stdout.startswith("dsgpt2 ")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python([str(script), "hang"], cwd=tmp_path, env=env, timeout=2)
    assert time.monotonic() - started < deadline(30)
    assert run_python([str(script), "0"], cwd=tmp_path, env=env).returncode == 0  # the server goes on


def test_ci_lints_and_tests_as_the_readme_says() -> None:
    """``.ci/run`` runs the whole ``make lint`` (ruff check, ruff's format check, shellcheck) and then
    ``make test``: a change that is not lint-clean is red like one that fails a test."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in ci if line and not line.startswith("#")]
    assert commands.index("make lint") < commands.index("make test")
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    assert "ruff check ." in lint and "ruff format --check ." in lint and "shellcheck" in lint
