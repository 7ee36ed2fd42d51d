"""compose.yaml, docker/Dockerfile, .dockerignore and .env.example, read as files.

QUALITY row 16: no inline secrets, MongoDB not published beyond localhost, auth on, a non-root user;
plus the wiring a fresh clone relies on (`cp .env.example .env && docker compose up`). Every checker is
also run on a broken snippet, so that a checker that lets everything through fails here.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import ROOT
from dsgpt2.db.config import load_config
from pace import deadline

COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
ENV_EXAMPLE = ROOT / ".env.example"
CREDENTIALS = ("MONGO_USER", "MONGO_PASSWORD")

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}, ${NAME:+alt}
REF = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}")
SECRET_NAME = re.compile(r"(?i)passw(or)?d|secret|token|api_?key|private_?key|credential")
USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]*)@")
LOCALHOST = ("127.0.0.1", "::1", "[::1]")
DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)(?P<unit>h|ms|m|s|us|µs|ns)")
UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
ROOT_ONLY_RUN = re.compile(
    r"\b(apt-get|apt|apk|dnf|yum|useradd|groupadd|userdel|groupdel|chown|pip3? install)\b"
)


# --- helpers -------------------------------------------------------------------------------------


def load_compose(text: str | None = None) -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8") if text is None else text)


def walk_strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string in a parsed YAML document (keys included), with where it sits."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", str(key)
            yield from walk_strings(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk_strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def assignments(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(where, name, value) for every mapping entry and every `NAME=value` list item."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield f"{path}.{key}", str(key), value
            yield from assignments(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", value):
                name, _, rest = value.partition("=")
                yield f"{path}[{i}]", name, rest
            yield from assignments(value, f"{path}[{i}]")


def only_references(value: str) -> bool:
    return bool(value) and REF.sub("", value) == ""


def secret_problems(doc: Any) -> list[str]:
    """Where a compose document holds a secret in the clear instead of a `${VAR}` from .env."""
    problems = []
    for where, text in walk_strings(doc):
        for ref in REF.finditer(text):
            if SECRET_NAME.search(ref["name"]) and ref["op"] and ref["op"].lstrip(":") in "-+":
                problems.append(f"{where}: ${{{ref['name']}}} falls back to a literal {ref['arg']!r}")
        for m in USERINFO.finditer(REF.sub("${}", text)):
            if m["pw"] != "${}":
                problems.append(f"{where}: connection string with a literal password")
    for where, name, value in assignments(doc):
        secret = SECRET_NAME.search(name) and not name.endswith("_FILE")
        if secret and isinstance(value, str | int) and not only_references(str(value)):
            problems.append(f"{where}: {name} is set to a literal")
    return problems


def exposure_problems(doc: dict[str, Any]) -> list[str]:
    """Ports published on an address other than loopback, or host networking."""
    problems = []
    for name, service in (doc.get("services") or {}).items():
        if service.get("network_mode") == "host":
            problems.append(f"{name}: network_mode host publishes every port on every interface")
        for port in service.get("ports") or []:
            if isinstance(port, dict):
                ok = str(port.get("host_ip", "")) in LOCALHOST
            else:
                text = str(port)
                ok = any(text.startswith(f"{ip}:") and text.count(":") >= 2 for ip in LOCALHOST)
            if not ok:
                problems.append(f"{name}: port {port!r} is published beyond localhost")
    return problems


def undeclared_volumes(doc: dict[str, Any]) -> list[str]:
    declared = set(doc.get("volumes") or {})
    missing = []
    for name, service in (doc.get("services") or {}).items():
        for source, _ in volume_mounts(service):
            if source and not source.startswith((".", "/", "~", "$")) and source not in declared:
                missing.append(f"{name}: {source}")
    return missing


def volume_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((str(volume.get("source", "")), str(volume["target"])))
        else:
            source, _, rest = str(volume).partition(":")
            mounts.append((source, rest.split(":")[0]) if rest else ("", source))
    return mounts


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def parse_duration(text: str | int) -> float:
    """Seconds in a compose duration (`2m`, `1m30s`, `90s`)."""
    text = str(text).strip()
    if not text or DURATION.sub("", text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(m["n"]) * UNIT_S[m["unit"]] for m in DURATION.finditer(text))


def toolkit_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in doc["services"].items() if "build" in s}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, args = pending.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    return instructions[starts[-1] :]


def user_problems(text: str) -> list[str]:
    """The image must end as a non-root user, with nothing needing root run after the switch."""
    stage = final_stage(parse_dockerfile(text))
    users = [i for i, (kw, _) in enumerate(stage) if kw == "USER"]
    if not users:
        return ["no USER instruction: the container runs as root"]
    last = users[-1]
    defaults = dockerfile_args(text)
    who = REF.sub(lambda m: defaults.get(m["name"], m[0]), stage[last][1]).split(":")[0]
    problems = [f"USER {who} is root"] if who in ("root", "0") else []
    for kw, args in stage[last + 1 :]:
        if kw == "RUN" and ROOT_ONLY_RUN.search(args):
            problems.append(f"RUN after USER needs root: {args[:60]}")
    return problems


def declared_names(keyword: str, args: str) -> dict[str, str]:
    """Names and values of an ENV or ARG instruction (`K=V K2=V2`, `K V` or a bare `K`)."""
    tokens = shlex.split(args, posix=True)
    if keyword == "ENV" and tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict((t.partition("=")[0], t.partition("=")[2]) for t in tokens)


def dockerfile_secret_problems(text: str) -> list[str]:
    problems = []
    for kw, args in parse_dockerfile(text):
        if kw in ("ENV", "ARG", "LABEL"):
            for name, value in declared_names(kw, args).items():
                if SECRET_NAME.search(name):
                    problems.append(f"{kw} {name}: a secret baked into the image")
                if USERINFO.search(value):
                    problems.append(f"{kw} {name}: a connection string with a password")
    return problems


def dockerfile_args(text: str) -> dict[str, str]:
    args: dict[str, str] = {}
    for kw, rest in parse_dockerfile(text):
        if kw == "ARG":
            args.update(declared_names(kw, rest))
    return args


def dockerfile_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for kw, rest in final_stage(parse_dockerfile(text)):
        if kw == "ENV":
            env.update(declared_names(kw, rest))
    return env


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether `path` (relative to the context) is left out, by .dockerignore's last-match-wins rule."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        candidates = [pat, pat[3:]] if pat.startswith("**/") else [pat]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            ignored = not negate
    return ignored


def dockerignore_patterns(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


# --- the checkers catch what they are meant to catch ---------------------------------------------

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


def test_every_shipped_gpu_config_steps_on_at_least_128k_tokens_per_gpu() -> None:
    """DeepSpeed's optimizer step costs a fixed time per step on a GPU: the GPU configs amortize it over
    at least 131,072 tokens per GPU at context 1,024, warm up as GPT-2's recipe does, and keep the
    schedule in the config consistent with the optimizer's rate."""
    gpu = {}
    for path in sorted((ROOT / "configs").glob("ds_config*.json")):
        ds = json.loads(path.read_text(encoding="utf-8"))
        if any(ds.get(k, {}).get("enabled") for k in ("bf16", "fp16")):
            gpu[path.name] = ds
    assert {"ds_config.json", "ds_config_fp16.json", "ds_config_zero2_offload.json",
            "ds_config_zero3_offload.json"} <= set(gpu)  # fmt: skip
    for name, ds in gpu.items():
        tokens = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 1024
        assert tokens >= 131_072, (name, tokens)
        params = ds["scheduler"]["params"]
        assert params["warmup_max_lr"] == ds["optimizer"]["params"]["lr"], name
        assert 0 < params["warmup_num_steps"] <= 2000, name


def test_pipeline_script_exists(toolkit: dict[str, dict[str, Any]]) -> None:
    for service in toolkit.values():
        assert (ROOT / service["command"][1]).is_file()


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


# --- .dockerignore, .env, .env.example -----------------------------------------------------------


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


@pytest.mark.slow
def test_the_wheel_carries_the_configs_and_finds_them_from_anywhere(tmp_path: Path) -> None:
    """A plain `pip install .` (the Docker image's) finds the shipped configs from any directory."""
    import zipfile

    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
         str(ROOT)],
        capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("dsgpt2-*.whl")
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.json"))
    runs = sorted(p.name for p in (ROOT / "configs" / "recipes").iterdir())
    inside = sorted(Path(n).name for n in zipfile.ZipFile(wheel).namelist() if "/configs/" in n)
    assert inside == sorted(shipped + runs) and "ds_config_cpu.json" in inside and "demo.yaml" in runs
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=deadline(300),
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = (
        "import json, dsgpt2, dsgpt2.settings.shipped as s\n"
        "paths = [s.shipped_config(n) for n in s.shipped_names()]\n"
        "print(json.dumps([dsgpt2.__file__, [str(p) for p in paths if json.loads(p.read_text())]]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(target)}, timeout=deadline(120),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    where, paths = json.loads(result.stdout)
    assert where.startswith(str(target))
    assert sorted(Path(p).name for p in paths) == shipped
    assert all(p.startswith(str(target)) for p in paths)
