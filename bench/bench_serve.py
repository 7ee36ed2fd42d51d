"""Serving benchmark: 8 concurrent clients against ``dsgpt2 serve``, batched vs one at a time.

Two servers of the same exported model run side by side in this invocation: one batching
concurrent requests (``--max_batch 8``), one decoding a request at a time (``--max_batch 1``, the
others wait their turn). Each of 8 client threads sends its requests one after another
(``/v1/completions``, 64 tokens, sampled with a seed of its own) over HTTP; the lines give
requests/s and the p50/p99 latency of a request, batched ÷ one at a time. Both servers generate
the very same tokens (the same seeds; a batched row is its request alone), so the ratio is
batching's alone.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.bench_generate import make_export
from bench.common import Metric
from dsgpt2.collective import free_port

CLIENTS = 8
REQUESTS = 4  # per client
TOKENS = 64
ROOT = Path(__file__).resolve().parent.parent


def _start(model: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsgpt2", "serve", "--model", str(model), "--port", str(port),
         "--max_batch", str(max_batch), "--max_concurrent", str(2 * CLIENTS),
         "--max_tokens_limit", str(TOKENS)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server (--max_batch {max_batch}) did not start")
        time.sleep(0.3)


def _load(url: str) -> tuple[float, list[float], int]:
    """(wall seconds, latency of each request, completion tokens) for the clients' requests."""
    import httpx

    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(timeout=300) as http:
            for r in range(REQUESTS):
                body = {"prompt": "Return a new list", "max_tokens": TOKENS, "seed": c * 100 + r}
                start = time.perf_counter()
                answer = http.post(f"{url}/v1/completions", json=body)
                answer.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - start)
                    tokens[0] += answer.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, latencies, tokens[0]


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def serving(texts: list[str], results: Path) -> list[Metric]:
    model = make_export(texts, results)
    servers = {name: _start(model, batch) for name, batch in (("batched", CLIENTS), ("serial", 1))}
    try:
        for _, url in servers.values():
            _load(url)  # warm up: first requests, allocator
        runs = {name: _load(url) for name, (_, url) in servers.items()}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    (b_wall, b_lat, b_tok), (s_wall, s_lat, s_tok) = runs["batched"], runs["serial"]
    n = CLIENTS * REQUESTS
    note = f"{CLIENTS} clients x {REQUESTS} requests x {TOKENS} tokens"
    if b_tok != s_tok:
        note += f"; {b_tok} vs {s_tok} tokens"
    return [
        Metric("serving requests/s (batched ÷ one at a time)", n / b_wall, n / s_wall, "req/s", "> 1",
               s_wall > b_wall, note),
        Metric("serving p50 latency (batched ÷ one at a time)", statistics.median(b_lat),
               statistics.median(s_lat), "s", "< 1", statistics.median(b_lat) < statistics.median(s_lat)),
        Metric("serving p99 latency (batched ÷ one at a time)", _p99(b_lat), _p99(s_lat), "s", "< 1",
               _p99(b_lat) < _p99(s_lat)),
    ]  # fmt: skip
