"""requirements.lock against pyproject.toml's ranges and this environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import ROOT, pyproject

LOCK = ROOT / "requirements.lock"


def read_lock(text: str) -> dict[str, Version]:
    """``name==version`` lines (comments and blank lines aside), by canonical name.

    Raises:
        ValueError: a line that pins nothing exactly, or a package pinned twice.
    """
    pins: dict[str, Version] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if not match:
            raise ValueError(f"line {number}: {raw!r} is not name==version")
        name = canonicalize_name(match[1])
        if name in pins:
            raise ValueError(f"line {number}: {match[1]} is pinned twice")
        pins[name] = Version(match[2])
    return pins


def ranges(data: dict) -> list[Requirement]:
    """Every requirement pyproject.toml states: the build backend, the dependencies and each extra's
    (the extras that name the project itself are its other extras, already listed)."""
    project = data["project"]
    texts = [*data["build-system"]["requires"], *project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        texts += extra
    reqs = [Requirement(t) for t in texts]
    return [r for r in reqs if canonicalize_name(r.name) != canonicalize_name(project["name"])]


def lock_problems(pins: dict[str, Version], requirements: list[Requirement]) -> list[str]:
    """What is wrong with a lock against the ranges: a required package missing from it, or locked
    outside its range (requirements whose marker excludes this Python are not checked)."""
    problems = []
    for req in requirements:
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}=={version} is outside {req.name}{req.specifier}")
    return problems


def test_every_locked_version_satisfies_the_ranges() -> None:
    project = pyproject()
    assert lock_problems(read_lock(LOCK.read_text(encoding="utf-8")), ranges(project)) == []


def test_a_version_outside_its_range_or_missing_is_named() -> None:
    project = pyproject()
    pins = read_lock(LOCK.read_text(encoding="utf-8"))
    moved = {**pins, "transformers": Version("6.0.0"), "pymongo": Version("4.5.0")}
    del moved["tokenizers"]
    assert sorted(lock_problems(moved, ranges(project))) == [
        "pymongo==4.5.0 is outside pymongo<5,>=4.6",
        "tokenizers is not in the lock",
        "transformers==6.0.0 is outside transformers<6,>=5",
    ]
    with pytest.raises(ValueError, match="not name==version"):
        read_lock("numpy>=2\n")
    with pytest.raises(ValueError, match="pinned twice"):
        read_lock("numpy==2.0\nNumPy==2.1\n")


def needs(name: str) -> set[str]:
    """The packages ``name`` requires on this Python, by canonical name (empty if not installed)."""
    try:
        requires = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return set()
    out = set()
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(canonicalize_name(req.name))
    return out


def torch_closure() -> set[str]:
    """torch and everything it needs, transitively, as installed: the build TORCH_SPEC chose (a CUDA
    build brings packages the CPU build's lock does not name)."""
    seen, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += needs(name)
    return seen


def test_the_lock_is_whole() -> None:
    """Every package a locked one needs is locked too (on this Python): nothing floats."""
    pins = read_lock(LOCK.read_text(encoding="utf-8"))
    missing = {
        f"{need} (needed by {name})"
        for name in pins
        if name != "torch"
        for need in needs(name)
        if need not in pins
    }
    assert not missing, sorted(missing)


@pytest.mark.skipif(bool(os.environ.get("DSGPT2_UNLOCKED")), reason="the drift lane runs unlocked")
def test_this_environment_is_the_lock() -> None:
    """`make` installed exactly the lock: every locked package at its version, nothing unlocked (the
    torch build aside: TORCH_SPEC chooses it)."""
    pins = read_lock(LOCK.read_text(encoding="utf-8"))
    # What is installed is what site-packages holds: a package that imported setuptools puts the copies it
    # vendors (jaraco, zipp, wheel...) on sys.path for the rest of the process.
    site = [p for p in sys.path if p.endswith("site-packages")]
    installed = {
        canonicalize_name(d.metadata["Name"]): Version(d.version)
        for d in metadata.distributions(path=site)
        if d.metadata["Name"]
    }
    # Beside a torch that is not the lock's (kept in .venv), what it needs is its own (see the Makefile).
    kept = Version(metadata.version("torch")).base_version != str(pins["torch"])
    mine = {"dsgpt2", "torch"} | (torch_closure() if kept else torch_closure() - set(pins))
    differ = {
        n: (str(pins.get(n)), str(installed.get(n)))
        for n in (set(pins) | set(installed)) - mine
        if pins.get(n) != installed.get(n)
    }
    assert not differ, f"(locked, installed): {differ}; remove .venv and run make venv"


def test_the_installs_read_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "LOCK := requirements.lock" in makefile
    assert re.search(r"install -q -c \$\(VENV\)/constraints.txt --build-constraint", makefile)
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert "COPY requirements.lock" in dockerfile
    assert re.search(r"pip install [^\n]*-c /tmp/constraints.txt[^\n]* \"?\.", dockerfile)


# A stand-in for an environment's python: records its calls, answers `import torch` with $FAKE_TORCH.
_FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
if [ "$1" = -c ] && [[ "$2" == *"import torch; print"* ]]; then
  [ -n "${FAKE_TORCH:-}" ] && echo "$FAKE_TORCH" && exit 0
  exit 1
fi
exit 0
"""


def _make_venv(tmp_path: Path, torch_there: str, *args: str) -> tuple[str, str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(_FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    (venv / "calls").write_text("")
    env = {**os.environ, "FAKE_TORCH": torch_there}
    env.pop("TORCH_SPEC", None)
    out = subprocess.run(["make", "-s", "-B", "venv", f"VENV={venv}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return out.stdout, (venv / "calls").read_text()


def test_make_keeps_a_torch_already_in_the_environment_and_says_so(tmp_path: Path) -> None:
    """A GPU user's CUDA build, installed first, is kept (one line says which and how to replace it);
    a fresh environment, or TORCH_SPEC given, gets the torch asked for."""
    locked = read_lock(LOCK.read_text(encoding="utf-8"))["torch"]
    said, calls = _make_venv(tmp_path, "2.11.0+cu130")
    assert f"keeping torch 2.11.0+cu130, found in {tmp_path / 'venv'} (the lock's is {locked};" in said
    assert "install -q torch" not in calls and "-e .[dev]" in calls
    said, calls = _make_venv(tmp_path, "")
    assert "keeping" not in said and f"-m pip install -q torch=={locked}" in calls
    said, calls = _make_venv(tmp_path, "2.11.0+cu130", "TORCH_SPEC=torch==2.7.0")
    assert "keeping" not in said and "-m pip install -q torch==2.7.0" in calls


def test_beside_another_torch_the_packages_it_pins_are_left_to_it(tmp_path: Path) -> None:
    """The lock less torch constrains the rest; beside a torch that is not the lock's, less the packages
    that torch requires itself (torch 2.11 wants setuptools<82 where the lock has 84), extras aside."""
    installed = Version(metadata.version("torch")).base_version
    rule = 'constraints-of: ; @$(PY) -c "$$CONSTRAINTS_BESIDE_TORCH" $(OF)'
    for torch, kept in (
        (installed, {"sympy", "setuptools", "pyyaml", "requests"}),
        ("0.1", {"pyyaml", "requests"}),
    ):
        lock = tmp_path / "lock"
        lock.write_text(
            f"# a lock\ntorch=={torch}\nsympy==1.0\nsetuptools==80.0\npyyaml==6.0\nrequests==2.0\n"
        )
        out = subprocess.run(["make", "-s", "--eval", rule, "constraints-of", f"OF={lock}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        lines = out.stdout.splitlines()
        assert lines[0] == "# a lock"
        assert {line.split("==")[0] for line in lines[1:]} == kept, (torch, lines)
