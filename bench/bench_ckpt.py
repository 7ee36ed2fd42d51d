"""Checkpoints to a file system and to the database (``ckpt``): a 112m model with AdamW's state.

The checkpoint is what a one-rank ZeRO 0 run of the 112m preset saves (DeepSpeed's
``mp_rank_00_model_states.pt``: the fp32 weights and both AdamW moments, torch.save's format), made
here from the model's own tensors rather than by training it. Timed:

- the file system: writing it (``torch.save``) and reading it back (``torch.load``) — the anchor;
- the database on ``local://`` (GridFS, :class:`dsgpt2.db.blobs.BlobStore`): the upload after the local
  write and the download (checked against its SHA-256) before the read, as a ``--ckpt_dir gridfs:RUN``
  run and its resume do;
- the step's stall for a save to the database: the part of a save the step waits for (the tensors
  copied by :class:`dsgpt2.checkpoints.ds_checkpoint.QueuedWrites`, the engine a ``gridfs:RUN`` run saves
  through; the write and the upload run in threads) against the whole save.

The local engine's times are not a MongoDB deployment's; the ratio says what the database adds here.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import Metric, database_uri


def _state() -> dict:
    import torch

    from dsgpt2.model.gpt2 import build_model, gpt2_config

    model = build_model(gpt2_config("112m", 50_304, 1024, 50_256, 50_256))
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    moments = {
        k: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for k, v in weights.items()
    }
    return {"module": weights, "optimizer": moments}


def ckpt(results: Path, repeats: int = 2) -> list[Metric]:
    import torch

    from dsgpt2.checkpoints.ds_checkpoint import QueuedWrites
    from dsgpt2.db.blobs import BlobStore
    from dsgpt2.db.client import Connection
    from dsgpt2.db.config import config_from_dict

    work = results / "ckpt"
    work.mkdir(parents=True, exist_ok=True)
    state = _state()
    path = work / "mp_rank_00_model_states.pt"
    config = config_from_dict(
        {
            "MONGO_CONNECTION_STRING": database_uri(),
            "MONGO_CONNECTION_DB": "bench_ckpt",
            "COLLECTIONS": ["s"],
        },
        env={},
    )
    store = BlobStore(Connection(config), "checkpoints")
    timings: dict[str, list[float]] = {
        k: [] for k in ("write", "read", "upload", "download", "stall", "whole")
    }
    for _ in range(repeats):
        start = time.perf_counter()
        torch.save(state, path)
        timings["write"].append(time.perf_counter() - start)
        start = time.perf_counter()
        store.put("bench/global_step1/mp_rank_00_model_states.pt", path)
        timings["upload"].append(time.perf_counter() - start)
        # A database save as a run makes it: the step waits for the copy; the write, then the upload, follow.
        writes = QueuedWrites(SimpleNamespace(save=torch.save))
        start = time.perf_counter()
        writes.save(state, str(path))
        timings["stall"].append(time.perf_counter() - start)
        writes.wait()
        store.put("bench/global_step1/mp_rank_00_model_states.pt", path)
        timings["whole"].append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=False)
        timings["read"].append(time.perf_counter() - start)
        start = time.perf_counter()
        store.get("bench/global_step1/mp_rank_00_model_states.pt", work / "down.pt")
        torch.load(work / "down.pt", map_location="cpu", weights_only=False)
        timings["download"].append(time.perf_counter() - start)
    size = path.stat().st_size
    store.delete("bench/")
    for f in (path, work / "down.pt"):
        f.unlink(missing_ok=True)
    best = {k: min(v) for k, v in timings.items()}
    mb = size / 1e6
    note = f"{mb:,.0f} MB: 112m fp32 weights and AdamW moments, local://"
    return [
        Metric(
            "ckpt save 112m: to the database / to disk",
            best["write"] + best["upload"],
            best["write"],
            "s",
            "report",
            True,
            note,
        ),
        Metric(
            "ckpt load 112m: from the database / from disk",
            best["download"] + best["read"],
            best["read"],
            "s",
            "report",
            True,
            note,
        ),
        Metric(
            "ckpt save to the database: step stall / whole save",
            best["stall"],
            best["whole"],
            "s",
            "<= 0.1",
            best["stall"] <= 0.1 * best["whole"],
            "the step waits for the tensors' copy; the write and the upload run in threads",
        ),
        Metric(
            "ckpt upload throughput (local://)",
            mb / best["upload"],
            mb / best["write"],
            "MB/s",
            "report",
            True,
            "anchor: the local disk write",
        ),
    ]
