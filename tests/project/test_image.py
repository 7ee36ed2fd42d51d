"""docker/Dockerfile and .dockerignore, read as files.

The delivery's promises: a non-root user, no secret baked into the image; plus what the image must hold for
`docker compose up` and `docker run IMAGE bash ...` to work. Every checker (tests/delivery.py) is also
run on a broken snippet, so that a checker that lets everything through fails here.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from conftest import ROOT
from delivery import (
    DOCKERFILE,
    DOCKERIGNORE,
    dockerfile_args,
    dockerfile_env,
    dockerfile_secret_problems,
    dockerignore_patterns,
    dockerignored,
    final_stage,
    parse_dockerfile,
    user_problems,
)

# --- the checkers catch what they are meant to catch ----------------------------------------------


@pytest.mark.parametrize(
    ("dockerfile", "needle"),
    [
        ("FROM x\nRUN true\n", "no USER"),
        ("FROM x\nUSER root\n", "root"),
        ("FROM x\nUSER 0:0\n", "root"),
        ("ARG UID=0\nFROM x\nUSER ${UID}\n", "root"),
        ("FROM x\nUSER app\nRUN apt-get install -y \\\n    g++\n", "needs root"),
        ("FROM x AS build\nUSER app\nFROM y\nRUN true\n", "no USER"),
    ],
)
def test_user_checker_flags_root(dockerfile: str, needle: str) -> None:
    assert any(needle in p for p in user_problems(dockerfile))


def test_dockerfile_secret_checker_flags_baked_secrets() -> None:
    bad = (
        "FROM x\nARG MONGO_PASSWORD=example\n"
        "ENV A=1 \\\n    MONGO_CONNECTION_STRING=mongodb://u:pw@h:27017/\nENV API_TOKEN abc\n"
    )
    problems = "\n".join(dockerfile_secret_problems(bad))
    assert "ARG MONGO_PASSWORD" in problems
    assert "ENV MONGO_CONNECTION_STRING: a connection string" in problems
    assert "ENV API_TOKEN" in problems


def test_dockerignore_matcher() -> None:
    patterns = ["*.md", ".env", ".env.*", "!.env.example", "**/__pycache__", "runs"]
    assert dockerignored("README.md", patterns)
    assert dockerignored(".env", patterns)
    assert dockerignored(".env.local", patterns)
    assert not dockerignored(".env.example", patterns)
    assert dockerignored("__pycache__/x.pyc", patterns)
    assert dockerignored("dsgpt2/__pycache__/x.pyc", patterns)
    assert dockerignored("runs/ckpt/latest", patterns)
    assert not dockerignored("dsgpt2/cli/main.py", patterns)


# --- docker/Dockerfile ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def test_image_runs_as_a_non_root_user(dockerfile: str) -> None:
    assert user_problems(dockerfile) == []


def test_image_bakes_in_no_secret(dockerfile: str) -> None:
    assert dockerfile_secret_problems(dockerfile) == []


def test_base_image_is_cpu_by_default_and_torch_matches_the_makefile(dockerfile: str) -> None:
    args = dockerfile_args(dockerfile)
    assert not re.search(r"(?i)cuda|nvidia", args["BASE_IMAGE"])
    assert ("FROM", "${BASE_IMAGE}") in parse_dockerfile(dockerfile)
    assert args["TORCH_INDEX"].endswith("/cpu")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"TORCH_SPEC ?= {args['TORCH_SPEC']}" in makefile


def test_cli_is_installed_from_the_project_files(dockerfile: str) -> None:
    stage = final_stage(parse_dockerfile(dockerfile))
    copied = " ".join(args for kw, args in stage if kw == "COPY")
    for source in ("pyproject.toml", "dsgpt2/", "ds_trainer.py", "pipelines/"):
        assert source in copied
    # configs/ is a link to the package's configs, made in the image as in the repository.
    assert (ROOT / "configs").resolve() == ROOT / "dsgpt2" / "configs"
    assert any(kw == "RUN" and "ln -s dsgpt2/configs configs" in args for kw, args in stage)
    installs = [
        args for kw, args in stage if kw == "RUN" and re.search(r"pip install[^;&]* \.(\s|;|$)", args)
    ]
    assert installs, "pip install . from the copied project"
    assert 'dsgpt2 = "dsgpt2.cli.main:main"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert ("WORKDIR", "/app") in stage
    assert not [kw for kw, _ in stage if kw == "ENTRYPOINT"], "`docker run IMAGE bash ...` must work"
    assert json.loads(dict(stage)["CMD"])[0] == "dsgpt2"


def test_image_environment(dockerfile: str) -> None:
    env = dockerfile_env(dockerfile)
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["HOME"] == "/home/dsgpt2", "DeepSpeed caches compiled ops under ~/.cache"
    assert "build-essential" in dockerfile, "DeepSpeed compiles its CPU ops with g++"


# --- .dockerignore --------------------------------------------------------------------------------


def test_dockerignore_keeps_secrets_and_environments_out(dockerfile: str) -> None:
    patterns = dockerignore_patterns(DOCKERIGNORE.read_text(encoding="utf-8"))
    for path in (
        ".env",
        ".venv/bin/python",
        ".git/HEAD",
        "runs/pipeline/ckpt",
        "wandb/run",
        "bench/results/x",
    ):
        assert dockerignored(path, patterns), path
    sources = [
        src
        for kw, args in parse_dockerfile(dockerfile)
        if kw == "COPY"
        for src in shlex.split(args)[:-1]
        if not src.startswith("--")
    ]
    assert "README.md" in sources
    for source in sources:
        probe = f"{source.rstrip('/')}/__init__.py" if source.endswith("/") else source
        assert not dockerignored(probe, patterns), f"{source} is copied but ignored"
