"""dsgpt2 serve: a real HTTP client against a server on 127.0.0.1; QUALITY.md row 15."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import ROOT, tiny_export
from dsgpt2.infer.generate import Completion, SamplingParams
from dsgpt2.infer.serve import BadRequest, ServeLimits, make_app, parse_request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOGS: dict[str, Path] = {}  # server URL → its log file
MODELS: dict[str, Path] = {}  # server URL → the model it serves


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Iterator[str]:
    base = tmp_path_factory.mktemp("serve")
    model = tiny_export(base, sample_texts[:400])
    port = _free_port()
    log = open(base / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsgpt2", "serve", "--model", str(model), "--port", str(port),
         "--max_prompt_chars", "200", "--max_tokens_limit", "32", "--max_new_tokens", "8"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    LOGS[url] = base / "server.log"
    MODELS[url] = model
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            log.close()
            pytest.fail(f"server did not start: {(base / 'server.log').read_text()[-3000:]}")
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()
    assert f"Uvicorn running on {url}" in (base / "server.log").read_text()


def test_both_endpoints_answer(server: str) -> None:
    r = httpx.get(f"{server}/generate", params={"sentence": "Return the", "max_new_tokens": "5"}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt"] == "Return the" and isinstance(body["generated"], str)
    assert body["completions"][0]["tokens"] <= 5
    post = {"prompt": "Return the", "max_new_tokens": 6, "seed": 4, "temperature": 0.9}
    a = httpx.post(f"{server}/generate", json=post, timeout=30)
    b = httpx.post(f"{server}/generate", json=post, timeout=30)
    assert a.status_code == b.status_code == 200
    assert a.json()["generated"] == b.json()["generated"]
    assert a.json()["settings"]["max_new_tokens"] == 6
    health = httpx.get(f"{server}/health", timeout=5).json()
    assert health["status"] == "ok" and health["limits"]["max_new_tokens"] == 32


@pytest.mark.parametrize(
    ("method", "payload", "reason"),
    [
        ("get", {"sentence": "x" * 201}, "at most 200"),
        ("post", {"prompt": "x" * 201}, "at most 200"),
        ("get", {"sentence": "hi", "max_new_tokens": "1000000000"}, "more than this server allows"),
        ("post", {"prompt": "hi", "max_new_tokens": 10**12}, "more than this server allows"),
        ("get", {"sentence": "hi", "temperature": "hot"}, "temperature must be a number"),
        ("post", {"prompt": "hi", "temperature": "hot"}, "temperature must be a number"),
        ("get", {"sentence": "hi", "temperature": "nan"}, "temperature must be 0 or a number in [0.01"),
        ("post", {"prompt": "hi", "temperature": 1e-45}, "temperature must be 0 or a number in [0.01"),
        ("get", {"sentence": "hi", "max_new_tokens": "--5"}, "max_new_tokens must be an integer"),
        ("get", {"sentence": "hi", "max_new_tokens": "²"}, "max_new_tokens must be an integer"),
        ("get", {"sentence": "hi", "seed": "9" * 5000}, "seed must be an integer"),
        ("post", {"prompt": "hi", "temperature": 0, "num_samples": 2}, "num_samples > 1 needs sampling"),
        ("post", {"prompt": "hi", "top_p": 7}, "top_p must be a number in (0.0, 1.0]"),
        ("post", {"prompt": "hi", "max_new_tokens": -3}, "max_new_tokens must be an integer"),
        ("post", {"prompt": "hi", "max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ("post", {"prompt": "hi", "stream": True}, "unknown setting 'stream'"),
        ("get", {}, "'sentence' is required"),
        ("post", {"prompt": 42}, "'prompt' is required and must be a string"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(
    server: str, method: str, payload: dict, reason: str
) -> None:
    if method == "get":
        r = httpx.get(f"{server}/generate", params=payload, timeout=30)
    else:
        r = httpx.post(f"{server}/generate", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]
    ok = httpx.get(f"{server}/generate", params={"sentence": "The", "max_new_tokens": "2"}, timeout=30)
    assert ok.status_code == 200


def test_malformed_bodies_get_400(server: str) -> None:
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b"", b"[" * 50_000):
        r = httpx.post(f"{server}/generate", content=body, timeout=10)
        assert r.status_code == 400, body
    r = httpx.post(f"{server}/generate", content=b'{"prompt": "a\\ud800b"}', timeout=10)
    assert r.status_code == 400 and "invalid text" in r.json()["error"]
    r = httpx.post(f"{server}/generate", content=b'{"prompt": "' + b"a" * 70_000 + b'"}', timeout=10)
    assert r.status_code == 413
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_a_client_gone_mid_body_is_one_log_line(server: str) -> None:
    log = LOGS[server]
    before = log.stat().st_size
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt": "half a bo'
        )
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while "disconnected" not in log.read_text()[before:] and time.monotonic() < deadline:
        time.sleep(0.1)
    added = log.read_text()[before:]
    assert "disconnected after" in added and "request dropped" in added, added
    assert "Traceback" not in added and "Exception in ASGI application" not in added, added
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_defaults_bind_to_localhost() -> None:
    from dsgpt2.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.host == "127.0.0.1"


def test_requests_beyond_the_concurrency_limit_get_503() -> None:
    from starlette.testclient import TestClient

    release = threading.Event()

    class SlowGenerator:
        loaded = SimpleNamespace(name="stub")
        context = 64

        def generate(self, prompt: str, params: SamplingParams) -> list[Completion]:
            release.wait(30)
            return [Completion("done", 1, "stop")]

    app = make_app(SlowGenerator(), ServeLimits(max_concurrent=1))  # type: ignore[arg-type]
    with TestClient(app) as client:
        first: dict = {}
        t = threading.Thread(target=lambda: first.update(r=client.get("/generate?sentence=a")))
        t.start()
        deadline = time.monotonic() + 10
        while client.get("/health").json()["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy = client.post("/generate", json={"prompt": "b"})
        assert busy.status_code == 503 and "busy" in busy.json()["error"]
        release.set()
        t.join(10)
        assert first["r"].status_code == 200 and first["r"].json()["generated"] == "done"
        assert client.get("/generate?sentence=c").status_code == 200


def test_parse_request_applies_limits_and_defaults() -> None:
    limits = ServeLimits(max_prompt_chars=10, max_new_tokens=8)
    defaults = SamplingParams(max_new_tokens=4, temperature=0.5)
    prompt, params = parse_request({"prompt": "hi", "top_k": "3"}, "prompt", limits, defaults)
    assert prompt == "hi" and params.top_k == 3 and params.temperature == 0.5 and params.max_new_tokens == 4
    with pytest.raises(BadRequest, match="at most 10"):
        parse_request({"prompt": "x" * 11}, "prompt", limits, defaults)
    with pytest.raises(BadRequest, match="seed must be a number"):
        parse_request({"prompt": "x", "seed": True}, "prompt", limits, defaults)


def test_busy_port_or_foreign_address_is_one_line(tmp_path: Path) -> None:
    import socket

    from dsgpt2.errors import ConfigError
    from dsgpt2.infer.serve import check_bind

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port {port} on 127.0.0.1 is in use"):
            check_bind("127.0.0.1", port)
    check_bind("127.0.0.1", port)  # free again
    with pytest.raises(ConfigError, match="cannot listen there"):
        check_bind("192.0.2.1", port)  # TEST-NET-1: no machine's own address


def test_serve_on_a_busy_port_is_one_line(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    result = subprocess.run(
        [sys.executable, "-m", "dsgpt2", "serve", "--model", str(MODELS[server]), "--port", port],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dsgpt2: error: --port {port} on 127.0.0.1 is in use by another program; choose another --port"
    )
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_openai_completions_models_and_errors(server: str) -> None:
    models = httpx.get(f"{server}/v1/models", timeout=10).json()
    served = models["data"][0]["id"]
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    body = {"model": served, "prompt": "def", "max_tokens": 8, "temperature": 0.9, "n": 2, "seed": 3}
    first = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    again = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()
    assert first["object"] == "text_completion" and len(first["choices"]) == 2
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in first["choices"])
    u = first["usage"]
    assert u["prompt_tokens"] >= 1 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # A stop sequence cuts the text before it.
    text = first["choices"][0]["text"]
    if len(text) > 2:
        cut = httpx.post(f"{server}/v1/completions", json={**body, "n": 1, "stop": [text[1:3]]}, timeout=60)
        assert cut.json()["choices"][0]["text"] == text[: text.find(text[1:3])]
        assert cut.json()["choices"][0]["finish_reason"] == "stop"
    for bad, param in (
        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "a", "logprobs": 5}, "logprobs"),
        ({"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ):
        r = httpx.post(f"{server}/v1/completions", json=bad, timeout=10)
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/completions", json={"model": "gpt-4", "prompt": "a"}, timeout=10)
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    # A pretrained model has no speaker tokens: chat is refused with the way out.
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
