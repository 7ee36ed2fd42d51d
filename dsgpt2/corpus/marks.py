"""High-water marks: how far each collection is complete, and whether a trained prefix still holds.

A collection's mark is the count meta_info records; ingest raises it after each inserted batch,
so ``[0, mark)`` is always complete and contiguous. A run trains on ``[0, mark)`` and may take in
what comes later; it must never find a prefix it trained on shorter or changed. Changing a
document in place is checked by sampling: a seeded handful of each trained prefix is hashed at
save time and again at resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsgpt2.corpus.draws import uniform
from dsgpt2.db.bulk import find_in
from dsgpt2.db.client import Connection
from dsgpt2.db.meta import read_meta, write_meta
from dsgpt2.db.wrapper import MongoWrapper
from dsgpt2.documents import ID, IDX

log = logging.getLogger(__name__)

SAMPLE = 16  # documents hashed per collection


def read_marks(conn: Connection) -> tuple[int, ...]:
    """The marks of the configured collections, in config order (one query)."""
    return MongoWrapper(conn.config, connection=conn).counts


def prefix_sample(mark: int, seed: int, k: int = SAMPLE) -> list[int]:
    """``k`` idx of ``[0, mark)``, drawn from ``seed``, always holding the first and the last."""
    if mark <= 0:
        return []
    picks = (uniform(np.arange(k), seed, salt="sample") * mark).astype(np.int64).tolist()
    return sorted({0, mark - 1, *picks})


def prefix_digest(conn: Connection, name: str, idxs: Sequence[int]) -> str:
    """A hash of the documents ``idxs`` of ``name`` as they are now (a missing one counts too)."""
    field = conn.config.text_field
    docs = find_in(conn, name, IDX, list(idxs), fields={ID: 0, IDX: 1, field: 1}, what=f"reading {name}")
    by_idx = {d.get("idx"): d.get(field) for d in docs}
    h = hashlib.sha256()
    for i in idxs:
        h.update(json.dumps([i, by_idx.get(i)], default=str).encode())
    return h.hexdigest()[:16]


def prefix_record(conn: Connection, marks: Sequence[int], seed: int) -> dict[str, Any]:
    """What a checkpoint keeps to check the trained prefixes later: per collection its mark, the
    sampled idx and their hash."""
    out = {}
    for name, mark in zip(conn.config.collections, marks, strict=True):
        idxs = prefix_sample(mark, seed)
        out[name] = {"mark": int(mark), "sample": idxs, "digest": prefix_digest(conn, name, idxs)}
    return out


def prefix_problems(conn: Connection, record: dict[str, Any], marks: Sequence[int]) -> list[str]:
    """How the corpus departs from a trained prefix (``record`` from :func:`prefix_record`): a
    collection now shorter than its mark, or a sampled document changed. Empty: it holds."""
    problems = []
    for name, mark in zip(conn.config.collections, marks, strict=True):
        saved = record.get(name)
        if saved is None:
            continue
        if mark < saved["mark"]:
            problems.append(f"{name} holds {mark} documents, fewer than the {saved['mark']} trained on")
        elif prefix_digest(conn, name, saved["sample"]) != saved["digest"]:
            problems.append(
                f"{name}: documents below idx {saved['mark']} (trained on) were changed or removed"
            )
    return problems


def record_trained(conn: Connection, marks: Sequence[int], run: str, step: int | None = None) -> None:
    """Note in meta_info how far a run has read each collection (its high-water mark), and the step of
    its last checkpoint (for ``dsgpt2 info``). A run that starts keeps the step its checkpoint
    directory reached before. Best effort: a user allowed only to read may train."""
    try:
        for name, mark in zip(conn.config.collections, marks, strict=True):
            fields: dict[str, Any] = {
                "trained.mark": int(mark),
                "trained.run": run,
                "trained.at": time.time(),
            }
            if step is not None:
                fields["trained.step"] = int(step)
            else:
                before = read_meta(conn, [name]).get(name, {}).get("trained") or {}
                if not isinstance(before, dict) or before.get("run") != run:
                    fields["trained.step"] = None  # another run's step is not this one's
            write_meta(conn, name, fields)
    except Exception as exc:
        log.debug("could not note the trained marks in meta_info: %s", conn.config.scrub(str(exc)))
