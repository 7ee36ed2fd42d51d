"""The serving engine: one thread decodes every request in flight as one batch.

HTTP handlers submit :class:`~dsgpt2.infer.decode.DecodeRequest` objects and read their text as it
comes, through an asyncio queue fed from the engine's thread. Between two decoding steps the
engine admits waiting requests while their rows fit ``max_batch`` (a request is admitted alone
when the batch is empty, however many samples it asks for), so N concurrent clients share the
forward passes instead of taking turns. A request whose client is gone is cancelled and leaves the
batch at the next step. An error while decoding fails the requests in the batch (their clients get
500) and the engine goes on with the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence

from dsgpt2.errors import GenerationFailed
from dsgpt2.infer.decode import Decoder, DecodeRequest, Delta

log = logging.getLogger(__name__)


class Batcher:
    """Decodes submitted requests in batches, in a daemon thread."""

    def __init__(self, decoder: Decoder, max_batch: int) -> None:
        self.decoder = decoder
        self.max_batch = max_batch
        self._waiting: deque[DecodeRequest] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread()
        self.start()

    def start(self) -> None:
        """Decode in a thread of its own, unless one runs (an app served again after a close)."""
        if self._thread.is_alive():
            return
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dsgpt2-decode", daemon=True)
        self._thread.start()

    def submit(self, request: DecodeRequest) -> None:
        with self._wake:
            self._waiting.append(request)
            self._wake.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Stop decoding once the step under way ends (the server is stopping; the requests still in
        flight were cut off), and wait for it: an interpreter ending under a thread inside torch aborts."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def rows(self) -> int:
        """Rows decoding now."""
        return len(self.decoder)

    def _admit(self) -> list[DecodeRequest]:
        """Waiting requests whose rows fit next to the running ones (blocks while idle)."""
        with self._wake:
            while not self._waiting and not len(self.decoder) and not self._closed:
                self._wake.wait()
            if self._closed:
                return []
            batch: list[DecodeRequest] = []
            rows = len(self.decoder)
            while self._waiting:
                request = self._waiting[0]
                if request.cancelled.is_set():
                    self._waiting.popleft()
                    continue
                n = request.params.num_samples
                if rows and rows + n > self.max_batch:
                    break
                batch.append(self._waiting.popleft())
                rows += n
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._admit()
            if self._closed:
                return
            try:
                self.decoder.add(batch)
                self.decoder.step()
            except Exception:
                log.exception("decoding failed; failing the requests of this batch")
                for request in {*self.decoder.fail_all(), *batch}:
                    if request.on_delta:
                        request.on_delta(Delta(-1, "", "error"))

    async def stream(self, requests: Sequence[DecodeRequest]) -> AsyncGenerator[tuple[int, Delta]]:
        """Submit ``requests``; yield (request number, delta) until all their samples finish.

        Leaving early (the client went away, an exception) cancels what is still decoding.

        Raises:
            GenerationFailed: decoding failed in the engine.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        for i, request in enumerate(requests):
            request.on_delta = _deliver(loop, queue, i, request)
        remaining = sum(r.params.num_samples for r in requests)
        try:
            for request in requests:
                self.submit(request)
            while remaining:
                i, delta = await queue.get()
                if delta.finish_reason == "error":
                    raise GenerationFailed("decoding failed; see the server log")
                if delta.finish_reason:
                    remaining -= 1
                yield i, delta
        finally:
            if remaining:
                for request in requests:
                    request.cancelled.set()


def _deliver(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Delta]], i: int, request: DecodeRequest
) -> Callable[[Delta], None]:
    """What the engine's thread calls with each of request ``i``'s deltas: handed to its reader's event
    loop; that loop closed (the server stopped with the request still decoding), the request is
    cancelled, there being nobody left to read it."""

    def deliver(delta: Delta) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (i, delta))
        except RuntimeError:
            request.cancelled.set()

    return deliver
