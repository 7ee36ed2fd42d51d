"""dsgpt2 serve: a real HTTP client against a server on 127.0.0.1, /generate and the OpenAI routes:
an oversized prompt, absurd max tokens or a non-numeric temperature is a 400 with a reason, and the
server keeps serving."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import ROOT
from dsgpt2.errors import RequestError
from dsgpt2.infer.generate import SamplingParams
from dsgpt2.infer.serve import ServeLimits, parse_request
from pace import deadline
from serving import LOGS, MODELS, pretrained_model, sse, stalled_body, start_server


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Path:
    """A model with no speaker tokens (pretrained only)."""
    return pretrained_model(tmp_path_factory, sample_texts)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[str]:
    yield from start_server(
        tmp_path_factory.mktemp("serve"), pretrained,
        "--max_prompt_chars", "200", "--max_tokens_limit", "32", "--max_new_tokens", "8",
        "--read_timeout", "2",
    )  # fmt: skip


def test_an_empty_sentence_in_the_query_is_an_empty_prompt_as_in_a_body(server: str) -> None:
    asked = httpx.get(f"{server}/generate?sentence=&max_new_tokens=2", timeout=deadline(30))
    posted = httpx.post(f"{server}/generate", json={"prompt": "", "max_new_tokens": 2}, timeout=deadline(30))
    for r in (asked, posted):
        assert r.status_code == 200 and r.json()["prompt"] == "", r.text


def test_both_endpoints_answer(server: str) -> None:
    r = httpx.get(
        f"{server}/generate", params={"sentence": "Return the", "max_new_tokens": "5"}, timeout=deadline(30)
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt"] == "Return the" and isinstance(body["generated"], str)
    # The query may name the text as POST's body does.
    named = httpx.get(f"{server}/generate", params={"prompt": "Return the", "max_new_tokens": "5"},
                      timeout=deadline(30))  # fmt: skip
    assert named.status_code == 200 and named.json()["prompt"] == "Return the", named.text
    assert body["completions"][0]["tokens"] <= 5
    post = {"prompt": "Return the", "max_new_tokens": 6, "seed": 4, "temperature": 0.9}
    a = httpx.post(f"{server}/generate", json=post, timeout=deadline(30))
    b = httpx.post(f"{server}/generate", json=post, timeout=deadline(30))
    assert a.status_code == b.status_code == 200
    assert a.json()["generated"] == b.json()["generated"]
    assert a.json()["settings"]["max_new_tokens"] == 6
    health = httpx.get(f"{server}/health", timeout=deadline(5)).json()
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
        ("get", {"sentence": "hi", "temperature": "nan"}, "temperature must be a number in [0.0, 100.0]"),
        ("post", {"prompt": "hi", "temperature": -0.5}, "temperature must be a number in [0.0, 100.0]"),
        ("get", {"sentence": "hi", "max_new_tokens": "--5"}, "max_new_tokens must be an integer"),
        ("get", {"sentence": "hi", "max_new_tokens": "²"}, "max_new_tokens must be an integer"),
        ("get", {"sentence": "hi", "seed": "9" * 5000}, "seed must be an integer"),
        ("post", {"prompt": "hi", "temperature": 0, "num_samples": 2}, "num_samples > 1 needs sampling"),
        ("post", {"prompt": "hi", "top_p": 7}, "top_p must be a number in (0.0, 1.0]"),
        ("post", {"prompt": "hi", "max_new_tokens": -3}, "max_new_tokens must be an integer"),
        ("post", {"prompt": "hi", "max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ("post", {"prompt": "hi", "stream": True}, "unknown setting 'stream'"),
        ("get", {}, "'sentence' is required"),
        ("get", [("sentence", "a"), ("sentence", "b")], "sentence given more than once in the query"),
        ("get", {"sentence": "a", "prompt": "b"}, "give the text as sentence or as prompt, not both"),
        ("post", {"prompt": 42}, "'prompt' is required and must be a string"),
        ("post", {"prompt": "hi", "max_new_tokens": "3"}, "max_new_tokens must be a number, not text"),
        ("get", {"sentence": "hi", "max_new_tokens": ""}, "max_new_tokens must be an integer"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(
    server: str, method: str, payload: dict, reason: str
) -> None:
    if method == "get":
        r = httpx.get(f"{server}/generate", params=payload, timeout=deadline(30))
    else:
        r = httpx.post(f"{server}/generate", json=payload, timeout=deadline(30))
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]
    ok = httpx.get(
        f"{server}/generate", params={"sentence": "The", "max_new_tokens": "2"}, timeout=deadline(30)
    )
    assert ok.status_code == 200


def test_malformed_bodies_get_400(server: str) -> None:
    for body, reason in (
        (b"{not json", "not valid JSON (Expecting property name"),
        (b"[1, 2]", "must be a JSON object"),
        (b"", "must be a JSON object"),
        (b"\xff\xfe", "not UTF-8 text"),
        (b"[" * 50_000, "nested too deeply"),
    ):
        r = httpx.post(f"{server}/generate", content=body, timeout=deadline(10))
        assert r.status_code == 400 and reason in r.json()["error"], (body[:10], r.text)
    r = httpx.get(f"{server}/generate?sentence=%ff%fe&max_new_tokens=2", timeout=deadline(10))
    assert r.status_code == 400 and "not UTF-8" in r.json()["error"], r.text
    r = httpx.post(f"{server}/generate", content=b'{"prompt": "a\\ud800b"}', timeout=deadline(10))
    assert r.status_code == 400 and "invalid text" in r.json()["error"]
    limit = httpx.get(f"{server}/health", timeout=deadline(5)).json()["limits"]["max_body_bytes"]
    assert limit == 6 * 200 * 16 + 64_000  # room for 16 prompts of --max_prompt_chars 200
    r = httpx.post(f"{server}/generate", content=b'{"prompt": "' + b"a" * limit + b'"}', timeout=deadline(10))
    assert r.status_code == 413 and r.json()["error"] == f"request body over {limit} bytes (--max_body_bytes)"
    assert httpx.get(f"{server}/health", timeout=deadline(5)).status_code == 200


def test_a_body_too_large_by_its_length_is_refused_before_it_is_sent(server: str) -> None:
    """A client that asks first (``Expect: 100-continue``) with a Content-Length over --max_body_bytes
    gets the 413 at once, not a 100 Continue and the 413 after the bytes it was let send."""
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(deadline(20))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: 10000000\r\n\r\n")  # fmt: skip
        answer = s.recv(4096)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1])  # type: ignore[index]
        while len(body) < length and (more := s.recv(4096)):
            body += more
        answer = head + b"\r\n\r\n" + body
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["message"].startswith("request body over ") and error["type"] == "invalid_request_error"


def _exchange(server: str, raw: bytes) -> bytes:
    """What the server answers ``raw`` with, to the connection's end."""
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(deadline(20))
        s.sendall(raw)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_a_request_target_in_absolute_form_is_routed_by_its_path(server: str) -> None:
    """`GET http://host:port/health` (a client that talks to proxies) was a 404."""
    port = server.rsplit(":", 1)[1]
    for target in (
        f"http://127.0.0.1:{port}/health",
        f"HTTP://127.0.0.1:{port}/generate?sentence=a&max_new_tokens=2",
    ):
        raw = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
        answer = _exchange(server, raw)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]), answer
    answer = _exchange(
        server, f"GET http://127.0.0.1:{port} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    )
    assert answer.startswith(b"HTTP/1.1 404 "), answer  # the root, which serves nothing


def test_a_request_that_is_not_http_gets_a_json_400_and_an_upgrade_is_plain_http(server: str) -> None:
    log = LOGS[server]
    before = log.stat().st_size
    answer = _exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert "not valid HTTP/1.1" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")  # fmt: skip
    answer = _exchange(server, chunked)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer
    assert "not valid HTTP/1.1" in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]  # /generate's
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket"}
    assert httpx.get(f"{server}/health", headers=upgrade, timeout=deadline(10)).status_code == 200
    end_by = time.monotonic() + deadline(10)
    while "POST /generate 400" not in log.read_text()[before:] and time.monotonic() < end_by:
        time.sleep(0.1)
    added = log.read_text()[before:]
    assert "POST /generate 400" in added and "disconnected" not in added, added
    assert "pip install" not in added and "Traceback" not in added, added


def test_a_compressed_body_is_refused_as_such(server: str) -> None:
    import gzip

    body = gzip.compress(json.dumps({"prompt": "a", "max_tokens": 2}).encode())
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = httpx.post(f"{server}/v1/completions", content=body, headers=headers, timeout=deadline(10))
    assert r.status_code == 415 and "Content-Encoding gzip" in r.json()["error"]["message"], r.text


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token_and_spoils_no_other_request(
    server: str,
) -> None:
    """A top_p of 1e-300 is 0 as a float32: the nucleus keeps the likeliest token all the same (the
    greedy text), where it had left nothing to draw and failed every request in the batch with it."""
    prompt = {"prompt": "Return the", "max_new_tokens": 6}
    greedy = httpx.post(f"{server}/generate", json={**prompt, "temperature": 0}, timeout=deadline(30))
    tiny = {**prompt, "temperature": 1.5, "top_p": 1e-300, "seed": 3}
    other = {**prompt, "temperature": 1.0, "seed": 5}

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{server}/generate", json=body, timeout=deadline(30))

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(post, (other, tiny, other)))
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert answers[1].json()["generated"] == greedy.json()["generated"]
    assert answers[0].json()["generated"] == answers[2].json()["generated"]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Return", "max_tokens": 3, "top_p": 1e-300},
                   timeout=deadline(30))  # fmt: skip
    assert r.status_code == 200, r.text
    # Any temperature above 0, as the OpenAI API takes it: a tiny one samples the likeliest token, not
    # an overflow (1e-45 scaled the logits to inf and was refused below 0.01).
    for temperature in (1e-45, 1e-3):
        cold = post({**prompt, "temperature": temperature, "num_samples": 2, "seed": 4})
        assert cold.status_code == 200, cold.text
        texts = [c["text"] for c in cold.json()["completions"]]
        assert texts == [greedy.json()["generated"]] * 2, (temperature, texts)


def test_json_the_parser_cannot_take_whole_is_a_400_not_a_500(server: str) -> None:
    """A number past Python's 4,300 digits (a ValueError of its own) and a key given twice (which one
    was meant?): refused like any other bad body, on both kinds of route."""
    huge = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    for path in ("/v1/completions", "/generate"):
        r = httpx.post(f"{server}{path}", content=huge, timeout=deadline(10))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        message = error["message"] if path.startswith("/v1/") else error
        assert message == "the body's JSON holds a number of over 4300 digits"
    r = httpx.post(
        f"{server}/v1/completions", content=b'{"prompt": "x", "n": 1, "n": 2}', timeout=deadline(10)
    )
    assert r.status_code == 400 and "'n' more than once" in r.json()["error"]["message"], r.text
    assert "Traceback" not in LOGS[server].read_text()


def test_no_such_route_or_method_is_json_and_a_model_can_be_retrieved(server: str) -> None:
    r = httpx.post(f"{server}/v1/embeddings", json={}, timeout=deadline(10))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert r.json()["error"]["message"].startswith("no route POST /v1/embeddings")
    r = httpx.get(f"{server}/v1/completions", timeout=deadline(10))
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
    assert r.json()["error"]["message"] == "/v1/completions does not take GET; it takes POST"
    r = httpx.get(f"{server}/nowhere", timeout=deadline(10))
    assert r.status_code == 404 and r.json() == {
        "error": "no route GET /nowhere; see GET /health and GET /v1/models"
    }
    # GET /v1/models/{id}, the client's models.retrieve: the served name (a path: slashes and all).
    served = httpx.get(f"{server}/v1/models", timeout=deadline(10)).json()["data"][0]["id"]
    r = httpx.get(f"{server}/v1/models/{served}", timeout=deadline(10))
    assert r.status_code == 200 and r.json()["id"] == served and r.json()["object"] == "model", r.text
    r = httpx.get(f"{server}/v1/models/gpt-4", timeout=deadline(10))
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_request_not_sent_whole_in_time_gets_408_and_its_connection_closed(server: str) -> None:
    """--read_timeout 2: a head sent by halves is answered 408; a connection that sends nothing is closed
    without a word; a body cut short is answered 408 too, logged 408 (not "the client left"); the server
    serves on."""
    port = int(server.rsplit(":", 1)[1])
    log = LOGS[server]
    before = log.stat().st_size
    started = time.monotonic()
    with (
        socket.create_connection(("127.0.0.1", port)) as head,
        socket.create_connection(("127.0.0.1", port)) as silent,
        stalled_body(server, "/v1/completions") as body,
    ):
        head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for s in (head, silent, body):
            s.settimeout(deadline(20))
        answer = head.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
        message = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
        assert message == "the request was not sent whole within 2 s of its start"
        assert silent.recv(4096) == b""
        late = b""  # its body too slow: the 408 as the route's errors are shaped, then the end
        while chunk := body.recv(4096):
            late += chunk
        assert late.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), late
        assert json.loads(late.split(b"\r\n\r\n", 1)[1])["error"]["message"] == message
    assert 1.5 < time.monotonic() - started < deadline(15)
    end_by = time.monotonic() + deadline(10)
    while "POST /v1/completions 408" not in log.read_text()[before:] and time.monotonic() < end_by:
        time.sleep(0.1)
    added = log.read_text()[before:]
    assert added.count("sent no whole request in 2 s; connection closed (408)") == 2, added
    assert "POST /v1/completions 408" in added and "disconnected" not in added, added
    assert httpx.get(f"{server}/health", timeout=deadline(5)).status_code == 200


def test_the_body_limit_makes_room_for_the_prompts_a_request_may_send() -> None:
    assert ServeLimits(max_prompt_chars=200, max_sequences=16).max_body_bytes == 6 * 200 * 16 + 64_000
    assert ServeLimits(max_prompt_chars=100_000).max_body_bytes > 6 * 100_000 * 16
    assert ServeLimits(max_body_bytes=5000).max_body_bytes == 5000


def test_a_body_limit_too_small_for_any_request_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--max_body_bytes 1` was taken: every request then got 413."""
    from dsgpt2.cli.main import main
    from dsgpt2.errors import ConfigError

    with pytest.raises(SystemExit) as exited:
        main(["serve", "--model", "m", "--max_body_bytes", "1"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--max_body_bytes: must be an integer at least 1024, got '1'" in line, line
    with pytest.raises(ConfigError, match="--max_body_bytes must be an integer at least 1024, got 1023"):
        ServeLimits(max_body_bytes=1023)
    assert ServeLimits(max_body_bytes=1024).max_body_bytes == 1024


def test_a_client_gone_mid_body_is_one_log_line(server: str) -> None:
    log = LOGS[server]
    before = log.stat().st_size
    with stalled_body(server, "/generate"):
        pass
    end_by = time.monotonic() + deadline(10)
    while "disconnected" not in log.read_text()[before:] and time.monotonic() < end_by:
        time.sleep(0.1)
    added = log.read_text()[before:]
    assert "disconnected after" in added and "request dropped" in added, added
    assert "Traceback" not in added and "Exception in ASGI application" not in added, added
    assert httpx.get(f"{server}/health", timeout=deadline(5)).status_code == 200


def test_defaults_bind_to_localhost() -> None:
    from dsgpt2.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.host == "127.0.0.1"


def test_parse_request_applies_limits_and_defaults() -> None:
    limits = ServeLimits(max_prompt_chars=10, max_new_tokens=8)
    defaults = SamplingParams(max_new_tokens=4, temperature=0.5)
    prompt, params = parse_request({"prompt": "hi", "top_k": "3"}, "prompt", limits, defaults, query=True)
    assert prompt == "hi" and params.top_k == 3 and params.temperature == 0.5 and params.max_new_tokens == 4
    with pytest.raises(RequestError, match=r'^top_k must be a number, not text: "3"$'):  # a body's text
        parse_request({"prompt": "hi", "top_k": "3"}, "prompt", limits, defaults)
    with pytest.raises(RequestError, match="at most 10"):
        parse_request({"prompt": "x" * 11}, "prompt", limits, defaults)
    with pytest.raises(RequestError, match=r"^seed must be a number, got true$"):  # JSON's spelling
        parse_request({"prompt": "x", "seed": True}, "prompt", limits, defaults)


def test_busy_port_or_foreign_address_is_one_line(tmp_path: Path) -> None:
    from dsgpt2.errors import ConfigError
    from dsgpt2.listen import check_bind

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
        cwd=ROOT, capture_output=True, text=True, timeout=deadline(120),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"dsgpt2: error: --port {port} on 127.0.0.1 is in use by another program; choose another --port"
    )
    assert httpx.get(f"{server}/health", timeout=deadline(5)).status_code == 200


def test_openai_completions_models_and_errors(server: str) -> None:
    models = httpx.get(f"{server}/v1/models", timeout=deadline(10)).json()
    served = models["data"][0]["id"]
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    body = {"model": served, "prompt": "def", "max_tokens": 8, "temperature": 0.9, "n": 2, "seed": 3}
    first = httpx.post(f"{server}/v1/completions", json=body, timeout=deadline(60)).json()
    again = httpx.post(f"{server}/v1/completions", json=body, timeout=deadline(60)).json()
    assert first["object"] == "text_completion" and len(first["choices"]) == 2
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in first["choices"])
    u = first["usage"]
    assert u["prompt_tokens"] >= 1 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # A stop sequence cuts the text before it.
    text = first["choices"][0]["text"]
    if len(text) > 2:
        cut = httpx.post(
            f"{server}/v1/completions", json={**body, "n": 1, "stop": [text[1:3]]}, timeout=deadline(60)
        )
        assert cut.json()["choices"][0]["text"] == text[: text.find(text[1:3])]
        assert cut.json()["choices"][0]["finish_reason"] == "stop"
    for bad, param in (
        ({"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "a", "logprobs": 5}, "logprobs"),
        ({"prompt": "a", "logprobs": 0}, "logprobs"),  # the sampled tokens' logprobs: not the default
        ({"prompt": "a", "max_completion_tokens": 3}, "max_completion_tokens"),
        ({"prompt": "a", "max_tokens": 10_000}, "max_tokens"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ):
        r = httpx.post(f"{server}/v1/completions", json=bad, timeout=deadline(10))
        assert r.status_code == 400, bad
        if param == "max_completion_tokens":
            assert "/v1/completions takes max_tokens" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/completions", json={"model": "gpt-4", "prompt": "a"}, timeout=deadline(10))
    assert r.status_code == 404 and "gpt-4" in r.json()["error"]["message"]
    # A pretrained model has no speaker tokens: chat is refused with the way out.
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   timeout=deadline(30))  # fmt: skip
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
    assert httpx.get(f"{server}/health", timeout=deadline(10)).status_code == 200


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[str]:
    """An export at runs/model2 of the checkpoint runs/ckpt2/global_step120 (as `dsgpt2 export` records
    it), served from its working directory as `--model runs/model2`."""
    from dsgpt2.checkpoints.weights import RUN_INFO

    base = tmp_path_factory.mktemp("named")
    shutil.copytree(pretrained, base / "runs" / "model2")
    run = {"step": 120, "checkpoint": "runs/ckpt2/global_step120"}
    (base / "runs" / "model2" / RUN_INFO).write_text(json.dumps(run))
    yield from start_server(base, "runs/model2", cwd=base)


def test_the_model_is_named_as_given_and_its_checkpoint_is_an_alias(named_server: str) -> None:
    given, checkpoint = "runs/model2", "runs/ckpt2/global_step120"
    models = httpx.get(f"{named_server}/v1/models", timeout=deadline(10)).json()["data"]
    assert [m["id"] for m in models] == [given, checkpoint]
    assert models[0]["aliases"] == [checkpoint] and models[1]["alias_of"] == given
    for name in (given, checkpoint):
        body = {"model": name, "prompt": "def", "max_tokens": 3}
        r = httpx.post(f"{named_server}/v1/completions", json=body, timeout=deadline(60))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == given
        # Chat gets past the name too, to the refusal a pretrained model gives.
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{named_server}/v1/chat/completions", json=chat, timeout=deadline(30))
        assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]
    r = httpx.post(
        f"{named_server}/v1/completions", json={"model": "runs/model3", "prompt": "a"}, timeout=deadline(10)
    )
    assert r.status_code == 404
    assert r.json()["error"]["message"] == (
        f"the model 'runs/model3' does not exist; this server serves {given!r} (also as {checkpoint!r})"
    )
    health = httpx.get(f"{named_server}/health", timeout=deadline(10)).json()
    assert health["model"] == given and health["aliases"] == [checkpoint]


PAGE = "http://localhost:3000"


@pytest.fixture(scope="module")
def cors_server(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[str]:
    """A server with an API key that a page of PAGE may call from a browser."""
    yield from start_server(
        tmp_path_factory.mktemp("cors"), pretrained, "--api_key", "k", "--allow_origin", PAGE
    )


def test_a_page_of_an_allowed_origin_may_call_the_server_from_a_browser(
    cors_server: str, server: str
) -> None:
    """CORS: a browser's preflight (OPTIONS, which never carries the key) is answered before authentication;
    answers to the page, a 401 too, say the page may read them; another origin, or a server without
    --allow_origin, gets no such header (the browser then hides the answer from the page)."""
    asks = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    url, body = f"{cors_server}/v1/completions", {"prompt": "a", "max_tokens": 2}
    r = httpx.options(url, headers={"Origin": PAGE, **asks}, timeout=deadline(10))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE, r.text
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.post(
        url, json=body, headers={"Origin": PAGE, "Authorization": "Bearer k"}, timeout=deadline(60)
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE, r.text
    r = httpx.post(url, json=body, headers={"Origin": PAGE}, timeout=deadline(10))
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == PAGE
    r = httpx.options(url, headers={"Origin": "http://elsewhere.example", **asks}, timeout=deadline(10))
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{server}/v1/completions", headers={"Origin": PAGE, **asks}, timeout=deadline(10))
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_a_preflight_for_the_headers_the_openai_javascript_client_sends_is_answered(cors_server: str) -> None:
    """The openai JavaScript client adds its X-Stainless-* headers to every call: a preflight naming them
    was a 400 (Disallowed CORS headers), and the page's every call with it failed."""
    sent = "authorization, content-type, x-stainless-lang, x-stainless-os, x-stainless-retry-count"
    asks = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": sent}
    r = httpx.options(f"{cors_server}/v1/chat/completions", headers=asks, timeout=deadline(10))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE, r.text
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].lower().split(",")}
    assert {h.strip() for h in sent.split(",")} <= allowed, allowed


def test_a_long_prompt_in_a_query_that_arrives_in_pieces_is_read_and_a_longer_head_is_a_431(
    cors_server: str,
) -> None:
    """A GET /generate whose query carries a prompt within --max_prompt_chars (4,000 here) was a 400 "not
    valid HTTP/1.1" once its head, past h11's 16 KiB, arrived in pieces as over a network; read at once,
    the same bytes were answered. A head longer than any such query is a 431 saying so."""
    port = int(cors_server.rsplit(":", 1)[1])
    query = "max_new_tokens=1&sentence=" + "%E2%82%AC" * 2000  # 2,000 characters, 18,000 bytes
    head = (
        f"GET /generate?{query} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(deadline(30))
        s.sendall(head.encode()[:17_000])
        time.sleep(0.3)  # h11 has read the first piece, not yet whole
        s.sendall(head.encode()[17_000:])
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["prompt"] == "\u20ac" * 2000
    # One byte over: all of it read when h11 gives up, so that the close sends no reset over the answer.
    start = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: "
    answer = _exchange(cors_server, start + b"a" * (64_384 + 1 - len(start)))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
    message = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert "the request line and headers are over 64,384 bytes; send a long prompt in a POST body" in message


def test_an_allowed_origin_is_one_a_browser_sends() -> None:
    from conftest import run_cli
    from dsgpt2.cli.infer import ServeSettings
    from dsgpt2.errors import ConfigError

    result = run_cli("serve", "--model", "m", "--allow_origin", "localhost:3000")
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--allow_origin 'localhost:3000' is not an origin: give scheme://host[:port]" in line, line
    for origin in ("http://localhost:3000/", "http://a.example/app", ""):
        with pytest.raises(ConfigError, match=f"--allow_origin {origin!r} is not an origin"):
            ServeSettings(allow_origin=(origin,))
    assert ServeSettings(allow_origin=("*", "https://a.example:8443")).allow_origin[0] == "*"


def test_streamed_completions_are_the_unstreamed_ones_in_pieces(server: str) -> None:
    body = {"prompt": "Return the", "max_tokens": 12, "temperature": 0.9, "n": 2, "seed": 11, "stop": "\n\n"}
    whole = httpx.post(f"{server}/v1/completions", json=body, timeout=deadline(60)).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server}/v1/completions", json=streamed, timeout=deadline(60)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"] and events[-2]["choices"] == []
    chunks = events[:-2]
    assert len(chunks) > 4 and all(
        c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks
    )
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(m["text"] for m in mine) == choice["text"]
        assert [m["finish_reason"] for m in mine][-1] == choice["finish_reason"]
        assert all(m["finish_reason"] is None for m in mine[:-1])


@pytest.fixture(scope="module")
def line_break_server(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[str]:
    """The model served under a name holding the characters Python's str.splitlines ends a line at
    beside CR and LF (as generated text may hold them): the name is in every event of a stream."""
    base = tmp_path_factory.mktemp("line_break")
    (base / "a\u2028b\u2029c\x85d").symlink_to(pretrained, target_is_directory=True)
    yield from start_server(base, "a\u2028b\u2029c\x85d", cwd=base)


def test_every_event_of_a_stream_is_one_line_to_a_reader_that_splits_lines_as_python_does(
    line_break_server: str,
) -> None:
    """JSON leaves U+2028, U+2029 and U+0085 as they are; httpx's iter_lines (and the clients built on it)
    ends a line at each, and read an event holding one as two lines of broken JSON."""
    name = "a\u2028b\u2029c\x85d"
    body = {"prompt": "def", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{line_break_server}/v1/completions", json=body, timeout=deadline(60)) as r:
        events = sse(r)
    assert events[-1] == "[DONE]" and all(e["model"] == name for e in events[:-1]), events
    r = httpx.post(
        f"{line_break_server}/v1/completions", json={"prompt": "def", "max_tokens": 3}, timeout=deadline(60)
    )
    assert r.status_code == 200 and r.json()["model"] == name, r.text


def test_api_defaults_and_field_mapping() -> None:
    from dsgpt2.infer.openai_api import api_request

    limits, defaults = ServeLimits(max_new_tokens=100), SamplingParams(max_new_tokens=48, top_k=40)
    plain = api_request({"prompt": "a"}, False, "m", limits, defaults)
    assert (plain.params.max_new_tokens, plain.params.temperature, plain.params.top_p) == (16, 1.0, 1.0)
    assert plain.params.top_k == 0 and plain.params.repetition_penalty == 1.0 and not plain.stream
    # No seed: a fresh one each request (the server's --seed is for /generate).
    assert plain.params.seed != api_request({"prompt": "a"}, False, "m", limits, defaults).params.seed
    chat = api_request({"messages": [{"role": "user", "content": "hi"}]}, True, "m", limits, defaults)
    assert chat.params.max_new_tokens == 48  # a reply is as long as the server's default
    asked = api_request(
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
         "max_completion_tokens": 7, "n": 3, "seed": 9, "stop": "x", "stream": True,
         "stream_options": {"include_usage": True}},
        True, "m", limits, defaults,
    )  # fmt: skip
    assert (asked.params.max_new_tokens, asked.params.num_samples, asked.params.seed) == (7, 3, 9)
    assert asked.stop == ["x"] and asked.stream and asked.stream_usage
    # The system text is kept apart: before the first user turn kept, however many are dropped.
    assert asked.turns == [{"speaker": "user", "text": "hi"}] and asked.system == "Be brief."
    for body, param in (
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "a", "n": 2, "temperature": 0}, "n"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "a", "stream": 1}, "stream"),
        ({"prompt": "a", "model": 5}, "model"),
        ({"prompt": "a", "user": 5}, "user"),
        ({"prompt": "a", "stop": ["\ud800"]}, "stop"),
        # More sequences than one request may decode (--max_sequences, 16): 9 prompts × 2 samples.
        ({"prompt": ["a"] * 9, "n": 2}, "prompt"),
    ):
        with pytest.raises(RequestError) as caught:
            api_request(body, False, "m", limits, defaults)
        assert caught.value.param == param, (body, caught.value)
    for messages in (
        [],
        [{"role": "assistant", "content": "x"}],
        [{"role": "tool", "content": "x"}],
        [{"role": ["user"], "content": "x"}],
        [{"role": {}, "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    ):
        with pytest.raises(RequestError, match=r"messages|last message|role") as caught:
            api_request({"messages": messages}, True, "m", limits, defaults)
        assert caught.value.param == "messages"
    sixteen = api_request({"prompt": ["a"] * 8, "n": 2}, False, "m", limits, defaults)
    assert len(sixteen.prompts) * sixteen.params.num_samples == limits.max_sequences == 16


def test_max_sequences_bounds_every_route() -> None:
    """--max_sequences lowered below the largest n: /generate, /v1/completions and
    /v1/chat/completions each refuse a request asking for more, and take one asking for as many."""
    from dsgpt2.infer.openai_api import api_request

    limits, defaults = ServeLimits(max_sequences=2), SamplingParams()
    chat = [{"role": "user", "content": "hi"}]
    assert api_request({"messages": chat, "n": 2}, True, "m", limits, defaults).params.num_samples == 2
    refused = r"^n 3 is more sequences than this server decodes for one request \(2\)"
    with pytest.raises(RequestError, match=refused) as caught:
        api_request({"messages": chat, "n": 3}, True, "m", limits, defaults)
    assert caught.value.param == "n"
    with pytest.raises(RequestError) as caught:
        api_request({"prompt": "a", "n": 3}, False, "m", limits, defaults)
    assert caught.value.param == "n"
    with pytest.raises(RequestError, match=r"^3 prompts times n 1 is more sequences") as caught:
        api_request({"prompt": ["a"] * 3}, False, "m", limits, defaults)
    assert caught.value.param == "prompt"
    assert parse_request({"prompt": "a", "num_samples": 2}, "prompt", limits, defaults)[1].num_samples == 2
    with pytest.raises(RequestError, match=r"^num_samples 3 is more sequences"):
        parse_request({"prompt": "a", "num_samples": 3}, "prompt", limits, defaults)


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory: pytest.TempPathFactory, pretrained: Path) -> Iterator[str]:
    """A server of its own: no other test's request ends while its log is read."""
    yield from start_server(tmp_path_factory.mktemp("access"), pretrained)


def test_each_request_is_one_access_log_line_and_loading_is_said(quiet_server: str) -> None:
    """Method, path (not the prompt in the query), status, tokens generated, milliseconds: one line per
    request, the refused ones too; and a line before the model loads, the server silent meanwhile."""
    server = quiet_server
    log = LOGS[server]
    text = log.read_text()
    assert text.index("loading the model ") < text.index("model loaded in ") < text.index("Uvicorn running")
    before = log.stat().st_size
    r = httpx.get(f"{server}/generate", params={"sentence": "Return the secret", "max_new_tokens": "5"},
                  timeout=deadline(30))  # fmt: skip
    assert r.status_code == 200
    tokens = r.json()["completions"][0]["tokens"]
    assert httpx.post(f"{server}/generate", json={"prompt": 3}, timeout=deadline(10)).status_code == 400
    body = {"prompt": "Return the", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=deadline(30)) as streamed:
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    # Sampled: the stream may end at <|endoftext|> before max_tokens (finish_reason "stop").
    ended = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    streamed_tokens = 4 if ended == ["length"] else None

    def logged() -> list[str]:
        # The fixture's readiness probes (GET /health) may still be logging as this test begins.
        return [line.split("dsgpt2.infer.serve: ", 1)[1] for line in log.read_text()[before:].splitlines()
                if "dsgpt2.infer.serve: " in line and "GET /health " not in line]  # fmt: skip

    end_by = time.monotonic() + deadline(10)
    while len(logged()) < 3 and time.monotonic() < end_by:
        time.sleep(0.1)
    lines = logged()
    shown = [re.sub(r"\d+ ms$", "N ms", line) for line in lines]
    assert shown[:2] == [f"GET /generate 200, {tokens} tokens, N ms", "POST /generate 400, 0 tokens, N ms"], (
        lines
    )
    assert re.fullmatch(r"POST /v1/completions 200, [1-4] tokens, N ms", shown[2]) and len(shown) == 3, lines
    if streamed_tokens is not None:
        assert shown[2] == f"POST /v1/completions 200, {streamed_tokens} tokens, N ms", lines
    assert "secret" not in log.read_text()[before:]  # the prompt is not logged


def test_a_path_cannot_write_a_line_of_its_own_into_the_log(quiet_server: str) -> None:
    """The access log shows the decoded path: a ``%0a`` in it would start a forged line, a ``%1b`` colour
    the operator's terminal. Control characters are escaped."""
    log = LOGS[quiet_server]
    before = log.stat().st_size
    forged = "INFO dsgpt2.infer.serve: POST /v1/completions 200, 99 tokens, 1 ms"
    r = httpx.get(f"{quiet_server}/v1/models/x%0a{forged.replace(' ', '%20')}%0d%1b[31mRED%00",
                  timeout=deadline(10))  # fmt: skip
    assert r.status_code == 404
    end_by = time.monotonic() + deadline(10)
    while "GET /v1/models/x" not in log.read_text()[before:] and time.monotonic() < end_by:
        time.sleep(0.1)
    written = log.read_text()[before:]
    line = next(line for line in written.splitlines() if "GET /v1/models/x" in line)
    assert "x\\n" + forged in line and "\\r\\x1b[31mRED\\x00 404" in line, line
    assert all("GET /v1/models/x" in line for line in written.splitlines() if forged in line)
    assert "\x1b" not in written and "\x00" not in written and "\r" not in written


def test_sigterm_gives_the_requests_in_flight_the_grace_then_ends_0(tmp_path: Path, pretrained: Path) -> None:
    """A client stalled mid-body held the shutdown for as long as it stayed: --shutdown_grace bounds
    it, and the server still ends 0 (start_server checks the exit code and the line)."""
    gen = iter(start_server(tmp_path, pretrained, "--shutdown_grace", "1"))
    url = next(gen)
    with stalled_body(url, "/v1/completions"):
        started = time.monotonic()
        next(gen, None)  # SIGTERM, then the exit code and the line checked
        assert time.monotonic() - started < deadline(15)
    text = LOGS[url].read_text()
    assert "timeout graceful shutdown exceeded" in text and "Traceback" not in text, text[-3000:]
    assert "POST /v1/completions cut off by the shutdown" in text and "POST /v1/completions 503" in text
