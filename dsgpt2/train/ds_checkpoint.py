"""Checkpoints: DeepSpeed's save/load, made safe to crash in and exact to resume from.

A checkpoint is marked complete only after every rank has saved (see :mod:`dsgpt2.checkpoints.format`
for the format and how it is read and verified). A crash during a save therefore leaves ``latest``
naming the previous complete checkpoint, and a complete checkpoint is never written again.
``client_state`` carries the training state (step, data position, RNG states, config, data fingerprint).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsgpt2.checkpoints.format import (
    BEST,
    COMPLETE,
    LATEST,
    UNIVERSAL,
    best_tag,
    complete_tags,
    damage,
    file_digests,
    tag_for,
)
from dsgpt2.errors import CheckpointError
from dsgpt2.files import atomic_write_text
from dsgpt2.train import universal

log = logging.getLogger(__name__)


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


class QueuedWrites:
    """DeepSpeed's checkpoint engine ``inner`` with its writes moved to a thread: :meth:`save` copies the
    state's tensors (the next steps may then change the originals) and queues the file, so that a save
    holds the training step only while the tensors are copied; :meth:`wait` returns once every queued
    file is written, or raises what failed. A file is written beside its name and renamed into place:
    one there is whole. Everything else is ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._inner = inner
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint write")
        self._pending: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @classmethod
    def install(cls, engine: Any) -> QueuedWrites | None:
        """The DeepSpeed ``engine``'s checkpoint engine, made one that queues its writes (once); None where
        the DeepSpeed config chose another engine than torch.save's (its own writer, left as it is)."""
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        current = engine.checkpoint_engine
        if isinstance(current, cls):
            return current
        if type(current) is not TorchCheckpointEngine:
            return None
        engine.checkpoint_engine = cls(current)
        return engine.checkpoint_engine

    def preserves_storage_sharing(self) -> bool:
        return False  # save() copies each tensor alone: DeepSpeed need not clone views first

    def save(self, state_dict: Any, path: str) -> None:
        self._pending.append(self._pool.submit(self._write, _copied(state_dict), path))

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for write in pending:
            write.result()

    def _write(self, state: Any, path: str) -> None:
        part = f"{path}.part"
        self._inner.save(state, part)
        Path(part).replace(path)


def _copied(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU and every container new."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        out = copy.copy(value)  # its own type and settings (a defaultdict's factory)
        for k, v in value.items():
            out[k] = _copied(v)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_copied(v) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    return copy.deepcopy(value)


def save(
    engine: Any,
    ckpt_dir: Path,
    step: int,
    client_state: dict[str, Any],
    *,
    keep_last: int,
    files: dict[str, str] | None = None,
    queued: bool = False,
) -> str:
    """Save a checkpoint of every rank, then mark it complete and point ``latest`` at it.

    ``files``: text files (name → content) saved beside the states, covered by the marker's digests.
    ``queued``: the states' files are written by the engine's :class:`QueuedWrites` while training goes
    on, and the caller marks the checkpoint complete once they are (:func:`complete`).

    A complete, intact checkpoint of this step is never written again (``latest`` may name it, and
    a resumed run reaches the same state); a damaged or partial one is replaced.
    """
    import torch.distributed as dist

    tag = tag_for(step)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    verdict = [damage(ckpt_dir, tag) is None if engine.global_rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        log.info("%s is already saved and intact; kept as it is", ckpt_dir / tag)
        return tag
    if engine.global_rank == 0 and (ckpt_dir / tag).exists():
        shutil.rmtree(ckpt_dir / tag)
    if distributed:
        dist.barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
    if distributed:
        dist.barrier()
    if engine.global_rank == 0:
        for name, text in (files or {}).items():
            atomic_write_text(ckpt_dir / tag / name, text)
        if not queued:
            marker = {"step": step, "time": time.time(), "files": file_digests(ckpt_dir / tag)}
            complete(ckpt_dir, tag, marker, keep_last)
    if distributed and not queued:
        dist.barrier()
    return tag


def complete(ckpt_dir: Path, tag: str, marker: dict[str, Any], keep_last: int) -> None:
    """Mark the saved ``tag`` complete (``marker``: its step and files' digests), point ``latest`` at it,
    and prune what ``keep_last`` leaves behind (rank 0, once every rank's files are written)."""
    atomic_write_text(ckpt_dir / tag / COMPLETE, json.dumps(marker, indent=1) + "\n")
    atomic_write_text(ckpt_dir / LATEST, tag)
    _prune(ckpt_dir, keep_last, keep=tag)


def mark_best(ckpt_dir: Path, tag: str) -> None:
    """Name ``tag`` (complete) the run's best checkpoint: ``ckpt_dir/best``, replaced atomically."""
    atomic_write_text(ckpt_dir / BEST, tag)


def _prune(ckpt_dir: Path, keep_last: int, keep: str) -> None:
    """Remove all but the ``keep_last`` newest complete checkpoints (unreadable markers are left
    alone, the one ``best`` names is kept)."""
    if keep_last <= 0:
        return
    best = best_tag(ckpt_dir)
    for old in complete_tags(ckpt_dir)[:-keep_last]:
        if old not in (keep, best):
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
            shutil.rmtree(ckpt_dir / (old + UNIVERSAL), ignore_errors=True)  # its universal form, if made
            log.info("removed old checkpoint %s (keeping the last %d)", old, keep_last)


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
    if tag.endswith(UNIVERSAL):
        universal.restore_muon_momentum(engine.optimizer, load_dir / tag)
    return client_state
