"""dsgpt2 serve with a chat model and an API key: the official OpenAI client (completions, chat,
streaming), the key guarding every route but /health, long requests run to their length and stopped
when their client leaves."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, tiny_export
from dsgpt2.collective import free_port
from pace import deadline
from serving import LOGS, MODELS, start_server, wait_serving

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory, sample_texts: list[str]) -> Iterator[str]:
    """A model with <|user|> and <|bot|>, a long context, an API key."""
    base = tmp_path_factory.mktemp("chat")
    model = tiny_export(base, sample_texts[:400], context=1024)
    yield from start_server(base, model, "--max_tokens_limit", "1000", "--api_key", KEY)


def test_official_client_completions_chat_and_streaming(chat_server: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key=KEY, max_retries=0, timeout=deadline(60))
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    done = client.completions.create(model=served, prompt="The", max_tokens=5, seed=1)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= 5
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does this return?"},
        {"role": "assistant", "content": "A list."},
        {"role": "user", "content": "Of what?"},
    ]
    chat = client.chat.completions.create(
        model=served, messages=messages, max_tokens=20, seed=4, temperature=0.8
    )
    answer = chat.choices[0].message
    assert answer.role == "assistant" and answer.content == answer.content.strip()
    assert chat.usage.prompt_tokens > 10
    again = client.chat.completions.create(
        model=served, messages=messages, max_tokens=20, seed=4, temperature=0.8
    )
    assert again.choices[0].message.content == answer.content  # the same seed, the same reply
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(
        model=served, messages=messages, max_tokens=20, seed=4, temperature=0.8, stream=True
    ):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(pieces) == answer.content and reasons[-1] == chat.choices[0].finish_reason
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=served, messages=messages, frequency_penalty=0.5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{chat_server}/v1", api_key="wrong", max_retries=0).models.list()


def test_the_api_key_guards_everything_but_health(chat_server: str) -> None:
    for path in ("/v1/models", "/generate?sentence=a"):
        r = httpx.get(f"{chat_server}{path}", timeout=deadline(10))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    r = httpx.post(
        f"{chat_server}/v1/completions", json={"prompt": "a"}, headers={"Authorization": "Bearer x"}
    )
    assert r.status_code == 401
    assert httpx.get(f"{chat_server}/health", timeout=deadline(10)).json()["auth"] is True
    for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme's case is free (RFC 9110)
        ok = httpx.get(
            f"{chat_server}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=deadline(10)
        )
        assert ok.status_code == 200
    for header in (f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer{KEY}"):
        r = httpx.get(f"{chat_server}/v1/models", headers={"Authorization": header}, timeout=deadline(10))
        assert r.status_code == 401, header
    # Two Authorization headers (the right key last): not the last one's, whichever a proxy checked.
    twice = httpx.Headers([("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")])
    assert httpx.get(f"{chat_server}/v1/models", headers=twice, timeout=deadline(10)).status_code == 401
    assert KEY not in LOGS[chat_server].read_text()


# Greedy completions of 8 prompts that each run to max_tokens (no end-of-text): 8,000 tokens.
LONG = {"prompt": [f"The {i}" for i in range(8)], "max_tokens": 1000, "temperature": 0}


def test_long_requests_run_to_their_length(chat_server: str) -> None:
    """What the two tests below cut short runs 8,000 tokens when left alone."""
    r = httpx.post(
        f"{chat_server}/v1/completions",
        json=LONG,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=deadline(120),
    )
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 8
    assert r.json()["usage"]["completion_tokens"] == 8 * 1000


def test_a_stream_cut_by_the_shutdown_says_so_and_a_waiting_request_gets_the_apis_503(
    chat_server: str, tmp_path: Path
) -> None:
    """--shutdown_grace 0: a stream under way ends with an error event, then [DONE] (its client can tell
    it from a whole answer); a request waiting for room in the batch gets a 503 in the API's format."""
    flags = ("--max_tokens_limit", "1000", "--max_batch", "8", "--shutdown_grace", "0")
    server = iter(start_server(tmp_path, MODELS[chat_server], *flags))
    url = next(server)
    events: list[str] = []
    waiting: list[httpx.Response] = []
    streaming = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                          timeout=deadline(120)) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    streaming.set()

    def whole() -> None:  # its row waits: the stream's 8 fill --max_batch
        waiting.append(httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=deadline(120)))

    threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
    threads[0].start()
    assert streaming.wait(deadline(60))
    threads[1].start()
    end_by = time.monotonic() + deadline(30)  # until the server holds both requests
    while httpx.get(f"{url}/health", timeout=deadline(5)).json()["running"] < 2:
        assert time.monotonic() < end_by and threads[1].is_alive() and not waiting
        time.sleep(0.05)
    next(server, None)  # SIGTERM; exit 0 and the line checked
    for t in threads:
        t.join(deadline(30))
    assert events[-1] == "[DONE]" and len(events) < 8 * 1000, events[-3:]
    assert json.loads(events[-2])["error"]["message"] == "the server shut down before the answer was complete"
    (answer,) = waiting
    assert answer.status_code == 503 and answer.json()["error"]["message"] == "the server is shutting down"
    text = LOGS[url].read_text()
    assert "Traceback" not in text and "Event loop is closed" not in text, text[-3000:]


def test_a_second_ctrl_c_cuts_the_requests_off_without_a_traceback(chat_server: str, tmp_path: Path) -> None:
    """Ctrl-C waits --shutdown_grace for the requests in flight; a second one cuts them off at once. Each
    still gets its answer's end (a stream: an error event, then [DONE]), the decoding thread is stopped,
    and the log holds no traceback (uvicorn's cancelled lifespan once printed one)."""
    port = free_port()
    out = open(tmp_path / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsgpt2", "serve", "--model", str(MODELS[chat_server]), "--port", str(port),
         "--max_tokens_limit", "1000", "--shutdown_grace", "60"],
        cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(url, proc, tmp_path / "server.log")
        body = {**LONG, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=deadline(60)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert proc.wait(timeout=deadline(30)) == 0
    finally:
        proc.kill()
        out.close()
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["message"] == "the server shut down before the answer was complete"
    text = (tmp_path / "server.log").read_text()
    assert "cut off by the shutdown" in text and "Traceback" not in text, text[-3000:]


def test_a_client_leaving_mid_stream_stops_its_generation(chat_server: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}

    def health() -> dict:
        return httpx.get(f"{chat_server}/health", timeout=deadline(10)).json()

    before = health()["tokens_generated"]
    body = {**LONG, "stream": True}
    with httpx.stream(
        "POST", f"{chat_server}/v1/completions", json=body, headers=auth, timeout=deadline(60)
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
    # The connection is closed: the row leaves the batch and the slot frees.
    end_by = time.monotonic() + deadline(10)
    while (h := health())["running"] or h["batch_rows"]:
        assert time.monotonic() < end_by, h
        time.sleep(0.05)
    spent = h["tokens_generated"] - before
    time.sleep(0.5)
    assert health()["tokens_generated"] - before == spent < 8 * 1000
    # The server goes on.
    r = httpx.post(
        f"{chat_server}/v1/completions",
        json={"prompt": "a", "max_tokens": 3},
        headers=auth,
        timeout=deadline(30),
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_a_client_leaving_before_its_whole_answer_stops_it_too(chat_server: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(f"{chat_server}/health", timeout=deadline(10)).json()["tokens_generated"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{chat_server}/v1/completions", json=LONG, headers=auth, timeout=httpx.Timeout(10, read=0.1)
        )
    # The slot frees when the handler returns; the cancelled rows leave the batch at the engine's next step.
    end_by = time.monotonic() + deadline(10)
    while (h := httpx.get(f"{chat_server}/health", timeout=deadline(10)).json())["running"] or h[
        "batch_rows"
    ]:
        assert time.monotonic() < end_by, h
        time.sleep(0.05)
    assert h["tokens_generated"] - before < 8 * 1000


def test_chat_on_a_model_pretrained_on_text_is_refused_though_its_tokenizer_has_speakers(
    tmp_path: Path, sample_texts: list[str]
) -> None:
    """`vocab train` gives every tokenizer the speaker tokens: what decides is what the model was
    trained on, recorded in its run file (`dsgpt2 export` writes it)."""
    from conftest import run_cli
    from dsgpt2.checkpoints.weights import RUN_INFO

    model = tiny_export(tmp_path, sample_texts[:400], context=256)
    (model / RUN_INFO).write_text(
        json.dumps({"step": 10, "checkpoint": "runs/ckpt/global_step10", "task": "lm"})
    )
    gen = iter(start_server(tmp_path, model))
    url = next(gen)
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=deadline(30))  # fmt: skip
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages" and "was trained on text (task lm)" in error["message"]
        assert error["message"].startswith(f"{model} was trained")  # the served name, not its checkpoint
        assert error["message"].endswith("use /v1/completions")
        done = httpx.post(
            f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 3}, timeout=deadline(30)
        )
        assert done.status_code == 200
    finally:
        next(gen, None)
    chat = run_cli("chat", "--model", str(model))
    assert chat.returncode == 2 and "Traceback" not in chat.stderr
    assert "was trained on text (its task: lm), not on conversations" in chat.stderr.strip().splitlines()[-1]
