"""``dsgpt2 serve``: generation over HTTP (Starlette app, served by uvicorn).

Endpoints:
- ``GET /generate?sentence=...`` (the original toolkit's) with optional
  sampling settings as query parameters;
- ``POST /generate`` with a JSON body ``{"prompt": ..., "max_new_tokens": ...}``;
- ``GET /health``: the model and the limits;
- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``: the OpenAI API
  (:mod:`dsgpt2.infer.openai_api`).

Limits guard the process: prompt length, ``max_new_tokens`` and the number of
generations running at once (more get 503 at once rather than queueing).
A bad request gets 400 with the reason; an error inside one request is
answered with 500 and the server goes on.
"""

from __future__ import annotations

import errno
import logging
import threading
from dataclasses import asdict
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from dsgpt2.corpus.documents import text_problem
from dsgpt2.errors import ConfigError, DsGpt2Error
from dsgpt2.infer.generate import Generator, SamplingParams
from dsgpt2.infer.openai_api import (
    ApiError,
    ApiRequest,
    chat_request,
    completion_request,
    cut_at_stop,
    models_body,
    new_id,
    now,
    usage,
)
from dsgpt2.infer.settings import ServeLimits

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """A request the server refuses with 400."""


def parse_request(
    values: dict[str, Any], prompt_key: str, limits: ServeLimits, defaults: SamplingParams
) -> tuple[str, SamplingParams]:
    """The prompt and sampling settings of a request.

    Raises:
        BadRequest: a missing or oversized prompt, an unknown setting, a bad value, or more
            tokens than the server allows.
    """
    values = dict(values)
    prompt = values.pop(prompt_key, None)
    if not isinstance(prompt, str):
        raise BadRequest(f"{prompt_key!r} is required and must be a string")
    if prompt and text_problem(prompt, limits.max_prompt_chars) == "invalid_unicode":
        raise BadRequest(f"{prompt_key!r} holds invalid text (a lone surrogate or undecodable bytes)")
    if len(prompt) > limits.max_prompt_chars:
        raise BadRequest(
            f"{prompt_key!r} is {len(prompt)} characters long; this server accepts at most "
            f"{limits.max_prompt_chars}"
        )
    try:
        params = SamplingParams.from_mapping(values, defaults)
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    if params.max_new_tokens > limits.max_new_tokens:
        raise BadRequest(
            f"max_new_tokens {params.max_new_tokens} is more than this server allows "
            f"({limits.max_new_tokens})"
        )
    return prompt, params


def make_app(generator: Generator, limits: ServeLimits, defaults: SamplingParams | None = None) -> Starlette:
    """The HTTP application around ``generator``."""
    defaults = defaults or SamplingParams(max_new_tokens=min(64, limits.max_new_tokens))
    running = 0
    count_lock = threading.Lock()
    # One generation at a time per model: the threads would only fight over the same cores,
    # and the model is not meant to run concurrent forward passes from several threads.
    model_lock = threading.Lock()

    def _generate(prompt: str, params: SamplingParams) -> list[Any]:
        with model_lock:
            return generator.generate(prompt, params)

    async def generate(request: Request, prompt_key: str, values: dict[str, Any]) -> JSONResponse:
        nonlocal running
        try:
            prompt, params = parse_request(values, prompt_key, limits, defaults)
        except BadRequest as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        with count_lock:
            if running >= limits.max_concurrent:
                return JSONResponse(
                    {"error": f"busy: {limits.max_concurrent} generations already running; retry later"},
                    status_code=503,
                    headers={"Retry-After": "1"},
                )
            running += 1
        try:
            completions = await run_in_threadpool(_generate, prompt, params)
        except DsGpt2Error as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except Exception:
            log.exception("generation failed for a request")
            return JSONResponse({"error": "generation failed; see the server log"}, status_code=500)
        finally:
            with count_lock:
                running -= 1
        return JSONResponse(
            {
                "prompt": prompt,
                "generated": completions[0].text,
                "completions": [asdict(c) for c in completions],
                "settings": asdict(params),
            }
        )

    served = generator.loaded.name
    created = now()

    async def openai(request: Request, chat: bool) -> JSONResponse:
        nonlocal running
        body = await _read_body(request, limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return _as_api_error(body)
        try:
            make = chat_request if chat else completion_request
            req = make(body, served, limits, defaults)
            if req.stream:
                raise ApiError("stream is not supported yet; leave it false", "stream")
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        with count_lock:
            if running >= limits.max_concurrent:
                busy = ApiError(
                    f"busy: {limits.max_concurrent} generations already running; retry later",
                    status=503,
                    kind="server_busy",
                )
                return JSONResponse(busy.body(), status_code=503, headers={"Retry-After": "1"})
            running += 1
        try:
            answer = await run_in_threadpool(_answer_chat if chat else _answer_completion, req)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception:
            log.exception("generation failed for a request")
            failed = ApiError("generation failed; see the server log", status=500)
            return JSONResponse(failed.body(), status_code=500)
        finally:
            with count_lock:
                running -= 1
        return JSONResponse(answer)

    def _choices(prompt_ids: list[int], req: ApiRequest, stop_ids: list[int], index: int) -> list[dict]:
        with model_lock:
            completions = generator.generate_ids(prompt_ids, req.params, stop_ids=stop_ids)
        out = []
        for i, c in enumerate(completions):
            text, cut = cut_at_stop(c.text, req.stop)
            tokens = len(generator.encode(text)) if cut else c.tokens
            out.append(
                {
                    "index": index + i,
                    "text": text,
                    "tokens": tokens,
                    "finish_reason": "stop" if cut else c.finish_reason,
                }
            )
        return out

    def _fit(ids: list[int], req: ApiRequest) -> list[int]:
        if req.params.max_new_tokens >= generator.context:
            raise ApiError(
                f"max_tokens {req.params.max_new_tokens} does not fit the model's context of "
                f"{generator.context} tokens",
                "max_tokens",
            )
        return ids[-(generator.context - req.params.max_new_tokens) :] or [generator.eot]

    def _answer_completion(req: ApiRequest) -> dict[str, Any]:
        choices, prompt_tokens = [], 0
        for prompt in req.prompts:
            ids = _fit(generator.encode(prompt), req)
            prompt_tokens += len(ids)
            choices += _choices(ids, req, [], len(choices))
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": served,
            "choices": [
                {
                    "index": c["index"],
                    "text": c["text"],
                    "logprobs": None,
                    "finish_reason": c["finish_reason"],
                }
                for c in choices
            ],
            "usage": usage(prompt_tokens, sum(c["tokens"] for c in choices)),
        }

    def _answer_chat(req: ApiRequest) -> dict[str, Any]:
        from dsgpt2.infer.chat import ChatSession

        try:
            session = ChatSession(generator, req.params)
        except ConfigError:
            raise ApiError(
                f"{served} has no <|user|> and <|bot|> speaker tokens: it was not finetuned on "
                "conversations; use /v1/completions",
                "messages",
            ) from None
        ids = _fit(session.prompt(req.turns), req)
        choices = _choices(ids, req, list(session.speakers.values()), 0)
        return {
            "id": new_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": served,
            "choices": [
                {
                    "index": c["index"],
                    "finish_reason": c["finish_reason"],
                    "logprobs": None,
                    "message": {"role": "assistant", "content": c["text"].strip()},
                }
                for c in choices
            ],
            "usage": usage(len(ids), sum(c["tokens"] for c in choices)),
        }

    async def completions(request: Request) -> JSONResponse:
        return await openai(request, chat=False)

    async def chat_completions(request: Request) -> JSONResponse:
        return await openai(request, chat=True)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse(models_body(served, created))

    async def get_generate(request: Request) -> JSONResponse:
        return await generate(request, "sentence", dict(request.query_params))

    async def post_generate(request: Request) -> JSONResponse:
        body = await _read_body(request, limits.max_body_bytes)
        if isinstance(body, JSONResponse):
            return body
        return await generate(request, "prompt", body)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "model": generator.loaded.name,
                "context": generator.context,
                "limits": asdict(limits),
                "running": running,
            }
        )

    return Starlette(
        routes=[
            Route("/generate", get_generate, methods=["GET"]),
            Route("/generate", post_generate, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def _as_api_error(response: JSONResponse) -> JSONResponse:
    """A body-reading refusal (413, 400) in the OpenAI error format."""
    import json

    message = json.loads(bytes(response.body))["error"]
    status = response.status_code
    return JSONResponse(ApiError(message, status=status).body(), status_code=status)


async def _read_body(request: Request, max_bytes: int) -> dict[str, Any] | JSONResponse:
    import json

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                return JSONResponse({"error": f"request body over {max_bytes} bytes"}, status_code=413)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to answer; the other requests go on.
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.warning("%s disconnected after %d bytes of its request body; request dropped", peer, size)
        return JSONResponse({"error": "client disconnected"}, status_code=400)
    try:
        body = json.loads(b"".join(chunks) or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
    return body


def serve(app: Starlette, host: str, port: int) -> None:
    """Serve ``app`` until interrupted (Ctrl-C or SIGTERM)."""
    import uvicorn

    check_bind(host, port)
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s: reachable from other machines, with no authentication", host)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)


def check_bind(host: str, port: int) -> None:
    """Fail with one line where uvicorn could not listen (a busy port, an address not of this host).

    Raises:
        ConfigError: the address cannot be bound, naming it and the fix.
    """
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # As uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT is free, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"--port {port} on {host} is in use by another program; choose another --port"
                ) from None
            raise ConfigError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror}); use an address of "
                "this machine (127.0.0.1 by default) and a port above 1023"
            ) from None
