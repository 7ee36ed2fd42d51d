"""Collectives the run needs besides DeepSpeed's: one rank decides, every rank follows.

Each is a no-op in a single process without a process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dsgpt2.checkpoints import format as checkpoint
from dsgpt2.errors import DsGpt2Error


def broadcast(values: list[Any]) -> None:
    """Give every rank rank 0's ``values`` (in place); nothing to do in a single process."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(values, src=0)


def raise_shared(error: tuple[str, str] | None) -> None:
    """Raise on every rank the user error rank 0 met (same class where it is one of ours)."""
    if error is None:
        return
    import dsgpt2.errors as errors

    kind = getattr(errors, error[0], None) or getattr(checkpoint, error[0], None) or DsGpt2Error
    raise kind(error[1])


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` computed on rank 0 and given to every rank; a user error there is raised on all."""
    import torch.distributed as dist

    shared: list[Any] = [None, None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            shared[1] = fn()
        except DsGpt2Error as exc:
            shared[0] = (type(exc).__name__, str(exc))
    broadcast(shared)
    raise_shared(shared[0])
    return shared[1]


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def all_sum(values: list[int], device: Any) -> list[int]:
    """Each of ``values`` summed over every rank (``device``: where the backend reduces)."""
    import torch
    import torch.distributed as dist

    counts = torch.tensor(values, dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.to(device)
        dist.all_reduce(counts)
    return counts.tolist()
