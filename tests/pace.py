"""Deadlines that follow the machine's speed, for every test that waits on a process event.

A test waits for the event itself (a line, a file, a step, a process's exit); the deadline only tells a
hang from a slow machine. ``deadline(base)`` is ``base`` (seconds on an idle two-core machine) times the
suite's pace: how much slower than that a launch is now, measured in this test run. The pace is the
larger of
- a reference launch, against ``REFERENCE_LAUNCH_S``: a fresh interpreter that imports torch, DeepSpeed
  and transformers and takes one step of a tiny GPT-2 (what every rank and command does before its
  first step), timed once per run by pytest's controller before the workers start (scaled by workers
  per core), or by a test process of its own on first use;
- the load now: runnable processes per core (a second ``make test`` beside this one doubles it), as
  the reference launch measured once cannot follow a load that comes later.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The reference launch on a two-core machine with one other process running: 6-7 s.
REFERENCE_LAUNCH_S = 7.0
# A deadline stays a deadline: past this many times its base, something hangs.
MAX_PACE = 6.0

LAUNCH = """
from dsgpt2.accelerator import prepare_deepspeed_environment
prepare_deepspeed_environment()
import torch, deepspeed, transformers
from dsgpt2.model.gpt2 import gpt2_config, build_model
model = build_model(gpt2_config("tiny", 512, 64, 0, 0))
ids = torch.randint(0, 512, (4, 64))
model(input_ids=ids, labels=ids).loss.backward()
"""

# The reference launch's seconds as the test run's controller measured them, once for every worker (see
# ``measure_launch``); unset, each test process times its own on first use.
LAUNCH_ENV = "DSGPT2_TEST_LAUNCH_S"

_measured: list[float] = []
with contextlib.suppress(ValueError):
    _measured.append(float(os.environ.get(LAUNCH_ENV, "")))


def measure_launch(workers: int, then: str = "") -> float:
    """The reference launch timed once, before any test process starts (a fresh interpreter importing
    torch, DeepSpeed and transformers in each of several workers cost 9 CPU-seconds apiece), as it runs
    among ``workers`` test processes sharing the cores: its idle time times the workers per core. The
    script ``then`` runs after it in the same interpreter, untimed (whether it fails or not)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = dict(os.environ, OMP_NUM_THREADS="1") if workers > 1 else None
    timed = "import time\n_start = time.monotonic()\n{}\nprint('launch', time.monotonic() - _start)\n"
    script = timed.format(LAUNCH)
    done = subprocess.run([sys.executable, "-c", script + then], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=900)  # fmt: skip
    said = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("launch ")]
    if not said:
        raise RuntimeError(f"the reference launch failed: {done.stderr[-2000:]}")
    return float(said[0]) * max(1.0, workers / cores)


def launch_seconds() -> float:
    """How long the reference launch takes in this test process (timed on the first call, where the
    test run's controller did not)."""
    if not _measured:
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", LAUNCH], cwd=ROOT, capture_output=True, check=True)
        _measured.append(time.monotonic() - start)
    return _measured[0]


def note_launch(seconds: float) -> None:
    """A launch the suite timed anyway (a fresh interpreter importing torch, DeepSpeed and transformers):
    the reference launch then needs no run of its own."""
    if not _measured:
        _measured.append(seconds)


def load_factor() -> float:
    """Runnable processes per core over the last minute (1.0: every core busy with one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return os.getloadavg()[0] / cores


def pace() -> float:
    """How many times slower than an idle two-core machine a launch is now (at least 1)."""
    return min(MAX_PACE, max(1.0, launch_seconds() / REFERENCE_LAUNCH_S, load_factor()))


def deadline(base_seconds: float) -> float:
    """Seconds to wait for what takes well under ``base_seconds`` on an idle two-core machine."""
    return base_seconds * pace()


def wait_for(
    predicate: Callable[[], Any],
    base_seconds: float,
    what: str,
    proc: subprocess.Popen | None = None,
    every: float = 0.1,
) -> Any:
    """Poll ``predicate`` every ``every`` seconds until it returns something true (returned); fail
    naming ``what`` past ``deadline(base_seconds)``, or at once when ``proc`` ends first."""
    end = time.monotonic() + deadline(base_seconds)
    while True:
        found = predicate()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {deadline(base_seconds):.0f} s")
        time.sleep(every)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
