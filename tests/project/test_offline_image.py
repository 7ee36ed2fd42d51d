"""The image where no registry and no package index are reachable, read as files: a base without Python,
a wheelhouse mounted (never copied), the embedded database in the image, the compose override that
serves it as the stack's mongo service, a CUDA example on a torch the project proves, and the build
scripts' refusals. `make test-image` (CI, where a container engine installs) builds and runs all of it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import ROOT
from delivery import (
    COMPOSE,
    DOCKERFILE,
    dockerfile_args,
    dockerignore_patterns,
    dockerignored,
    final_stage,
    load_compose,
    parse_dockerfile,
    secret_problems,
)
from pace import deadline

EMBEDDED = ROOT / "docker" / "compose.embedded.yaml"


def _proven_torch() -> set[str]:
    """The torch releases the project proves: the lock's (the suite) and the floor lane's."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    floor = re.search(r"^FLOOR_TORCH \?= (.+)$", makefile, re.M)
    assert floor, "Makefile names the floor lane's torch releases"
    locked = re.search(r"^torch==(\S+)$", (ROOT / "requirements.lock").read_text(encoding="utf-8"), re.M)
    assert locked
    return {locked[1], *floor[1].split()}


def test_the_cuda_examples_name_a_torch_the_project_proves() -> None:
    dockerfile = DOCKERFILE.read_text(encoding="utf-8")
    named = re.findall(r"TORCH_SPEC=torch==(\S+)", dockerfile)
    assert named and set(named) <= _proven_torch(), named
    gpu = load_compose()["services"]["dsgpt2-gpu"]["build"]["args"]
    assert gpu["TORCH_SPEC"].removeprefix("torch==") in _proven_torch()
    cuda = re.search(r"BASE_IMAGE=nvidia/cuda:(\d+)\.(\d+)\S*", dockerfile)
    assert cuda and f"whl/cu{cuda[1]}{cuda[2]}" in dockerfile, "the example's torch build matches its base"


def test_a_base_without_python_gets_it_from_the_distribution() -> None:
    runs = [args for kw, args in final_stage(parse_dockerfile(DOCKERFILE.read_text())) if kw == "RUN"]
    apt = next(args for args in runs if "apt-get install" in args)
    assert re.search(r"if ! command -v python3 .*python3 python3-dev python3-venv", apt)
    assert "python3 -m venv" in apt


def test_every_install_can_come_from_a_mounted_wheelhouse_and_none_is_copied() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    args = dockerfile_args(text)
    assert args["WHEELS"] == "index", "the default build uses the index, as before"
    stage = final_stage(parse_dockerfile(text))
    installs = [a for kw, a in stage if kw == "RUN" and "pip install" in a]
    assert len(installs) == 3
    for run in installs:
        assert run.startswith("--mount=type=bind,source=docker/wheelhouse,target=/wheelhouse"), run
        assert "PIP_CONFIG_FILE=/tmp/pip-wheels.conf" in run
    assert "no-index = true" in installs[0] and "find-links = /wheelhouse" in installs[0]
    assert not [a for kw, a in stage if kw in ("COPY", "ADD") and "wheelhouse" in a], "never in a layer"
    # The folder is in the repository (empty but for its ignore file) and in the build context.
    assert (ROOT / "docker" / "wheelhouse" / ".gitignore").is_file()
    patterns = dockerignore_patterns((ROOT / ".dockerignore").read_text(encoding="utf-8"))
    assert not dockerignored("docker/wheelhouse/torch-2.13.0-cp311-cp311-linux_x86_64.whl", patterns)
    listed = subprocess.run(["git", "check-ignore", "-q", "docker/wheelhouse/x.whl"], cwd=ROOT, check=False)
    assert listed.returncode == 0, "wheels are never committed"


def test_the_image_holds_the_embedded_database_and_its_op_compiled() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert dockerfile_args(text)["EXTRAS"] == "local"
    stage = final_stage(parse_dockerfile(text))
    assert any(kw == "RUN" and '".${EXTRAS:+[$EXTRAS]}"' in a for kw, a in stage)
    user_at = next(i for i, (kw, _) in enumerate(stage) if kw == "USER")
    built = [i for i, (kw, a) in enumerate(stage) if kw == "RUN" and "build_cpu_ops" in a]
    assert built and built[0] > user_at, "compiled as the image's user, into its own ~/.cache"
    made = next(a for kw, a in stage if kw == "RUN" and "mkdir -p /app/runs" in a)
    assert "/data/db" in made.split("&&")[0] and "/data/db" in made.split("&&")[1]


def test_the_embedded_override_serves_the_stack_with_the_env_credentials() -> None:
    override = yaml.safe_load(EMBEDDED.read_text(encoding="utf-8"))
    assert secret_problems(override) == []
    mongo = override["services"]["mongo"]
    assert mongo["image"] == load_compose()["services"]["dsgpt2"]["image"]
    command = mongo["command"]
    assert command[:4] == ["dsgpt2", "db", "serve", "local:///data/db"]
    flags = dict(zip(command[4::2], command[5::2], strict=True))
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "27017" and flags["--advertise"] == "mongo"
    assert flags["--user"].startswith("${MONGO_USER:?")
    assert mongo["environment"]["MONGO_PASSWORD"].startswith("${MONGO_PASSWORD:?")
    # The same volume as MongoDB's data, and a health check that the image itself can run.
    base = load_compose()["services"]["mongo"]
    assert "mongo-data:/data/db" in base["volumes"]
    test = mongo["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "pymongo" in test[1] and "'ping'" in test[1]
    assert override["services"]["runs-init"]["image"] == mongo["image"]


def test_the_build_script_without_an_engine_says_so_in_one_line(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "basename", "mktemp", "rm", "cat", "env"):
        found = shutil.which(tool)
        assert found
        (bin_dir / tool).symlink_to(found)
    env = {"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/root")}
    for script in ("image.sh", "test-image.sh"):
        done = subprocess.run(["bash", str(ROOT / "docker" / script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=deadline(30), check=False)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"{script}: no container engine: install docker, or podman (Debian: apt-get install podman runc)"
        ]
    unknown = subprocess.run(["bash", str(ROOT / "docker" / "image.sh")], cwd=tmp_path,
                             env={**env, "ENGINE": "nerdctl"}, capture_output=True, text=True,
                             timeout=deadline(30), check=False)  # fmt: skip
    assert unknown.returncode == 2 and unknown.stderr.strip() == "image.sh: ENGINE=nerdctl is not installed"


def test_compose_yaml_documents_the_override() -> None:
    header = COMPOSE.read_text(encoding="utf-8").split("\n\n", 1)[0]
    assert "docker/compose.embedded.yaml" in header
