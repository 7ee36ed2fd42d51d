"""Every exception dsgpt2 raises on purpose is a DsGpt2Error: one line and its exit code at the
command line, never a traceback."""

from __future__ import annotations

import ast
import builtins

from conftest import ROOT


def test_no_exception_class_bypasses_the_root() -> None:
    builtin_errors = {
        name
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    outside = []
    for path in sorted((ROOT / "dsgpt2").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "DsGpt2Error":
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & builtin_errors:
                    outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert outside == []


def test_the_servers_errors_keep_their_exit_codes() -> None:
    from dsgpt2.errors import DsGpt2Error
    from dsgpt2.infer.engine import GenerationFailed
    from dsgpt2.infer.openai_api import ApiError
    from dsgpt2.infer.serve import BadRequest

    assert all(issubclass(c, DsGpt2Error) for c in (GenerationFailed, ApiError, BadRequest))
    assert BadRequest("x").exit_code == ApiError("x", status=401).exit_code == 2
    assert GenerationFailed("x").exit_code == ApiError("x", status=500).exit_code == 1
