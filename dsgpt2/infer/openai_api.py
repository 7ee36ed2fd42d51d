"""The OpenAI API's request and response shapes, for the fields that apply to this toolkit's models.

``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` take and answer what
the official ``openai`` client sends and expects: ``model``, ``prompt``/``messages``, ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``; ``choices`` with ``finish_reason`` and
``usage``. Errors use its error object. A field the API defines but this server does not honour
(``logprobs``, penalties, tools, ...) is named in a 400 unless it holds the API's default, so that
a client never silently gets something other than what it asked for; an unknown field is a 400 too.

Chat turns are formatted as in conversation finetuning: ``user`` and ``assistant`` messages become
turns of the ``<|user|>`` and ``<|bot|>`` speakers; a ``system`` message is put before the first user
message's text. A model whose tokenizer has no such speaker tokens (a pretrained model) answers chat
requests with a 400 that points at ``/v1/completions``.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from dsgpt2.documents import text_problem, utf8_encodable
from dsgpt2.errors import ConfigError, RequestError
from dsgpt2.infer.decode import DecodeRequest, Delta
from dsgpt2.infer.settings import SamplingParams, ServeLimits, as_json

if TYPE_CHECKING:
    from dsgpt2.infer.generate import Generator

# OpenAI's defaults for the sampling fields it shares with SamplingParams.
DEFAULT_MAX_TOKENS = 16  # the completions API's; a chat reply defaults to the server's length
MAX_STOP = 4
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "user",
}
# Fields of the API this server accepts only at their default (no effect) value.
AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "service_level": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "max_completion_tokens": (None,),
}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
ROLES = {"user": "user", "assistant": "bot"}


@dataclass
class ApiRequest:
    """A checked request: what to generate from, how, and how to answer."""

    prompts: list[str]  # completions: the texts; chat: empty
    turns: list[dict[str, str]]  # chat: the conversation; completions: empty
    params: SamplingParams
    stop: list[str]
    stream: bool
    stream_usage: bool  # stream_options.include_usage: a last chunk with the usage
    system: str = ""  # chat: the system (and developer) messages' text, kept whatever turns are dropped


def check_keys(body: dict[str, Any], allowed: set[str]) -> None:
    """Unknown fields, and supported-in-name-only fields away from their default, are a 400."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in AT_DEFAULT:
            # Of the default's type too: completions' logprobs 0 asks for the sampled tokens' (0 == False).
            if not any(value == d and type(value) is type(d) for d in AT_DEFAULT[key]):
                if key == "max_completion_tokens":  # a chat field, sent to /v1/completions
                    raise RequestError(f"{key} is the chat API's name; /v1/completions takes max_tokens", key)
                raise RequestError(f"{key} is not supported by this server (only its default)", key)
            continue
        raise RequestError(f"unknown field {key!r}; this server reads {', '.join(sorted(allowed))}", key)


def check_model(body: dict[str, Any], served: str, aliases: Sequence[str] = ()) -> None:
    """A request may name the served model or one of its aliases (or none)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", "model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, got {user!r}", "user")
    if model is not None and model != served and model not in aliases:
        also = f" (also as {', '.join(repr(a) for a in aliases)})" if aliases else ""
        raise RequestError(
            f"the model {model!r} does not exist; this server serves {served!r}{also}",
            "model",
            404,
            "not_found_error",
        )


def sampling(
    body: dict[str, Any], limits: ServeLimits, defaults: SamplingParams, max_tokens: int, prompts: int
) -> SamplingParams:
    """The sampling settings of an OpenAI request of ``prompts`` prompts (its defaults where it names
    none; ``max_tokens`` where it sets no length)."""
    values: dict[str, Any] = {}
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    names = {
        "max_tokens": "max_new_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "n": "num_samples",
        "seed": "seed",
    }
    given = {k: body[k] for k in names if body.get(k) is not None}
    if asked is not None:
        given["max_tokens"] = asked
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"{key} must be a number, got {as_json(value)}", key)
        values[names[key]] = value
    values.setdefault("max_new_tokens", max_tokens)
    values.setdefault("temperature", 1.0)
    values.setdefault("top_p", 1.0)
    # Without a seed, as the API does: a fresh draw each request.
    values.setdefault("seed", secrets.randbelow(2**63))
    # top_k is not an OpenAI field: sampling is over the whole vocabulary, as the API's is.
    values["top_k"] = 0
    try:
        params = SamplingParams.from_mapping(values, replace(defaults, repetition_penalty=1.0))
        limits.check_length(params.max_new_tokens, "max_tokens")
    except ConfigError as exc:
        message = str(exc)
        for api, ours in names.items():
            message = message.replace(ours, api)
        raise RequestError(message, _param_of(message, names)) from None
    try:
        limits.check_sequences(prompts, params.num_samples, "n")
    except ConfigError as exc:
        raise RequestError(str(exc), "n" if prompts == 1 else "prompt") from None
    return params


def _param_of(message: str, names: dict[str, str]) -> str | None:
    return next((api for api in names if message.startswith(api)), None)


def stop_sequences(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if not all(utf8_encodable(s) for s in stops):
        raise RequestError("stop holds invalid text (a lone surrogate)", "stop")
    return stops


def api_request(
    body: dict[str, Any],
    chat: bool,
    served: str,
    limits: ServeLimits,
    defaults: SamplingParams,
    *,
    aliases: Sequence[str] = (),
) -> ApiRequest:
    """The request of ``body`` to /v1/chat/completions (``chat``) or /v1/completions, checked: its
    fields, its model (``served`` or one of ``aliases``), its text within ``limits``, its sampling
    with the server's ``defaults`` where it sets none.

    Raises:
        RequestError: the first thing wrong with it (an HTTP 400 naming the parameter).
    """
    check_keys(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    check_model(body, served, aliases)
    return (_chat if chat else _completion)(body, limits, defaults)


def _completion(body: dict[str, Any], limits: ServeLimits, defaults: SamplingParams) -> ApiRequest:
    prompt = body.get("prompt", "")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompt must be a string or a non-empty list of strings", "prompt")
    for p in prompts:
        _check_text(p, limits, "prompt")
    params = sampling(body, limits, defaults, DEFAULT_MAX_TOKENS, len(prompts))
    return ApiRequest(prompts, [], params, stop_sequences(body), *_stream(body))


def _chat(body: dict[str, Any], limits: ServeLimits, defaults: SamplingParams) -> ApiRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if isinstance(content, list):  # content parts: only text applies
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            if not all(isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content: a text part needs a string text", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}] needs a role and a string content", "messages")
        _check_text(content, limits, "messages")
        if not isinstance(role, str):
            raise RequestError(f"messages[{i}].role must be a string, got {role!r}", "messages")
        if role in ("system", "developer"):
            system.append(content)
        elif role in ROLES:
            turns.append({"speaker": ROLES[role], "text": content})
        else:
            raise RequestError(
                f"messages[{i}].role {role!r} is not supported; use system, user or assistant", "messages"
            )
    if not turns or turns[-1]["speaker"] != "user":
        raise RequestError("the last message must be the user's", "messages")
    params = sampling(body, limits, defaults, defaults.max_new_tokens, 1)
    return ApiRequest([], turns, params, stop_sequences(body), *_stream(body), "\n\n".join(system))


def _check_text(text: str, limits: ServeLimits, param: str) -> None:
    if text and text_problem(text, limits.max_prompt_chars) == "invalid_unicode":
        raise RequestError(f"{param} holds invalid text (a lone surrogate or undecodable bytes)", param)
    if len(text) > limits.max_prompt_chars:
        raise RequestError(
            f"{param} holds {len(text)} characters; this server accepts at most {limits.max_prompt_chars}",
            param,
        )


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether to stream, and whether to end the stream with the usage."""
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise RequestError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError('stream_options takes {"include_usage": true|false} only', "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("stream_options.include_usage must be true or false", "stream_options")
    return True, include


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def models_body(served: str, created: int, aliases: Sequence[str] = ()) -> dict[str, Any]:
    """The served model first (clients take the first entry), then one entry per alias."""
    head = {"object": "model", "created": created, "owned_by": "dsgpt2"}
    return {
        "object": "list",
        "data": [
            {"id": served, **head, "aliases": list(aliases)},
            *({"id": a, **head, "alias_of": served} for a in aliases),
        ],
    }


# What Python's str.splitlines ends a line at beside CR and LF, that JSON leaves as they are: a reader
# of server-sent events that splits lines so (httpx's iter_lines, and the clients built on it) would cut
# an event holding one in two, and read neither.
_LINE_BREAKS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse_event(data: dict[str, Any]) -> str:
    """One server-sent event of ``data`` as JSON, on one line for every reader of them: the characters a
    line splitter may take for a line's end (in the text generated, the model's name) escaped."""
    line = json.dumps(data, ensure_ascii=False)
    for char, escaped in _LINE_BREAKS.items():
        line = line.replace(char, escaped)
    return f"data: {line}\n\n"


def now() -> int:
    return int(time.time())


class ApiAnswer:
    """The answer to one API request, whole or as stream chunks, from its decoded requests."""

    def __init__(self, answer_id: str, model: str, chat: bool, decodes: list[DecodeRequest]) -> None:
        self.id = answer_id
        self.model = model
        self.chat = chat
        self.decodes = decodes
        self.created = now()
        self._started: set[int] = set()  # choices whose first chunk went out (chat: with the role)

    def _index(self, request: int, sample: int) -> int:
        return request * self.decodes[0].params.num_samples + sample

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, int]:
        prompt = sum(d.prompt_tokens for d in self.decodes)
        completion = sum(len(s.ids) for d in self.decodes for s in d.samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def body(self) -> dict[str, Any]:
        """The whole answer (``stream: false``)."""
        choices = []
        for r, decode in enumerate(self.decodes):
            for s in decode.samples:
                choice: dict[str, Any] = {"index": self._index(r, s.index)}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": s.text}
                else:
                    choice["text"] = s.text
                choices.append({**choice, "logprobs": None, "finish_reason": s.finish_reason or "length"})
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": choices, "usage": self.usage()}

    def chunk(self, request: int, delta: Delta) -> dict[str, Any]:
        """One stream chunk: new text of one choice (its finish reason on the last)."""
        index = self._index(request, delta.sample)
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            first = index not in self._started
            piece = {"content": delta.text} if delta.text or first else {}
            choice["delta"] = {"role": "assistant", **piece} if first else piece
        else:
            choice["text"] = delta.text
        self._started.add(index)
        choice.update(logprobs=None, finish_reason=delta.finish_reason)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk under ``stream_options.include_usage``: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage()}


def fit_prompt(
    generator: Generator, ids: list[int], params: SamplingParams, length: str = "max_new_tokens"
) -> list[int]:
    """The tokens a request decodes from (the prompt's last ones, leaving room for the tokens asked):
    every route's one check of a request against the model's context.

    Raises:
        RequestError: the length asked (``length``: as the request spells it) leaves no room.
    """
    try:
        return generator.decoder.fit(ids, params)
    except ConfigError:
        raise RequestError(
            f"{length} {params.max_new_tokens} does not fit the model's context of {generator.context} "
            f"tokens; ask for fewer than {generator.context}",
            length,
        ) from None


def completion_decodes(generator: Generator, api: ApiRequest) -> list[DecodeRequest]:
    """A completion request's decodes: one per prompt, each fitted to the context."""
    fitted = [fit_prompt(generator, generator.encode(p), api.params, "max_tokens") for p in api.prompts]
    return [DecodeRequest(ids, api.params, stop_texts=api.stop) for ids in fitted]


def chat_decodes(generator: Generator, api: ApiRequest, served: str) -> list[DecodeRequest]:
    """A chat request's decode: the conversation formatted as in finetuning, fitted to the context.

    Raises:
        RequestError: the model was not finetuned on conversations (served as ``served``).
    """
    from dsgpt2.infer.chat import ChatSession

    try:
        session = ChatSession(generator, api.params)
    except ConfigError:
        task = generator.loaded.run.get("task")
        why = (
            f"was trained on text (task {task}), not finetuned on conversations"
            if task not in (None, "conversation")
            else "has no <|user|> and <|bot|> speaker tokens: it was not finetuned on conversations"
        )
        raise RequestError(f"{served} {why}; use /v1/completions", "messages") from None
    fit_prompt(generator, [], api.params, "max_tokens")  # max_tokens leaves room: checked first
    try:
        ids = fit_prompt(generator, session.prompt(api.turns, api.system), api.params, "max_tokens")
    except ConfigError as exc:  # the system text alone fills the context
        raise RequestError(str(exc), "messages") from None
    stop_ids = list(session.speakers.values())
    return [DecodeRequest(ids, api.params, stop_ids, api.stop, strip=True)]
