"""dsgpt2 serve's engine in process (starlette's test client): the concurrency limit, requests sharing
one decoding batch, a decoding error answered with a 500, an event stream's slot freed, one context
check for every route."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsgpt2.infer.serve import ServeLimits, make_app
from pace import deadline
from serving import pretrained_model, sse


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Path:
    """A model with no speaker tokens (pretrained only)."""
    return pretrained_model(tmp_path_factory, sample_texts)


def gated_app(model: Path, limits: ServeLimits) -> tuple[Any, threading.Semaphore]:
    """An app on a real model whose decoding steps each wait for the test to release one."""
    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.loading import load_model

    generator = Generator(load_model(model))
    gate = threading.Semaphore(0)
    step = generator.decoder.step

    def gated_step() -> None:
        assert gate.acquire(timeout=deadline(30))
        step()

    generator.decoder.step = gated_step  # type: ignore[method-assign]
    return make_app(generator, limits), gate


@contextlib.contextmanager
def opened(gate: threading.Semaphore) -> Iterator[None]:
    """On the way out (an assertion failed, say), no step waits any more."""
    try:
        yield
    finally:
        gate.release(10_000)


def wait_for(client: Any, **expected: int) -> None:
    end_by = time.monotonic() + deadline(20)
    while any(client.get("/health").json()[k] != v for k, v in expected.items()):
        assert time.monotonic() < end_by, (client.get("/health").json(), expected)
        time.sleep(0.02)


def in_thread(results: dict, name: str, call: Any, *args: Any, **kw: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: results.update({name: call(*args, **kw)}))
    t.start()
    return t


def test_requests_beyond_the_concurrency_limit_get_503(pretrained: Path) -> None:
    from starlette.testclient import TestClient

    app, gate = gated_app(pretrained, ServeLimits(max_concurrent=1))
    with TestClient(app) as client, opened(gate):
        results: dict = {}
        first = in_thread(results, "first", client.get, "/generate?sentence=a&max_new_tokens=3")
        wait_for(client, running=1, batch_rows=1)
        busy = client.post("/generate", json={"prompt": "b", "max_new_tokens": 3})
        assert busy.status_code == 503 and "busy" in busy.json()["error"]
        api = client.post("/v1/completions", json={"prompt": "b"})
        assert api.status_code == 503 and api.headers["Retry-After"] == "1"
        assert api.json()["error"]["type"] == "server_busy"
        gate.release(10)
        first.join(deadline(10))
        assert results["first"].status_code == 200
        assert results["first"].json()["completions"][0]["tokens"] == 3
        gate.release(10)
        assert client.get("/generate?sentence=c&max_new_tokens=2").status_code == 200
        wait_for(client, running=0, batch_rows=0)


def test_concurrent_requests_share_the_batch(pretrained: Path) -> None:
    """Requests arriving while one decodes join its batch at the next step, up to --max_batch
    rows; each gets what it would alone."""
    from starlette.testclient import TestClient

    app, gate = gated_app(pretrained, ServeLimits(max_batch=4))
    body = {"max_tokens": 6, "temperature": 0}
    prompts = {"a": "Return the", "b": "The value", "c": "def f", "d": "class"}
    with TestClient(app) as client, opened(gate):
        results: dict = {}
        threads = [
            in_thread(results, "a", client.post, "/v1/completions", json={**body, "prompt": prompts["a"]})
        ]
        wait_for(client, running=1, batch_rows=1)  # "a" decodes alone, held before its second token
        for name in "bc":
            threads.append(
                in_thread(
                    results, name, client.post, "/v1/completions", json={**body, "prompt": prompts[name]}
                )
            )
        wait_for(client, running=3)
        # "d" asks for 2 samples: with 3 rows running it does not fit 4 rows, and waits.
        d_body = {**body, "prompt": prompts["d"], "n": 2, "temperature": 1.0, "seed": 5}
        threads.append(in_thread(results, "d", client.post, "/v1/completions", json=d_body))
        wait_for(client, running=4)
        gate.release()  # one step of "a"; then "b" and "c" join it
        wait_for(client, batch_rows=3)
        gate.release(100)
        for t in threads:
            t.join(deadline(20))
        wait_for(client, running=0, batch_rows=0)
        texts = {k: r.json()["choices"][0]["text"] for k, r in results.items()}
        # Each answer is the one it gets alone.
        for name in "abc":
            alone = client.post("/v1/completions", json={**body, "prompt": prompts[name]})
            assert alone.json()["choices"][0]["text"] == texts[name]
        assert [c["index"] for c in results["d"].json()["choices"]] == [0, 1]
        assert client.post("/v1/completions", json=d_body).json()["choices"] == results["d"].json()["choices"]


def test_a_decoding_error_is_a_500_and_the_server_goes_on(pretrained: Path) -> None:
    from starlette.testclient import TestClient

    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.loading import load_model

    generator = Generator(load_model(pretrained))
    add = generator.decoder.add
    failures = [RuntimeError("CUDA error: an illegal memory access")] * 2

    # The first forward of a request fails: a failure inside step() could come after an unseeded
    # draw ended the request at end-of-text, and the client would rightly get its answer.
    def failing_add(batch: list) -> None:
        if failures and batch:
            raise failures.pop()
        add(batch)

    generator.decoder.add = failing_add  # type: ignore[method-assign]
    with TestClient(make_app(generator, ServeLimits())) as client:
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "a", "max_tokens": 4, "stream": True}
        ) as r:
            events = sse(r)
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        ok = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        # A draw without a seed may end at end-of-text before its 4 tokens: either way, an answer.
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
        assert 1 <= ok.json()["usage"]["completion_tokens"] <= 4
        # The decoding thread lets a finished row go just after its last text went out.
        wait_for(client, running=0, batch_rows=0)


def test_the_decoding_thread_ends_with_the_server_and_a_closed_loop_cancels_its_request(
    pretrained: Path,
) -> None:
    """Once the server has stopped (its event loop closed), a delta for a request still decoding cancels
    that request rather than failing the batch with a traceback; and the decoding thread ends with the
    app (an interpreter that ends under a thread inside torch can abort)."""
    import asyncio

    from starlette.testclient import TestClient

    from dsgpt2.infer.decode import DecodeRequest, Delta
    from dsgpt2.infer.engine import _deliver
    from dsgpt2.infer.generate import Generator, SamplingParams
    from dsgpt2.infer.loading import load_model

    loop = asyncio.new_event_loop()
    loop.close()
    request = DecodeRequest([1, 2], SamplingParams())
    _deliver(loop, asyncio.Queue(), 0, request)(Delta(0, "a", None))
    assert request.cancelled.is_set()
    app = make_app(Generator(load_model(pretrained)), ServeLimits())
    for _ in range(2):  # served again, it decodes again
        with TestClient(app) as client:
            assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
            assert app.state.service.engine._thread.is_alive()
        assert not app.state.service.engine._thread.is_alive()


def test_an_event_stream_frees_its_slot_even_when_the_client_leaves_before_it_starts() -> None:
    import asyncio

    from dsgpt2.infer.serve import EventStream

    started, closed = [], []

    async def events() -> Any:
        started.append(True)
        yield "data: [DONE]\n\n"

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(30)  # the client is gone: nothing goes out

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(
        asyncio.wait_for(
            EventStream(events(), lambda: closed.append(True))(scope, receive, send), deadline(10)
        )
    )
    assert closed == [True] and started == []
    assert scope["state"] == {"client_left": True}  # for the access log

    async def stays() -> dict:
        await asyncio.sleep(30)
        return {}

    async def sent(message: dict) -> None:
        pass

    answered: dict = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(asyncio.wait_for(EventStream(events(), lambda: None)(answered, stays, sent), deadline(10)))
    assert "state" not in answered and started == [True]


def test_a_client_that_leaves_is_a_499_or_a_cut_stream_in_the_access_log(
    pretrained: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client gone while its answer decodes: the access log's line says so (a 499 when no answer
    had started, the 200 of a stream cut short), not a 400 nor a stream that looks answered."""
    import asyncio
    import json
    import logging

    app, gate = gated_app(pretrained, ServeLimits())
    logging.getLogger("dsgpt2").addHandler(caplog.handler)

    def request(body: dict) -> list[dict]:
        raw = json.dumps(body).encode()
        received: list[dict] = []
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "asgi": {"spec_version": "2.3"}, "http_version": "1.1", "scheme": "http",
                 "server": ("t", 80), "client": ("c", 1), "root_path": ""}  # fmt: skip
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict:  # the body, then the client is gone
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            received.append(message)

        asyncio.run(asyncio.wait_for(app(scope, receive, send), deadline(20)))
        return received

    try:
        with caplog.at_level(logging.INFO, logger="dsgpt2"), opened(gate):
            request({"prompt": "a", "max_tokens": 4})
            request({"prompt": "a", "max_tokens": 4, "stream": True})
    finally:
        logging.getLogger("dsgpt2").removeHandler(caplog.handler)
    # Once each, whether the logger also reaches the root's capture (main() may have stopped that).
    records = dict.fromkeys(caplog.records)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("POST")]
    shown = [re.sub(r"\d+ tokens, \d+ ms", "N tokens, N ms", line) for line in lines]
    assert shown == [
        f"POST /v1/completions {status}, N tokens, N ms, the client left first" for status in (499, 200)
    ]


def test_every_route_checks_a_request_against_the_context_one_way(pretrained: Path) -> None:
    """A length the context cannot hold: the same check and message on /generate and the OpenAI
    route, each naming the parameter as its request spells it."""
    from starlette.testclient import TestClient

    from dsgpt2.infer.generate import Generator
    from dsgpt2.infer.loading import load_model

    generator = Generator(load_model(pretrained))
    context = generator.context
    with TestClient(make_app(generator, ServeLimits(max_new_tokens=10 * context))) as client:
        r = client.post("/generate", json={"prompt": "a", "max_new_tokens": context})
        assert r.status_code == 400
        assert f"max_new_tokens {context} does not fit the model's context of {context}" in r.text
        r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": context})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "max_tokens"
        assert error["message"].startswith(
            f"max_tokens {context} does not fit the model's context of {context}"
        )
        ok = client.post("/generate", json={"prompt": "a", "max_new_tokens": context - 1})
        assert ok.status_code == 200, ok.text
