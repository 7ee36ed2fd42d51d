"""The read side of the reading orders on a MongoDB wire server: what one training chunk costs it.

Needs ``secantusd-py`` (SecantusDB, MongoDB's wire protocol on WiredTiger; ``pip install secantusdb``
in any environment, named by ``DSGPT2_SECANTUSD``, beside this Python or on PATH); skipped with a line
otherwise.
The server is the one ``local://`` starts (``embedded.server_command``: SecantusDB through dsgpt2's entry
point, which matches an ``$in`` by set lookups). The sample corpus is stored with its unique ``idx``
index; a chunk of the spread order (1,000 idx drawn from all over the collection) and of the ranges order
(one range of 1,000) are asked with the trainer's projection, ``explain``'s executionStats counted, and
timed side by side as the trainer reads them (``MongoWrapper.get_many``: one ``$in`` of the chunk, as on
mongod, and ``get_range``), and the spread chunk as stock SecantusDB gets it (``$in`` lists of
``EMBEDDED_IN_LIST``: its ``$in`` compares each document with every value of the list). A local server's
timings are no deployment's: only their ratios are reported.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

from bench.common import Metric

CHUNK = 1000


def _server() -> tuple[subprocess.Popen, int, str] | None:
    from dsgpt2.db import embedded
    from dsgpt2.errors import ConfigError

    try:
        binary = embedded.server_command()
    except ConfigError:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tempfile.mkdtemp(prefix="bench-reads-")
    proc = subprocess.Popen([*binary, "--port", str(port), "--storage-path", data],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return proc, port, data


def read_cost(texts: list[str], repeats: int = 7) -> list[Metric]:
    import pymongo

    from dsgpt2.data.order import ReadOrder
    from dsgpt2.data.table import ChunkTable
    from dsgpt2.db.client import EMBEDDED_IN_LIST
    from dsgpt2.db.config import config_from_dict
    from dsgpt2.db.wrapper import MongoWrapper

    started = _server()
    if started is None:
        print("   reads: no secantusd-py (pip install secantusdb; DSGPT2_SECANTUSD=...): skipped", flush=True)
        return []
    proc, port, data = started
    try:
        client = pymongo.MongoClient(f"mongodb://127.0.0.1:{port}", serverSelectionTimeoutMS=20000)
        coll = client.bench.reads
        coll.drop()
        coll.insert_many([{"idx": i, "filt_text": t} for i, t in enumerate(texts)])
        coll.create_index("idx", unique=True)
        table = ChunkTable.initial(["reads"], [len(texts)], CHUNK)
        spread = ReadOrder(table, [(0,)], 0, "spread").documents(0, 1)[1]
        queries = {
            "spread": {"idx": {"$in": sorted(spread.tolist())}},
            "ranges": {"idx": {"$gte": CHUNK, "$lt": 2 * CHUNK}},
        }
        projection = {"_id": 0, "idx": 1, "filt_text": 1}
        stats: dict[str, dict[str, Any]] = {}
        for name, q in queries.items():
            s = coll.find(q, projection).explain()["executionStats"]
            stats[name] = {k: int(s[k]) for k in ("nReturned", "totalKeysExamined", "totalDocsExamined")}
        uri = f"mongodb://127.0.0.1:{port}"
        config = config_from_dict(
            {"MONGO_CONNECTION_STRING": uri, "MONGO_CONNECTION_DB": "bench", "COLLECTIONS": ["reads"]}, env={}
        )
        wrapper = MongoWrapper(config, counts=[len(texts)])
        chunk = spread.tolist()

        def as_read(name: str) -> int:
            got = wrapper.get_many(chunk) if name == "spread" else wrapper.get_range(CHUNK, 2 * CHUNK)
            return len(got)

        ordered = sorted(chunk)

        def short_lists(name: str) -> int:
            lists = [ordered[i : i + EMBEDDED_IN_LIST] for i in range(0, len(ordered), EMBEDDED_IN_LIST)]
            return sum(
                len(list(coll.find({"idx": {"$in": k}}, projection).batch_size(len(k) + 1))) for k in lists
            )

        times: dict[str, list[float]] = {name: [] for name in ("spread", "ranges", "short lists")}
        for _ in range(repeats):
            for name, read in (("spread", as_read), ("ranges", as_read), ("short lists", short_lists)):
                t = time.perf_counter()
                n = read(name)
                times[name].append(time.perf_counter() - t)
                if n != stats["spread" if name == "short lists" else name]["nReturned"]:
                    raise RuntimeError(f"{name}: {n} documents, explain said {stats}")
        before = wrapper.total_queries
        as_read("spread")
        queries_spread = wrapper.total_queries - before
        wrapper.connection.close()
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    keys = {name: s["totalKeysExamined"] / s["nReturned"] for name, s in stats.items()}
    where = f"SecantusDB (WiredTiger), {len(texts)} documents, one chunk of {CHUNK}; a local server"
    print(f"   reads explain: {stats}", flush=True)
    return [
        Metric("reads: documents per command, spread (÷ ranges)", stats["spread"]["nReturned"],
               stats["ranges"]["nReturned"], "docs", ">= 0.9", stats["spread"]["nReturned"] >= 0.9 * CHUNK,
               f"{where}; a spread chunk holds its pool's documents ÷ its chunks"),
        Metric("reads: index keys examined per document, spread (÷ ranges)", keys["spread"], keys["ranges"],
               "keys/doc", "<= 2", keys["spread"] <= 2, "explain executionStats"),
        Metric("reads: seconds per chunk, spread (÷ ranges)", med["spread"], med["ranges"], "s", "<= 2",
               med["spread"] <= 2 * med["ranges"],
               f"median of {repeats}, as the trainer reads: {queries_spread} $in query a chunk; {where}"),
        Metric(f"reads: seconds per chunk, spread in $in lists of {EMBEDDED_IN_LIST} (÷ ranges)",
               med["short lists"], med["ranges"], "s", "info", bool(np.isfinite(med["short lists"])),
               "stock SecantusDB's shape: its $in costs the square of the list's length"),
    ]  # fmt: skip
