"""Document fetch and round trips: how the MongoWrapper reads the corpus.

- document fetch: docs/s of batched ``get_range`` ÷ docs/s of one ``find_one``
  per document on the same collection (target ≥ 20×);
- wrapper overhead: time of ``get_range`` ÷ the same range query issued
  directly on the collection (target ≤ 1.10);
- round trips: queries per 1,000 documents read on the training path
  (``iter_range``), per collection touched (target ≤ 2).

Measured against the embedded database (``local://``: SecantusDB over TCP, real
cursors, WiredTiger underneath; a server on this machine, not a MongoDB
deployment), and against DSGPT2_BENCH_MONGO_URI when set (a real MongoDB).
"""

from __future__ import annotations

import os
import uuid

from bench.common import Metric, database_uri, paired_times
from dsgpt2.db.client import Connection
from dsgpt2.db.config import config_from_dict
from dsgpt2.db.wrapper import MongoWrapper


def _setup(uri: str, texts: list[str], collections: int) -> tuple[Connection, MongoWrapper]:
    cfg = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": uri,
            "MONGO_CONNECTION_DB": f"dsgpt2_bench_{uuid.uuid4().hex[:8]}",
            "COLLECTIONS": [f"c{i}" for i in range(collections)],
        },
        env={},
    )
    conn = Connection(cfg)
    per = len(texts) // collections
    for i, name in enumerate(cfg.collections):
        coll = conn.db[name]
        coll.create_index("idx", unique=True)
        part = texts[i * per : (i + 1) * per]
        coll.insert_many([{"idx": j, "filt_text": t, "form": t} for j, t in enumerate(part)])
        conn.db[cfg.meta_collection].insert_one({"collection": name, "count": len(part)})
    return conn, MongoWrapper(cfg, connection=conn)


def run(texts: list[str], repeats: int = 5) -> list[Metric]:
    metrics = _run_on(
        database_uri(), texts[:4000], repeats, "local", "embedded server: TCP, real cursors, WiredTiger"
    )
    uri = os.environ.get("DSGPT2_BENCH_MONGO_URI")
    if uri:
        metrics += _run_on(uri, texts[:4000], repeats, "server", "DSGPT2_BENCH_MONGO_URI")
    return metrics


def _run_on(
    uri: str, texts: list[str], repeats: int, label: str, note: str, batch: int = 1000
) -> list[Metric]:
    conn, wrapper = _setup(uri, texts, collections=2)
    try:
        metrics = _measure(conn, wrapper, repeats, note, batch)
    finally:
        conn.client.drop_database(conn.config.db)
        conn.close()
    for m in metrics:
        m.name = f"{m.name} [{label}]"
    return metrics


def _measure(conn: Connection, wrapper: MongoWrapper, repeats: int, where: str, batch: int) -> list[Metric]:
    coll = conn.db["c0"]
    field = conn.config.text_field
    singles = 50  # find_one per document is slow: fewer documents, same docs/s figure

    def batched() -> None:
        assert len(wrapper.get_range(0, batch)) == batch

    def one_by_one() -> None:
        for i in range(singles):
            coll.find_one({"idx": i}, {"_id": 0, "idx": 1, field: 1})

    t_batched, t_single = paired_times(batched, one_by_one, repeats)
    fetch = Metric(
        "document fetch (batched ÷ find_one)",
        batch / t_batched,
        singles / t_single,
        "docs/s",
        ">= 20x",
        (batch / t_batched) / (singles / t_single) >= 20,
        where,
    )

    source = coll

    def direct() -> None:
        projection = {"_id": 0, "idx": 1, field: 1}
        docs = list(source.find({"idx": {"$gte": 0, "$lt": batch}}, projection).batch_size(batch))
        assert len(docs) == batch

    t_wrapper, t_direct = paired_times(batched, direct, repeats)
    overhead = Metric(
        "wrapper overhead (÷ direct find)",
        t_wrapper,
        t_direct,
        "s",
        "<= 1.10",
        t_wrapper / t_direct <= 1.10,
        where,
    )

    before = wrapper.total_queries
    touched = 0
    read = 0
    for chunk in wrapper.iter_range(0, len(wrapper), chunk=1000):  # the training path's chunk
        read += len(chunk)
        touched += len({wrapper.locate(d.index)[0] for d in chunk})
    queries = wrapper.total_queries - before
    per_1000 = queries / (read / 1000)
    per_touched = queries / touched
    trips = Metric(
        "round trips (queries per 1k docs)",
        per_1000,
        per_touched,
        "queries",
        "<= 2/coll",
        per_touched <= 2,
        f"anchor column = queries per collection touched per chunk; {read} docs",
    )
    return [fetch, overhead, trips]
