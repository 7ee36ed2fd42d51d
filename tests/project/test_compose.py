"""compose.yaml and .env.example, read as files, and `docker compose config` where it is installed.

The delivery's promises: no inline secrets, MongoDB not published beyond localhost, auth on; plus the wiring a
fresh clone relies on (`cp .env.example .env && docker compose up`). Every checker (tests/delivery.py)
is also run on a broken snippet, so that a checker that lets everything through fails here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT
from delivery import (
    COMPOSE,
    CREDENTIALS,
    DOCKERFILE,
    ENV_EXAMPLE,
    REF,
    USERINFO,
    dockerfile_env,
    environment,
    exposure_problems,
    load_compose,
    parse_duration,
    secret_problems,
    toolkit_services,
    undeclared_volumes,
    volume_mounts,
    walk_strings,
)
from dsgpt2.db.config import load_config
from pace import deadline

# --- the checkers catch what they are meant to catch ----------------------------------------------


BAD_COMPOSE = """
services:
  mongo:
    image: mongo:7
    environment:
      MONGO_INITDB_ROOT_USERNAME: root
      MONGO_INITDB_ROOT_PASSWORD: example
    ports: ["27017:27017"]
  app:
    environment:
      - MONGO_CONNECTION_STRING=mongodb://root:example@mongo:27017/
      - API_TOKEN=${API_TOKEN:-abc123}
    ports:
      - "0.0.0.0:8080:8080"
      - {target: 80, published: 8081}
      - 9000
    volumes: [cache:/cache]
  sidecar:
    network_mode: host
"""


def test_checkers_flag_a_bad_compose_file() -> None:
    bad = load_compose(BAD_COMPOSE)
    secrets = "\n".join(secret_problems(bad))
    assert "MONGO_INITDB_ROOT_PASSWORD is set to a literal" in secrets
    assert "connection string with a literal password" in secrets
    assert "falls back to a literal 'abc123'" in secrets
    exposure = "\n".join(exposure_problems(bad))
    for needle in ("'27017:27017'", "0.0.0.0:8080:8080", "8081", "9000", "sidecar: network_mode host"):
        assert needle in exposure
    assert undeclared_volumes(bad) == ["app: cache"]


def test_checkers_pass_references_and_loopback() -> None:
    good = load_compose(
        """
services:
  db:
    environment:
      PASSWORD: ${DB_PASSWORD:?set it}
      URI: "mongodb://${U:?x}:${DB_PASSWORD:?x}@db:1/"
    ports: ["127.0.0.1:${P:-1}:1", {target: 2, published: 2, host_ip: 127.0.0.1}, "[::1]:3:3"]
    volumes: [data:/d, ./out:/out]
volumes: {data: }
"""
    )
    assert secret_problems(good) == []
    assert exposure_problems(good) == []
    assert undeclared_volumes(good) == []


@pytest.mark.parametrize(
    ("text", "seconds"), [("2m", 120), ("90s", 90), ("1m30s", 90), ("1h", 3600), ("500ms", 0.5)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "2", "2 minutes", "m", "10x"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


# --- compose.yaml ---------------------------------------------------------------------------------


def test_compose_holds_no_inline_secret() -> None:
    assert secret_problems(load_compose()) == []


def test_credentials_are_required_from_the_environment() -> None:
    """Every use of the credentials is `${VAR:?message}`: unset, compose stops instead of defaulting."""
    refs = [ref for _, text in walk_strings(load_compose()) for ref in REF.finditer(text)]
    for name in CREDENTIALS:
        uses = [ref for ref in refs if ref["name"] == name]
        assert uses, f"{name} is never used"
        for ref in uses:
            assert ref["op"] == ":?" and ".env" in ref["arg"], ref[0]


def test_nothing_is_published_beyond_localhost() -> None:
    doc = load_compose()
    assert exposure_problems(doc) == []
    assert doc["services"]["mongo"]["ports"], "MongoDB should be reachable from this machine"


def test_mongo_has_auth_and_a_health_check() -> None:
    mongo = load_compose()["services"]["mongo"]
    assert re.fullmatch(r"mongo:\d+(\.\d+)*", mongo["image"]), "pin a major version"
    env = environment(mongo)
    assert env["MONGO_INITDB_ROOT_USERNAME"] and env["MONGO_INITDB_ROOT_PASSWORD"]
    assert "--noauth" not in json.dumps(mongo.get("command", ""))
    check = mongo["healthcheck"]
    assert not check.get("disable")
    assert check["test"][0] in ("CMD", "CMD-SHELL") and "ping" in " ".join(check["test"])
    for key in ("interval", "timeout", "start_period"):
        assert parse_duration(check[key]) > 0
    assert check["retries"] >= 1
    assert ("mongo-data", "/data/db") in volume_mounts(mongo)


@pytest.fixture(scope="module")
def toolkit() -> dict[str, dict[str, Any]]:
    services = toolkit_services(load_compose())
    assert set(services) == {"dsgpt2", "dsgpt2-gpu"}
    return services


@pytest.mark.parametrize("name", ["dsgpt2", "dsgpt2-gpu"])
def test_toolkit_service_wiring(toolkit: dict[str, dict[str, Any]], name: str) -> None:
    service = toolkit[name]
    assert service["build"]["context"] == "."
    assert (ROOT / service["build"]["dockerfile"]).resolve() == DOCKERFILE.resolve()
    assert service["depends_on"]["mongo"]["condition"] == "service_healthy"
    assert service["init"] is True
    assert parse_duration(service["stop_grace_period"]) >= 60, "too short to write a checkpoint"
    assert str(service.get("user", "dsgpt2")).split(":")[0] not in ("root", "0")
    assert service["command"] == ["bash", "pipelines/all.sh"]


@pytest.mark.parametrize("name", ["dsgpt2", "dsgpt2-gpu"])
def test_toolkit_reaches_mongo_with_the_env_credentials(
    toolkit: dict[str, dict[str, Any]], name: str
) -> None:
    env = environment(toolkit[name])
    uri = env["MONGO_CONNECTION_STRING"]
    m = USERINFO.match(REF.sub("${}", uri))
    assert m and m["user"] == m["pw"] == "${}"
    host = uri.rsplit("@", 1)[1].split("/")[0]
    assert host.split(":")[0] in load_compose()["services"], "the host is a compose service"
    assert "authSource=admin" in uri, "the root user lives in the admin database"
    config = load_config(ROOT / env["CONFIG"], env={"MONGO_CONNECTION_STRING": f"mongodb://u:p@{host}/"})
    assert config.hosts == host
    assert not USERINFO.search((ROOT / env["CONFIG"]).read_text(encoding="utf-8"))
    assert (ROOT / env["DS_CONFIG"]).is_file()


@pytest.mark.parametrize("name", ["dsgpt2", "dsgpt2-gpu"])
def test_outputs_and_op_cache_are_volumes(toolkit: dict[str, dict[str, Any]], name: str) -> None:
    service = toolkit[name]
    mounts = dict((target, source) for source, target in volume_mounts(service))
    assert mounts["/app/runs"] == "./runs"
    assert environment(service)["RUN_DIR"].startswith("/app/runs/")
    home = dockerfile_env(DOCKERFILE.read_text(encoding="utf-8"))["HOME"]
    assert mounts[f"{home}/.cache"] in load_compose()["volumes"]


def test_named_volumes_are_declared() -> None:
    doc = load_compose()
    assert undeclared_volumes(doc) == []
    assert {"mongo-data", "torch-extensions"} <= set(doc["volumes"])


def test_runs_directory_is_handed_to_the_image_user(toolkit: dict[str, dict[str, Any]]) -> None:
    doc = load_compose()
    init = doc["services"]["runs-init"]
    assert ("./runs", "/app/runs") in volume_mounts(init)
    assert init.get("network_mode") == "none"
    script = " ".join(init["command"])
    for service in toolkit.values():
        assert service["depends_on"]["runs-init"]["condition"] == "service_completed_successfully"
        args = service["build"]["args"]
        assert f"chown {args['APP_UID']}:{args['APP_GID']} /app/runs" in script


def test_cpu_service_runs_by_default_and_gpu_service_reserves_a_gpu(
    toolkit: dict[str, dict[str, Any]],
) -> None:
    cpu, gpu = toolkit["dsgpt2"], toolkit["dsgpt2-gpu"]
    assert "profiles" not in cpu and "deploy" not in cpu
    assert environment(cpu)["DS_CONFIG"] == "configs/ds_config_cpu.json"
    assert "gpu" in gpu["profiles"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d["driver"] == "nvidia" and "gpu" in d["capabilities"] and (d["count"] == "all" or d["count"] >= 1)
        for d in devices
    )
    assert environment(gpu)["DS_CONFIG"] == "configs/ds_config.json"
    assert environment(gpu)["RUN_DIR"] != environment(cpu)["RUN_DIR"]
    assert gpu["image"] != cpu["image"]


def test_gpu_build_args_agree_on_cuda(toolkit: dict[str, dict[str, Any]]) -> None:
    args = toolkit["dsgpt2-gpu"]["build"]["args"]
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu[\d.]+", args["BASE_IMAGE"])
    assert base, "a devel image: DeepSpeed compiles its GPU ops with nvcc"
    assert args["TORCH_INDEX"].endswith(f"/cu{base[1]}{base[2]}")
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", args["TORCH_SPEC"])


def test_shipped_ds_configs_match_the_hardware(toolkit: dict[str, dict[str, Any]]) -> None:
    cpu = json.loads((ROOT / environment(toolkit["dsgpt2"])["DS_CONFIG"]).read_text(encoding="utf-8"))
    assert not any(cpu.get(k, {}).get("enabled") for k in ("bf16", "fp16")), "CPU training is fp32"


def test_pipeline_script_exists(toolkit: dict[str, dict[str, Any]]) -> None:
    for service in toolkit.values():
        assert (ROOT / service["command"][1]).is_file()


# --- .env, .env.example ---------------------------------------------------------------------------


def test_env_example_lists_every_required_variable() -> None:
    example = ENV_EXAMPLE.read_text(encoding="utf-8")
    values = dict(ln.partition("=")[::2] for ln in example.splitlines() if re.match(r"^[A-Z_]+=", ln))
    required = {
        ref["name"]
        for _, text in walk_strings(load_compose())
        for ref in REF.finditer(text)
        if ref["op"] == ":?"
    }
    assert required == set(CREDENTIALS)
    for name in required:
        assert values.get(name), f"{name} missing from .env.example"
    assert re.fullmatch(r"[A-Za-z0-9._~-]+", values["MONGO_PASSWORD"]), "must fit a URI unescaped"
    assert "cp .env.example .env" in example


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False)


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a git checkout"
)
def test_env_is_ignored_and_env_example_is_not() -> None:
    assert _git("check-ignore", "-q", ".env").returncode == 0, ".env must be ignored by git"
    assert _git("check-ignore", "-q", ".env.example").returncode == 1, ".env.example must be committable"


# --- docker compose itself, where it is installed -------------------------------------------------


def _compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.fixture(scope="module")
def compose_cli() -> list[str]:
    command = _compose_command()
    if command is None:
        pytest.skip("docker compose is not installed")
    return command


def _compose_config(cli: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    empty = tmp_path / "empty.env"  # so that a developer's own .env is not read
    empty.write_text("")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MONGO_", "DSGPT2_", "COMPOSE_"))}
    return subprocess.run(
        [*cli, "--env-file", str(empty), "--project-directory", str(ROOT), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=deadline(120),
        check=False,
    )


def test_compose_refuses_to_start_without_a_password(compose_cli: list[str], tmp_path: Path) -> None:
    result = _compose_config(compose_cli, tmp_path, MONGO_USER="trainer")
    assert result.returncode != 0
    assert "MONGO_PASSWORD" in result.stdout + result.stderr


def test_compose_config_renders_with_credentials(compose_cli: list[str], tmp_path: Path) -> None:
    result = _compose_config(compose_cli, tmp_path, MONGO_USER="trainer", MONGO_PASSWORD="pw123")
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert exposure_problems(rendered) == []
    uri = environment(rendered["services"]["dsgpt2"])["MONGO_CONNECTION_STRING"]
    assert uri == "mongodb://trainer:pw123@mongo:27017/?authSource=admin"
