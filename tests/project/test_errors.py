"""The exceptions: every one in dsgpt2/errors.py under one root, the serving errors with the exit codes of
what they report, one class for a refused HTTP request (every error's root: tests/project/test_layout.py)."""

from __future__ import annotations

import ast

from conftest import ROOT


def test_the_servers_errors_keep_their_exit_codes() -> None:
    from dsgpt2.errors import DsGpt2Error, GenerationFailed, RequestError

    assert all(issubclass(c, DsGpt2Error) for c in (GenerationFailed, RequestError))
    assert RequestError("x").exit_code == RequestError("x", status=401).exit_code == 2
    assert GenerationFailed("x").exit_code == RequestError("x", status=500).exit_code == 1
    assert RequestError("x", "n").body() == {
        "error": {"message": "x", "type": "invalid_request_error", "param": "n", "code": None}
    }


def test_every_exception_class_lives_in_errors_py() -> None:
    """One room for the exceptions: a reader finds them all, and each name has one meaning."""
    outside = []
    for path in (ROOT / "dsgpt2").rglob("*.py"):
        if path.name == "errors.py" and path.parent.name == "dsgpt2":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id == "DsGpt2Error")
                for b in node.bases
            ):
                outside.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert outside == []
