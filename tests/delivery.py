"""Readers and checkers of the delivery files, read as files: compose.yaml (its secrets, published ports,
volumes, environment, durations) and docker/Dockerfile (its instructions, user, baked-in secrets,
.dockerignore's rule). tests/project/test_compose.py and test_image.py run each checker on a broken
snippet too, so that a checker that lets everything through fails there."""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Iterator
from typing import Any

import yaml

from conftest import ROOT

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
