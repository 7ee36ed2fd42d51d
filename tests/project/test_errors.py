"""The serving errors are DsGpt2Errors with the exit codes of what they report (every error's root:
tests/project/test_layout.py)."""

from __future__ import annotations


def test_the_servers_errors_keep_their_exit_codes() -> None:
    from dsgpt2.errors import DsGpt2Error
    from dsgpt2.infer.engine import GenerationFailed
    from dsgpt2.infer.openai_api import ApiError
    from dsgpt2.infer.serve import BadRequest

    assert all(issubclass(c, DsGpt2Error) for c in (GenerationFailed, ApiError, BadRequest))
    assert BadRequest("x").exit_code == ApiError("x", status=401).exit_code == 2
    assert GenerationFailed("x").exit_code == ApiError("x", status=500).exit_code == 1
