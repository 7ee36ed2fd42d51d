"""Checkpoints: DeepSpeed's save and load, and the writes of a save moved off the training step.

A checkpoint is marked complete only after every rank has saved (:mod:`dsgpt2.checkpoints.publisher`; see
:mod:`dsgpt2.checkpoints.format` for the format and how it is read and verified). A crash during a save
therefore leaves ``latest`` naming the previous complete checkpoint. ``client_state`` carries the
training state (step, data position, RNG states, config, data fingerprint).
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsgpt2.checkpoints import universal
from dsgpt2.checkpoints.format import (
    COMPLETE,
    LATEST,
    UNIVERSAL,
)
from dsgpt2.errors import CheckpointError
from dsgpt2.files import atomic_write_text

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

        current = getattr(engine, "checkpoint_engine", None)
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


def write(engine: Any, local: Path, tag: str, client_state: dict[str, Any], files: dict[str, str]) -> None:
    """Write the states of every rank of ``engine`` as ``local/tag`` (``files``: text files, name →
    content, written beside them by rank 0); marking it whole is the caller's
    (:class:`dsgpt2.checkpoints.publisher.Publisher`). With :class:`QueuedWrites` installed, the states' files
    are still being written when this returns."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        dist.barrier()  # what an earlier attempt left of the tag is gone (rank 0)
    engine.save_checkpoint(str(local), tag=tag, client_state=client_state, save_latest=False)
    if engine.global_rank == 0:
        for name, text in files.items():
            atomic_write_text(local / tag / name, text)


def complete(ckpt_dir: Path, tag: str, marker: dict[str, Any]) -> None:
    """Mark ``tag`` of the directory ``ckpt_dir`` whole (``marker``: its step and files' digests) and
    point ``latest`` at it."""
    atomic_write_text(ckpt_dir / tag / COMPLETE, json.dumps(marker, indent=1) + "\n")
    atomic_write_text(ckpt_dir / LATEST, tag)


# What a group of the optimizer holds that is not a setting of the run: its weights, its rate (the
# schedule's, restored with it) and a step count kept there; and its momentum where the schedule warms
# it up (its peak, ``momentum_peak``, is the setting).
_NOT_SETTINGS = frozenset({"params", "lr", "initial_lr", "step"})


def group_settings(optimizer: Any) -> list[dict[str, Any]]:
    """The settings of each group of ``optimizer`` (momentum, betas, weight decay...)."""
    return [
        {k: v for k, v in group.items()
         if k not in _NOT_SETTINGS and not (k == "momentum" and group.get("momentum_warmup"))}
        for group in optimizer.param_groups
    ]  # fmt: skip


def keep_settings(optimizer: Any, settings: list[dict[str, Any]]) -> list[str]:
    """Put ``settings`` (:func:`group_settings` of the optimizer as this run built it) back over those a
    checkpoint's optimizer state brought: the run trains with the settings it was given. Returns the
    names of those that differed."""
    changed: dict[str, None] = {}
    if len(settings) != len(optimizer.param_groups):
        return []
    for group, own in zip(optimizer.param_groups, settings, strict=True):
        for key, value in own.items():
            if key in group and group[key] != value:
                changed[key.removesuffix("_peak")] = None  # momentum_peak: the momentum
            group[key] = value
    return list(changed)


def load(engine: Any, load_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler state, the optimizer's settings kept as this run built them;
    return the client state."""
    optimizer = getattr(engine, "optimizer", None)  # none where the engine was built to infer
    built = group_settings(optimizer) if optimizer is not None else None
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
        universal.restore_whole_states(engine.optimizer, load_dir / tag)
    if built is not None and (changed := keep_settings(optimizer, built)):
        log.info("the optimizer's %s: this run's, not the checkpoint's", ", ".join(changed))
    scheduler = getattr(engine, "lr_scheduler", None)
    if hasattr(scheduler, "apply"):  # dsgpt2's schedule: its rates from this run's settings, from this step
        scheduler.apply()
    return client_state
