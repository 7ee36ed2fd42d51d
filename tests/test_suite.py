"""The suite's own guarantees: a hung test fails instead of holding CI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, pyproject


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
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert time.monotonic() - started < 60
    assert result.returncode == 1, result.stdout[-2000:]
    assert "Timeout (>2.0s)" in result.stdout and "1 failed, 1 passed" in result.stdout, result.stdout[-2000:]
