"""Checkpoints: DeepSpeed's save/load, made safe to crash in and exact to resume from.

``ckpt_dir/TAG/`` holds DeepSpeed's files plus ``dsgpt2_complete.json``,
written only after every rank has finished saving; ``ckpt_dir/latest`` is
then replaced atomically. A crash during a save therefore leaves ``latest``
naming the previous complete checkpoint. ``client_state`` carries the
training state (step, data position, RNG states, config, data fingerprint).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsgpt2.errors import DsGpt2Error

log = logging.getLogger(__name__)

LATEST = "latest"
COMPLETE = "dsgpt2_complete.json"
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")


class CheckpointError(DsGpt2Error):
    """A checkpoint to resume from is missing, incomplete or does not match this run."""


def tag_for(step: int) -> str:
    return f"global_step{step}"


def rng_state() -> dict[str, Any]:
    """Every random state a training step reads."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_complete(ckpt_dir: Path, tag: str) -> bool:
    return (ckpt_dir / tag / COMPLETE).is_file()


def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep_last: int) -> str:
    """Save a checkpoint of every rank, then mark it complete and point ``latest`` at it."""
    import torch.distributed as dist

    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    if dist.is_initialized():
        dist.barrier()
    if engine.global_rank == 0:
        (ckpt_dir / tag / COMPLETE).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
        _atomic_write(ckpt_dir / LATEST, tag)
        _prune(ckpt_dir, keep_last, keep=tag)
    if dist.is_initialized():
        dist.barrier()
    return tag


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    if keep_last <= 0:
        return
    tags = sorted(
        (p.name for p in ckpt_dir.iterdir() if p.is_dir() and is_complete(ckpt_dir, p.name)),
        key=lambda t: json.loads((ckpt_dir / t / COMPLETE).read_text())["step"],
    )
    for old in tags[:-keep_last]:
        if old != keep:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
            log.info("removed old checkpoint %s (keeping the last %d)", old, keep_last)


def resolve(load_dir: Path, ckpt_id: str | None) -> str:
    """The tag to resume from: ``ckpt_id``, or the one ``latest`` names.

    Raises:
        CheckpointError: no checkpoint there, ``latest`` unreadable or naming a missing or
            incomplete checkpoint.
    """
    if ckpt_id:
        if not is_complete(load_dir, ckpt_id):
            present = sorted(p.name for p in load_dir.glob("*") if p.is_dir()) if load_dir.is_dir() else []
            raise CheckpointError(
                f"--ckpt_id {ckpt_id!r}: no complete checkpoint {load_dir / ckpt_id}; "
                f"checkpoints there: {present or 'none'}"
            )
        return ckpt_id
    latest = load_dir / LATEST
    if not latest.is_file():
        raise CheckpointError(
            f"no checkpoint to resume from in {load_dir} (no `latest` file); pass the directory a run "
            "saved to with --load_dir, name one with --ckpt_id, or start fresh without --load_dir"
        )
    tag = latest.read_text().strip()
    if not tag or not _TAG.match(tag):
        raise CheckpointError(
            f"{latest} is empty or corrupt ({tag[:40]!r}); name the checkpoint to resume with --ckpt_id"
        )
    if not is_complete(load_dir, tag):
        raise CheckpointError(
            f"{latest} names {tag!r}, which is missing or incomplete in {load_dir}; "
            "name another checkpoint with --ckpt_id"
        )
    return tag


def read_client_state(load_dir: Path, tag: str) -> dict[str, Any]:
    """dsgpt2's training state in a checkpoint, read without building an engine.

    Lets a run check the checkpoint's fingerprint before loading weights that may not fit.
    """
    path = load_dir / tag / "mp_rank_00_model_states.pt"
    blob = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if "dsgpt2" not in blob:
        raise CheckpointError(f"{load_dir / tag} was not written by dsgpt2 (no training state in it)")
    return blob["dsgpt2"]


def load(engine: Any, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler state; return the client state."""
    try:
        path, client_state = engine.load_checkpoint(
            str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise CheckpointError(
            f"{load_dir / tag} does not fit this model ({first}); resume with the model and tokenizer "
            "it was trained with"
        ) from None
    if path is None or client_state is None:
        raise CheckpointError(f"DeepSpeed could not load {load_dir / tag}")
    return client_state
