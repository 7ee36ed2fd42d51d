"""Ingest throughput: the reading side (parse + clean, no database) of Parquet and JSONL on
FineWeb-sized documents (~3 KB) against pyarrow / json reading alone, and ingest into the
embedded server (SecantusDB) against a raw ``insert_many`` of the same prepared documents."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from bench.common import Metric

DOC_CHARS = 3000
READ_DOCS = 8000
WIRE_DOCS = 1000
WIRE_BATCH = 1000  # ingest's default batch
REPEATS = 3
PER_CORE = 10_000  # documents/s: the reading side's target, one process


def _documents(texts: list[str], n: int) -> list[str]:
    """``n`` documents of about DOC_CHARS characters cut from the sample's text (cycled)."""
    joined = "\n\n".join(texts)
    out, pos = [], 0
    while len(out) < n:
        if pos + DOC_CHARS > len(joined):
            pos = 0
        cut = joined.find(" ", pos + DOC_CHARS)
        cut = cut if cut != -1 else pos + DOC_CHARS
        out.append(joined[pos:cut])
        pos = cut + 1
    return out


def _files(texts: list[str], base: Path) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _documents(texts, READ_DOCS)
    n = len(docs)
    columns = {
        "text": docs,
        "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in range(n)],
        "language_score": [0.9] * n,
    }
    base.mkdir(parents=True, exist_ok=True)
    parquet = base / "fineweb.parquet"
    pq.write_table(pa.table(columns), parquet, row_group_size=1000)
    jsonl = base / "fineweb.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({k: v[i] for k, v in columns.items()}) + "\n")
    return parquet, jsonl


def _rate(fn, n: int) -> float:
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return n / statistics.median(times)


def reading(texts: list[str], base: Path) -> list[Metric]:
    import pyarrow.parquet as pq

    from dsgpt2.corpus.formats import file_source

    parquet, jsonl = _files(texts, base)
    keep = ("id", "url", "dump", "language_score")

    def ours(path: Path) -> None:
        for record in file_source(path, keep_fields=keep).read():
            record.document()

    def arrow_alone() -> None:
        for batch in pq.ParquetFile(parquet).iter_batches(batch_size=1024, columns=["text", *keep]):
            batch.to_pylist()

    def json_alone() -> None:
        with open(jsonl, encoding="utf-8") as f:
            for line in f:
                json.loads(line)

    metrics = []
    for name, path, anchor, alone in (
        ("parquet", parquet, arrow_alone, "pyarrow"),
        ("jsonl", jsonl, json_alone, "json"),
    ):
        ours_rate = _rate(lambda p=path: ours(p), READ_DOCS)
        anchor_rate = _rate(anchor, READ_DOCS)
        metrics.append(Metric(
            f"ingest read {name}: parse + clean (~3 KB docs)", ours_rate, anchor_rate, "docs/s",
            f">= {PER_CORE}/s", ours_rate >= PER_CORE,
            f"one process; anchor: {alone} reading alone; 4 kept fields",
        ))  # fmt: skip
    return metrics


def wire(texts: list[str], base: Path) -> list[Metric]:
    from tests.wire_server import WireServer, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"   (no server ingest line: {reason})")
        return []
    from dsgpt2.corpus.formats import file_source
    from dsgpt2.corpus.ingest import ingest
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import ENV_URI, load_config, redact_uri

    docs = _documents(texts, WIRE_DOCS)
    path = base / "wire.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    server = WireServer(base / "wire-db").start()
    try:
        uri = server.uri()
        config = base / "wire.json"
        settings = {"MONGO_CONNECTION_STRING": redact_uri(uri), "MONGO_CONNECTION_DB": "ingest_bench"}
        config.write_text(json.dumps({**settings, "COLLECTIONS": ["ours"]}))
        conn = Connection(load_config(config, env={**os.environ, ENV_URI: uri}))
        ours_t, raw_t = [], []
        for i in range(REPEATS):
            conn.db[f"ours{i}"].drop()
            conn.db["meta_info"].delete_many({})
            t = time.perf_counter()
            ingest(conn, f"ours{i}", [file_source(path)], batch_size=WIRE_BATCH)
            ours_t.append(time.perf_counter() - t)
            prepared = list(conn.db[f"ours{i}"].find({}, {"_id": 0}, sort=[("idx", 1)]))
            raw = conn.db[f"raw{i}"]
            raw.drop()
            t = time.perf_counter()
            raw.create_index("idx", unique=True)
            for start in range(0, len(prepared), WIRE_BATCH):
                raw.insert_many([dict(d) for d in prepared[start : start + WIRE_BATCH]], ordered=True)
            raw_t.append(time.perf_counter() - t)
            conn.db[f"ours{i}"].drop()
            raw.drop()
        conn.close()
    finally:
        server.kill()
    ours_rate, raw_rate = WIRE_DOCS / statistics.median(ours_t), WIRE_DOCS / statistics.median(raw_t)
    note = "anchor: raw insert_many of the same prepared documents; SecantusDB on this machine, not MongoDB"
    return [Metric("ingest into the embedded server (jsonl, ~3 KB docs)", ours_rate, raw_rate, "docs/s",
                   ">= 0.8", ours_rate >= 0.8 * raw_rate, note)]  # fmt: skip


def ingest_bench(texts: list[str], results: Path) -> list[Metric]:
    base = results / "ingest"
    return reading(texts, base) + wire(texts, base)
