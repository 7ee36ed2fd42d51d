"""The HTTP connections of ``dsgpt2 serve``: uvicorn's h11 protocol with a deadline on reading a request.

uvicorn closes a connection idle between two requests (its keep-alive timeout), but waits for ever on one
that opened and sent nothing, or sends its head or body a byte at a time: each holds a socket (and the
body's request, a handler) until the process runs out of them, whatever the API key, which is only read
once the head is whole. Here a request must be read whole (head and body) within ``read_timeout`` seconds
of its first byte (of the connection, for the first one); a client that has not is answered 408 when its
head was not whole (nothing, when it had sent nothing) and its connection closed. A body cut off this way
ends its request as a client gone mid-body does, in one log line. The time a request then takes to be
answered (decoding) is not bounded here: that is the request's own business.
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsgpt2.errors import RequestError

log = logging.getLogger(__name__)

# The states of the client's side in which its request is still being read.
READING = (h11.IDLE, h11.SEND_BODY)
# A request's state key: its body was cut off by the deadline (not by its client leaving).
TIMED_OUT = "read_timed_out"


def deadlined(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, each request to be read whole within ``read_timeout`` seconds."""
    return type("DeadlinedH11Protocol", (DeadlinedH11Protocol,), {"read_timeout": read_timeout})


class DeadlinedH11Protocol(H11Protocol):
    read_timeout: float = 30.0

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
        started = self.conn.their_state is h11.SEND_BODY or bool(self.conn.trailing_data[0])
        if self.conn.their_state is h11.IDLE and started:
            self.transport.write(_timed_out(self.read_timeout))
        elif self.conn.their_state is h11.SEND_BODY:  # its handler, reading the body, says 408 too
            self.scope.setdefault("state", {})[TIMED_OUT] = True
        if started:
            log.warning("%s sent no whole request in %g s; connection closed (408)", peer, self.read_timeout)
        self.transport.close()


def _timed_out(seconds: float) -> bytes:
    """A 408 in OpenAI's error format (the path, in the head not read whole, is unknown)."""
    message = f"the request was not sent whole within {seconds:g} s of its start"
    body = json.dumps(RequestError(message, status=408).body()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
