"""`dsgpt2 serve` for the tests: the small model they serve, a server process on a free port of
127.0.0.1 for a fixture (with its log and the model it serves), the events of a server-sent stream."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import ROOT, tiny_export
from dsgpt2.collective import free_port
from pace import deadline
from wire_server import tied

# The pretrained model, one per test process (pytest's temporary directory): the tests only read it,
# so the test modules share it instead of each exporting their own.
_PRETRAINED: dict[Path, Path] = {}


def pretrained_model(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Path:
    """A model with no speaker tokens (pretrained only), exported once per test process."""
    key = tmp_path_factory.getbasetemp()
    if key not in _PRETRAINED:
        _PRETRAINED[key] = tiny_export(tmp_path_factory.mktemp("pretrained"), sample_texts[:400], speakers=())
    return _PRETRAINED[key]


LOGS: dict[str, Path] = {}  # server URL → its log file
MODELS: dict[str, Path] = {}  # server URL → the model it serves


def start_server(base: Path, model: Path | str, *flags: str, cwd: Path = ROOT) -> Iterator[str]:
    """A ``dsgpt2 serve`` process on a free port of 127.0.0.1 for a fixture (a fork of tests/forks.py's
    server: torch and transformers already imported); its URL."""
    from forks import python_that_forks

    port = free_port()
    log = open(base / "server.log", "w")  # noqa: SIM115
    serve = ["-m", "dsgpt2", "serve", "--model", str(model), "--port", str(port), *flags]
    proc = subprocess.Popen(
        tied([python_that_forks(), *serve]),
        cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    LOGS[url] = base / "server.log"
    MODELS[url] = cwd / model
    try:
        wait_serving(url, proc, base / "server.log")
    except BaseException:
        log.close()
        raise
    yield url
    proc.terminate()
    proc.wait(timeout=deadline(30))
    log.close()
    text = (base / "server.log").read_text()
    assert f"Uvicorn running on {url}" in text
    # SIGTERM (docker stop, systemd) ends the server as Ctrl-C does: shut down, exit 0.
    assert proc.returncode == 0 and "stopped by SIGTERM" in text, (proc.returncode, text[-2000:])


def wait_serving(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    """Until the server ``proc`` at ``url`` answers /health; killed, and the test failed with its log's end,
    where it exits or does not answer within 90 s."""
    end_by = time.monotonic() + deadline(90)
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=deadline(2)).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > end_by:
            proc.kill()
            pytest.fail(f"server did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.3)


def sse(response: httpx.Response) -> list[Any]:
    """The events of a server-sent event stream: JSON objects, then the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return events


@contextmanager
def stalled_body(url: str, path: str) -> Iterator[socket.socket]:
    """A client that sends ``path`` the head of a POST and a fragment of its body, then waits."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo'
        )
        time.sleep(0.3)
        yield s
