"""The HTTP connections of ``dsgpt2 serve``: uvicorn's h11 protocol with a deadline on reading a request.

uvicorn closes a connection idle between two requests (its keep-alive timeout), but waits for ever on one
that opened and sent nothing, or sends its head or body a byte at a time: each holds a socket (and the
body's request, a handler) until the process runs out of them, whatever the API key, which is only read
once the head is whole. Here a request must be read whole (head and body) within ``read_timeout`` seconds
of its first byte (of the connection, for the first one); a client that has not is answered 408 (nothing,
when it had sent nothing) and its connection closed; a body cut off this way is logged as the request's
408, once. The time a request then takes to be answered (decoding) is not bounded here: that is the
request's own business.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsgpt2.errors import RequestError

log = logging.getLogger(__name__)

# What a browser sends as a page's Origin: scheme://host[:port], no path.
_ORIGIN = re.compile(r"https?://[^/\s?#]+")
# A request target in absolute form: its scheme and authority, before its path.
_ABSOLUTE = re.compile(r"https?://[^/]*", re.IGNORECASE)


class AbsoluteForm:
    """A request whose target is in absolute form (``GET http://host:port/path``, as a client sends it to
    a proxy; an HTTP/1.1 server must take it, RFC 9112 3.2.2) routed by its path, as the origin form."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (found := _ABSOLUTE.match(scope["path"])):
            path = scope["path"][found.end() :] or "/"
            raw = scope.get("raw_path") or b""
            raw = raw[len(found.group()) :] if raw.lower().startswith(found.group().lower().encode()) else raw
            scope = {**scope, "path": path, "raw_path": raw or b"/"}
        await self.app(scope, receive, send)


def origin_problem(origin: str) -> str | None:
    """Why ``origin`` (an ``--allow_origin``) is not one a browser sends; None where it is, or ``*``."""
    if origin == "*" or _ORIGIN.fullmatch(origin):
        return None
    return f"{origin!r} is not an origin: give scheme://host[:port] as a browser sends it (no path), or *"


def cross_origin(origins: Sequence[str]) -> list[Any]:
    """The middleware that lets pages of ``origins`` call the server from a browser (CORS: the preflight
    answered before authentication, which it never carries); none for no origin."""
    if not origins:
        return []
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            # Any header the page's client sends: the openai JavaScript client adds its X-Stainless-*
            # ones, and a preflight that named one not listed was refused, the page's call with it.
            allow_headers=["*"],
            max_age=600,
        )
    ]


# The states of the client's side in which its request is still being read.
READING = (h11.IDLE, h11.SEND_BODY)
# A request's state key: its body was cut off by the deadline (not by its client leaving).
TIMED_OUT = "read_timed_out"
# A request's state key: its body was not valid HTTP framing (a bad chunk), and answered 400.
MALFORMED = "malformed_body"


def deadlined(read_timeout: float, max_head_bytes: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol, each request to be read whole within ``read_timeout`` seconds, its line and
    headers in at most ``max_head_bytes``."""
    attributes = {"read_timeout": read_timeout, "max_head_bytes": max_head_bytes}
    return type("DeadlinedH11Protocol", (DeadlinedH11Protocol,), attributes)


class DeadlinedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    max_head_bytes: int = 16 * 1024  # h11's own

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # h11 bounds what it buffers of a head not yet whole (16 KiB by default): a long prompt in a GET's
        # query, arriving in network-sized pieces, went past it where the same bytes read at once did not.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.max_head_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Armed while a request is being read; not between requests (the keep-alive timeout's) nor while
        one is being answered."""
        reading = self.conn.their_state in READING and not self.transport.is_closing()
        if not reading or self.timeout_keep_alive_task is not None or self._answering():
            self._disarm()
        elif self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout, self._too_slow)

    def _answering(self) -> bool:
        """Whether the request's answer has begun and not ended (its handler need not read the body)."""
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.flow.read_paused:  # paused: the server is not reading it
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        if self.conn.their_state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_started:
            self.transport.close()  # answered already (401, 413) and the body still coming: no 408 to say
            return
        in_body = self.conn.their_state is h11.SEND_BODY
        started = in_body or bool(self.conn.trailing_data[0])
        if started:
            message = f"the request was not sent whole within {self.read_timeout:g} s of its start"
            self.transport.write(_refusal(408, message, self._api(in_body)))
        if in_body:  # its handler, reading the body, logs the 408 (its own answer goes nowhere)
            self.scope.setdefault("state", {})[TIMED_OUT] = True
        if started:
            log.warning("%s sent no whole request in %g s; connection closed (408)", peer, self.read_timeout)
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request that is not HTTP/1.1 (its head, its chunked body, its Content-Length): a 400 in JSON
        as every other error here (uvicorn's is plain text), its connection closed; a head longer than
        h11 buffers, a 431 that says so."""
        in_body = self.cycle is not None and not self.cycle.response_complete
        if in_body:  # its handler, reading the body, logs the 400
            self.scope.setdefault("state", {})[MALFORMED] = True
        if len(self.conn.trailing_data[0]) > self.max_head_bytes:
            message = (f"the request line and headers are over {self.max_head_bytes:,} bytes; send a long "
                       "prompt in a POST body")  # fmt: skip
            self.transport.write(_refusal(431, message, self._api(in_body)))
        elif not (in_body and self.cycle.response_started):
            message = "the request is not valid HTTP/1.1 (its request line, headers or body framing)"
            self.transport.write(_refusal(400, message, self._api(in_body)))
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        """A request to upgrade the connection (a WebSocket) is answered as plain HTTP: the client's
        business, not advice to the operator to install a WebSocket library."""

    def _api(self, path_known: bool) -> bool:
        """Whether an error goes in OpenAI's format: on its routes, and where the path is not known."""
        return not path_known or self.scope["path"].startswith("/v1/")


def _refusal(status: int, message: str, api: bool) -> bytes:
    """An error answer written straight to the connection, closing it: in OpenAI's format (``api``), or
    /generate's."""
    body = json.dumps(RequestError(message, status=status).body() if api else {"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
