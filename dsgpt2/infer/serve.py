"""``dsgpt2 serve``: generation over HTTP (Starlette app, served by uvicorn).

Endpoints:
- ``GET /generate?sentence=...`` (the original toolkit's) with optional
  sampling settings as query parameters;
- ``POST /generate`` with a JSON body ``{"prompt": ..., "max_new_tokens": ...}``;
- ``GET /health``: the model and the limits;
- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models[/{id}]``: the OpenAI API
  (:mod:`dsgpt2.infer.openai_api`), streamed as server-sent events on ``stream: true``.

Every generation goes through one :class:`~dsgpt2.infer.engine.Batcher`: concurrent requests are
decoded together in one batch. Limits guard the process: prompt length, ``max_new_tokens``, the
rows in the batch and the requests in flight (more get 503 and ``Retry-After`` at once rather than
queueing). A client that leaves (mid-stream or before its answer) stops its generation. A bad
request gets 400 with the reason; an error inside decoding is answered with 500 and the server
goes on. With an API key, every request but ``/health`` needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import PurePath
from typing import Any
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dsgpt2.documents import text_problem
from dsgpt2.errors import ConfigError, GenerationFailed, RequestError
from dsgpt2.infer.connections import MALFORMED, TIMED_OUT, AbsoluteForm, cross_origin, deadlined
from dsgpt2.infer.decode import DecodeRequest, Delta
from dsgpt2.infer.engine import Batcher
from dsgpt2.infer.generate import Completion, Generator, SamplingParams
from dsgpt2.infer.openai_api import (
    ApiAnswer,
    api_request,
    chat_decodes,
    check_model,
    completion_decodes,
    fit_prompt,
    models_body,
    new_id,
    now,
    sse_event,
)
from dsgpt2.infer.settings import ServeLimits
from dsgpt2.listen import check_bind

log = logging.getLogger(__name__)
# The access log's status for a request whose client went away before its answer (nginx's 499).
CLIENT_LEFT = 499
# The last event of every stream.
DONE = "data: [DONE]\n\n"


def parse_request(
    values: dict[str, Any],
    prompt_key: str,
    limits: ServeLimits,
    defaults: SamplingParams,
    *,
    query: bool = False,
) -> tuple[str, SamplingParams]:
    """The prompt and sampling settings of a request (``query``: a query string's, where every value is
    text; a JSON body's numbers are numbers).

    Raises:
        RequestError: a missing or oversized prompt, an unknown setting, a bad value, or more
            tokens than the server allows.
    """
    values = dict(values)
    prompt = values.pop(prompt_key, None)
    if not isinstance(prompt, str):
        raise RequestError(f"{prompt_key!r} is required and must be a string")
    if prompt and text_problem(prompt, limits.max_prompt_chars) == "invalid_unicode":
        raise RequestError(f"{prompt_key!r} holds invalid text (a lone surrogate or undecodable bytes)")
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError(
            f"{prompt_key!r} is {len(prompt)} characters long; this server accepts at most "
            f"{limits.max_prompt_chars}"
        )
    quoted = next((k for k, v in values.items() if isinstance(v, str)), None)
    if quoted is not None and not query:
        raise RequestError(f"{quoted} must be a number, not text: {json.dumps(values[quoted])[:80]}")
    try:
        params = SamplingParams.from_mapping(values, defaults)
        limits.check_length(params.max_new_tokens)
        limits.check_sequences(1, params.num_samples)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    return prompt, params


class Slots:
    """Requests admitted at once (decoding or waiting for room in the batch)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0

    def take(self) -> bool:
        # Handlers run on the event loop's thread: no lock needed.
        if self.taken >= self.limit:
            return False
        self.taken += 1
        return True

    def release(self) -> None:
        self.taken -= 1

    def busy(self, api: bool) -> JSONResponse:
        message = f"busy: {self.limit} requests already in flight; retry later"
        return _error(message, 503, api, kind="server_busy", headers={"Retry-After": "1"})


def _error(
    message: str, status: int, api: bool, kind: str = "", headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error answer: OpenAI's error object on the API routes, ``{"error": ...}`` on /generate."""
    body = RequestError(message, status=status, kind=kind).body() if api else {"error": message}
    return JSONResponse(body, status_code=status, headers=headers)


def make_app(
    generator: Generator,
    limits: ServeLimits,
    defaults: SamplingParams | None = None,
    api_key: str | None = None,
    name: str | None = None,
    *,
    origins: Sequence[str] = (),
) -> Starlette:
    """The HTTP application around ``generator``; ``api_key``: the bearer token every request but
    ``/health`` must carry (none: no authentication); ``name``: the model's name in the API (default:
    where it was loaded from), the checkpoint it came from being an alias; ``origins``: the web pages
    whose scripts may call it (CORS)."""
    service = Service(generator, limits, defaults, api_key is not None, name)
    middleware = [Middleware(AbsoluteForm), Middleware(AccessLog), *cross_origin(origins)]
    middleware += [Middleware(BearerAuth, api_key=api_key)] if api_key else []
    app = Starlette(
        routes=[
            Route("/generate", service.get_generate, methods=["GET"]),
            Route("/generate", service.post_generate, methods=["POST"]),
            Route("/health", service.health, methods=["GET"]),
            Route("/v1/completions", service.completions, methods=["POST"]),
            Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
            Route("/v1/models", service.models, methods=["GET"]),
            Route("/v1/models/{model:path}", service.model, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: _routing_error},
        lifespan=service.lifespan,
    )
    app.state.service = service
    return app


async def _routing_error(request: Request, exc: Exception) -> Response:
    """No such route, or not with this method: said in JSON as every other refusal is (the API's error
    object under /v1/), not in Starlette's plain text."""
    assert isinstance(exc, HTTPException)
    path, status = request.url.path, exc.status_code
    kind = "not_found_error" if status == 404 else ""
    if status == 404:
        message = f"no route {request.method} {path}; see GET /health and GET /v1/models"
    elif status == 405:
        message = f"{path} does not take {request.method}; it takes {(exc.headers or {}).get('Allow', '')}"
    else:
        message = f"{request.method} {path}: {exc.detail}"
    return _error(message, status, path.startswith("/v1/"), kind=kind, headers=exc.headers)


class Service:
    """The endpoints' handlers around one model, its engine and the request slots."""

    def __init__(
        self,
        generator: Generator,
        limits: ServeLimits,
        defaults: SamplingParams | None,
        auth: bool,
        name: str | None = None,
    ) -> None:
        self.generator = generator
        self.limits = limits
        self.defaults = defaults or SamplingParams(max_new_tokens=min(64, limits.max_new_tokens))
        self.engine = Batcher(generator.decoder, limits.max_batch)
        self.slots = Slots(limits.max_concurrent)
        # The name the user gave (`--model` as typed) comes first; the checkpoint the model came from
        # (and the path written plainly) answer too, so that a client set up with either works.
        self.served = name or generator.loaded.name
        others = [str(PurePath(self.served)), generator.loaded.name]
        self.aliases = [a for a in dict.fromkeys(others) if a != self.served]
        self.created = now()
        self.auth = auth

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        try:
            # A second Ctrl-C: uvicorn leaves without the lifespan's shutdown, and the loop's end cancels
            # it here; the decoding thread is stopped all the same, and no traceback said for it.
            with contextlib.suppress(asyncio.CancelledError):
                yield
        finally:
            self.engine.close()  # the server has stopped: the decoding thread with it

    async def generate(self, request: Request, prompt_key: str, values: dict[str, Any]) -> JSONResponse:
        generator = self.generator
        try:
            query = prompt_key == "sentence"
            prompt, params = parse_request(values, prompt_key, self.limits, self.defaults, query=query)
            decode = DecodeRequest(fit_prompt(generator, generator.encode(prompt), params), params)
        except RequestError as exc:
            return _error(str(exc), 400, api=False)
        request.state.decodes = [decode]  # for the access log
        failed = await self.decode(request, [decode], api=False)
        if failed is not None:
            return failed
        completions = [Completion(s.text, len(s.ids), s.finish_reason or "length") for s in decode.samples]
        return JSONResponse(
            {
                "prompt": prompt,
                "generated": completions[0].text,
                "completions": [asdict(c) for c in completions],
                "settings": asdict(params),
            }
        )

    async def get_generate(self, request: Request) -> JSONResponse:
        try:
            # Starlette decodes the query leniently; undecodable bytes are refused as in a body.
            # Blank values kept: `sentence=` is an empty prompt (as in a body), `max_new_tokens=` a 400.
            query = parse_qsl(request.scope["query_string"].decode("latin-1"), keep_blank_values=True,
                              errors="strict")  # fmt: skip
        except UnicodeDecodeError:
            return _error("the query string holds bytes that are not UTF-8", 400, api=False)
        repeated = sorted(k for k, n in Counter(k for k, _ in query).items() if n > 1)
        if repeated:  # which one was meant is not ours to guess
            return _error(f"{', '.join(repeated)} given more than once in the query", 400, api=False)
        values = dict(query)
        if "prompt" in values:  # POST's name for it, typed in a query: taken, unless both are there
            if "sentence" in values:
                return _error("give the text as sentence or as prompt, not both", 400, api=False)
            values["sentence"] = values.pop("prompt")
        return await self.generate(request, "sentence", values)

    async def post_generate(self, request: Request) -> JSONResponse:
        body = await _read_body(request, self.limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        return await self.generate(request, "prompt", body)

    async def openai(self, request: Request, chat: bool) -> Response:
        body = await _read_body(request, self.limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return _as_api_error(body)
        generator = self.generator
        try:
            api = api_request(body, chat, self.served, self.limits, self.defaults, aliases=self.aliases)
            # Tokenizing a long conversation is the server's work per request: off the event loop, which
            # keeps answering the others meanwhile.
            if chat:
                decodes = await asyncio.to_thread(chat_decodes, generator, api, self.served)
            else:
                decodes = await asyncio.to_thread(completion_decodes, generator, api)
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        answer = ApiAnswer(new_id("chatcmpl" if chat else "cmpl"), self.served, chat, decodes)
        request.state.decodes = decodes  # for the access log
        if api.stream:
            if not self.slots.take():
                return self.slots.busy(api=True)
            # The stream gives the slot back however the response ends.
            return EventStream(
                _sse(answer, self.engine.stream(decodes), api.stream_usage), self.slots.release
            )
        failed = await self.decode(request, decodes, api=True)
        return failed or JSONResponse(answer.body())

    async def decode(self, request: Request, decodes: list[DecodeRequest], api: bool) -> JSONResponse | None:
        """Admit ``decodes`` (a slot, or busy) and decode them to their end, giving the slot back;
        the error answer when that did not go through (busy, client gone, generation failed)."""
        if not self.slots.take():
            return self.slots.busy(api)
        try:
            if not await _collect(request, self.engine.stream(decodes)):
                request.state.client_left = True
                return _error("client disconnected", CLIENT_LEFT, api)
        except GenerationFailed as exc:
            return _error(str(exc), 500, api)
        finally:
            self.slots.release()
        return None

    async def completions(self, request: Request) -> Response:
        return await self.openai(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.openai(request, chat=True)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse(models_body(self.served, self.created, self.aliases))

    async def model(self, request: Request) -> JSONResponse:
        wanted = request.path_params["model"]
        try:
            check_model({"model": wanted}, self.served, self.aliases)
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        entries = models_body(self.served, self.created, self.aliases)["data"]
        return JSONResponse(next(e for e in entries if e["id"] == wanted))

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.served,
                "aliases": self.aliases,
                "context": self.generator.context,
                "limits": asdict(self.limits),
                "running": self.slots.taken,
                "batch_rows": self.engine.rows(),
                "tokens_generated": self.generator.decoder.tokens_generated,
                "auth": self.auth,
            }
        )


class AccessLog:
    """One line per request once its answer is sent (a stream: at its end): the method, the path (not
    the query, which holds the prompt), the status, the tokens generated and the milliseconds taken.

    A request still running when the shutdown's grace ends is cancelled: it ends with a 503 (or, its
    answer begun, with the end of its body) and a line saying so, not a traceback."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = None
        events = False  # the answer is a stream of server-sent events

        async def sending(message: Any) -> None:
            nonlocal status, events
            if message["type"] == "http.response.start":
                status = message["status"]
                events = (b"content-type", b"text/event-stream") in [
                    (k.lower(), v.partition(b";")[0]) for k, v in message.get("headers", ())
                ]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            log.warning("%s %s cut off by the shutdown (its grace over, or a second Ctrl-C)", scope["method"],
                        _loggable(scope["path"]))  # fmt: skip
            with contextlib.suppress(Exception):
                if status is None:
                    api, closing = scope["path"].startswith("/v1/"), {"Connection": "close"}
                    answer = _error("the server is shutting down", 503, api, headers=closing)
                    await answer(scope, receive, sending)
                else:
                    # A stream says it was cut short (an error event, then its end), as a failed generation
                    # does, rather than stopping mid-answer with nothing said.
                    cut = RequestError("the server shut down before the answer was complete", status=503)
                    end = sse_event(cut.body()) + DONE if events else ""
                    await send({"type": "http.response.body", "body": end.encode(), "more_body": False})
        finally:
            state = scope.get("state", {})
            tokens = sum(len(sample.ids) for d in state.get("decodes") or [] for sample in d.samples)
            left = ", the client left first" if state.get("client_left") else ""
            # No answer started: the server failed it.
            path = _loggable(scope["path"])
            log.info("%s %s %d, %d tokens, %.0f ms%s", scope["method"], path, status or 500, tokens,
                     1000 * (time.monotonic() - started), left)  # fmt: skip


def _loggable(path: str) -> str:
    """The client's path as a log line can hold it: its control characters (a decoded ``%0a``, ``%1b``)
    escaped, so that no request writes a line of its own into the log or colours the terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in path)


class BearerAuth:
    """Every request but ``GET /health`` carries ``Authorization: Bearer <key>``, or gets 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            sent = [v for k, v in scope["headers"] if k == b"authorization"]
            # One header, never the last of several (which one a proxy checked is not ours to guess).
            scheme, _, given = (sent[0] if len(sent) == 1 else b"").partition(b" ")
            # The scheme's case is free (RFC 9110); the key is compared in constant time.
            matches = hmac.compare_digest(given.strip(), self.expected)
            if scheme.lower() != b"bearer" or not matches:
                error = RequestError(
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    status=401,
                    kind="invalid_request_error",
                )
                body = error.body()
                body["error"]["code"] = "invalid_api_key"
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _collect(request: Request, deltas: AsyncIterator[Any]) -> bool:
    """Read ``deltas`` to the end; False (and the generation cancelled) when the client leaves first."""

    async def drain() -> None:
        async for _ in deltas:
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return True
            if await request.is_disconnected():  # the access log says so; nobody is left to answer
                return False
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class EventStream(StreamingResponse):
    """A server-sent event stream that calls ``on_close`` however it ends: answered, the client
    gone (even before the first event), an error."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        self.ended = False
        super().__init__(self._to_the_end(events), media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def _to_the_end(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                yield event
        self.ended = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
            if not self.ended:  # the client went away mid-stream
                scope.setdefault("state", {})["client_left"] = True
        finally:
            self.on_close()


async def _sse(
    answer: ApiAnswer, deltas: AsyncGenerator[tuple[int, Delta]], with_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of an answer: its chunks as they come, then ``[DONE]``. Closed early (the
    client left), it closes ``deltas``, which cancels the generation."""
    async with contextlib.aclosing(deltas):
        try:
            async for i, delta in deltas:
                yield sse_event(answer.chunk(i, delta))
            if with_usage:
                yield sse_event(answer.usage_chunk())
        except GenerationFailed as exc:
            yield sse_event(RequestError(str(exc), status=500).body())
    yield DONE


def _as_api_error(response: JSONResponse) -> JSONResponse:
    """A body-reading refusal (413, 400) in the OpenAI error format."""
    message = json.loads(bytes(response.body))["error"]
    status = response.status_code
    return JSONResponse(RequestError(message, status=status).body(), status_code=status)


async def _read_body(request: Request, max_bytes: int) -> dict[str, Any] | JSONResponse:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return JSONResponse({"error": f"a body in Content-Encoding {encoding} is not read here; send JSON "
                                      "uncompressed"}, 415)  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:  # said before a byte of it is read (or 100-continue)
        return JSONResponse({"error": f"request body over {max_bytes} bytes (--max_body_bytes)"}, 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                return JSONResponse({"error": f"request body over {max_bytes} bytes (--max_body_bytes)"}, 413)
            chunks.append(chunk)
    except ClientDisconnect:
        if request.scope.get("state", {}).get(TIMED_OUT):  # closed by --read_timeout, and said so
            return JSONResponse({"error": "the request body was not sent in time"}, status_code=408)
        if request.scope.get("state", {}).get(MALFORMED):  # its framing broken, and said so
            return JSONResponse({"error": "the request body is not valid HTTP/1.1"}, status_code=400)
        # Nobody is left to answer; the other requests go on.
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.warning("%s disconnected after %d bytes of its request body; request dropped", peer, size)
        return JSONResponse({"error": "client disconnected"}, status_code=CLIENT_LEFT)
    try:
        # JSON between systems is UTF-8 (RFC 8259): no guessing of UTF-16 from the first bytes.
        body = json.loads(b"".join(chunks).decode("utf-8-sig") or "null", object_pairs_hook=_one_of_each)
    except UnicodeDecodeError:
        return JSONResponse({"error": "the body is not UTF-8 text"}, status_code=400)
    except json.JSONDecodeError as exc:
        return JSONResponse({"error": f"the body is not valid JSON ({exc})"}, status_code=400)
    except RecursionError:
        return JSONResponse({"error": "the body's JSON is nested too deeply"}, status_code=400)
    except RequestError as exc:  # a key given twice
        return JSONResponse({"error": str(exc)}, status_code=400)
    except ValueError:  # an integer past Python's limit on the digits it converts
        digits = sys.get_int_max_str_digits()
        return JSONResponse({"error": f"the body's JSON holds a number of over {digits} digits"}, 400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    return body


def _one_of_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once: which of two values was meant is not ours to guess."""
    body = dict(pairs)
    if len(body) < len(pairs):
        repeated = sorted(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        keys = ", ".join(map(repr, repeated))
        raise RequestError(f"the body's JSON has {keys} more than once in one object")
    return body


def serve(
    app: Starlette,
    host: str,
    port: int,
    *,
    authenticated: bool = False,
    grace: int = 30,
    read_timeout: float = 30,
) -> None:
    """Serve ``app`` until interrupted (Ctrl-C or SIGTERM: the requests in flight get ``grace``
    seconds to finish, then are cut off), and return; a request not sent whole within ``read_timeout``
    seconds of its start is answered 408 (:mod:`dsgpt2.infer.connections`)."""
    import uvicorn

    check_bind(host, port)
    if host not in ("127.0.0.1", "localhost", "::1") and not authenticated:
        log.warning(
            "serving on %s: reachable from other machines, with no authentication (set --api_key or "
            "$DSGPT2_API_KEY)",
            host,
        )
    with _sigterm_returns():
        uvicorn.run(
            app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=grace,
            http=deadlined(read_timeout, app.state.service.limits.max_head_bytes),
        )  # fmt: skip


@contextlib.contextmanager
def _sigterm_returns() -> Iterator[None]:
    """uvicorn shuts down on SIGTERM, then raises it again for the handler it found: this one, so
    that the command ends as after Ctrl-C (exit 0) where the default handler would kill it (143)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: log.info("stopped by SIGTERM"))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
