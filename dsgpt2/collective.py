"""Collectives the run needs besides DeepSpeed's: one rank decides, every rank follows; and what a
rank does when the others are gone.

Each collective is a no-op in a single process without a process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable
from typing import Any

from dsgpt2.errors import ConfigError, DsGpt2Error, PeerLostError


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

    kind = getattr(errors, error[0], None) or DsGpt2Error
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


def on_each_node(fn: Callable[[], Any]) -> None:
    """``fn()`` run by the first rank of each node (a node's disk is its own), the others waiting; a user
    error there is raised on every rank."""
    error = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            fn()
        except DsGpt2Error as exc:
            error = (type(exc).__name__, str(exc))
    raise_shared(next((e for e in gather(error) if e is not None), None))


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


class Rounds:
    """Ranks that wait while others work alone (a cache build, hours on a large corpus) stay in
    touch: a working rank calls :meth:`tick` between pieces of work, every rank calls
    :meth:`finish` with its outcome. Each is a round of one small collective, so a worker that dies
    or freezes is noticed within the process group's timeout, whatever the length of the work.

    Args:
        every: the least number of seconds between a working rank's rounds.
    """

    _WORKING = "working"

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self._last = time.monotonic()

    def tick(self) -> None:
        """A round, if ``every`` seconds have passed since this rank's last one."""
        if time.monotonic() - self._last >= self.every:
            gather(self._WORKING)
            self._last = time.monotonic()

    def finish(self, outcome: Any) -> list[Any]:
        """Rounds until every rank has finished; returns every rank's ``outcome``, in rank order."""
        while True:
            outcomes = gather(("done", outcome))
            if all(o != self._WORKING for o in outcomes):
                return [o[1] for o in outcomes]


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def every_group_times_out_after(seconds: int) -> None:
    """Make ``seconds`` the timeout of every process group made from now on without one of its own: the
    groups DeepSpeed makes for ZeRO 1-3 (its data-parallel group) would otherwise take torch's default,
    30 minutes, and a rank frozen under them would hold the others that long, not --dist_timeout."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    # Read by new_group() at each call: gloo's, and NCCL's where torch has NCCL.
    c10d.default_pg_timeout = timedelta(seconds=seconds)
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)


def same_on_every_rank(
    settings: dict[str, Any], deepspeed: dict[str, Any], *, corpus: dict[str, Any], tokenizer: str
) -> None:
    """Refuse a run whose ranks were started with different settings (by flag name), DeepSpeed configs (by
    section), corpora (the connection config's keys that decide what is read) or tokenizers: the nodes'
    commands or files differ, and the ranks would train apart (each on its own documents and token ids)
    or wait for one another until --dist_timeout. Every rank raises the same error.

    Args:
        settings: the run's options by flag name (without the paths, which may differ between nodes).
        deepspeed: the DeepSpeed config, by section.
        corpus: the connection config's keys that decide what is read (MongoConfig.corpus_keys).
        tokenizer: the hash of the tokenizer this rank reads.

    Raises:
        ConfigError: naming the first setting that differs and the ranks on each side.
    """
    mine = {
        **{f"--{k}": v for k, v in settings.items()},
        **{f"the DeepSpeed config's {k!r}": v for k, v in deepspeed.items()},
        **{f"the connection config's {k}": v for k, v in corpus.items()},
        "the tokenizer (the SHA-256 of --vocab_dir's tokenizer.json)": tokenizer,
    }
    every = gather(mine)
    for name in sorted({name for ranks in every for name in ranks}):
        values = [ranks.get(name) for ranks in every]
        if any(v != values[0] for v in values):
            apart = [r for r, v in enumerate(values) if v != values[0]]
            raise ConfigError(
                f"the ranks were started with different settings: {name} is {values[0]!r} on rank 0 and "
                f"{values[apart[0]]!r} on rank(s) {', '.join(map(str, apart))}; start every node with the "
                "same command and files"
            )


# What gloo (and NCCL) say when a peer's process or node is gone, and when one stops answering.
_CLOSED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
_TIMED_OUT = ("Timed out", "timed out", "collective operation timeout")


def peer_lost(exc: BaseException, timeout: int, where: str, kept: str | None) -> PeerLostError | None:
    """The one-line error for a collective that failed because another rank died or froze; None
    when ``exc`` is something else (a bug keeps its traceback).

    Args:
        exc: what the collective raised.
        timeout: --dist_timeout, in seconds.
        where: when it happened ("start-up", "step 12").
        kept: the run's last whole checkpoint, as a user names it (None: none yet).
    """
    import torch.distributed as dist

    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    if "waiting for clients" in text:
        joined = re.search(r"(\d+)/(\d+) clients joined", text)
        what = (f"only {joined[1]} of {joined[2]} ranks" if joined else "not every rank") + (
            f" joined the run within --dist_timeout {timeout} s: a node did not start or cannot reach "
            "--master_addr"
        )
    elif any(s in text for s in _CLOSED):
        peer = re.search(r"\[([^\]]+)\]:(\d+)", text)
        what = "a rank or node of the run died (" + (
            f"its connection from {peer[1]}:{peer[2]} closed)" if peer else "its connection closed)"
        )
    elif "trying to connect" in text:
        what = f"the run's first node (--master_addr) did not answer within --dist_timeout {timeout} s"
    elif any(s in text for s in _TIMED_OUT):
        what = f"another rank or node stopped answering for --dist_timeout {timeout} s"
    elif isinstance(exc, dist.DistError):
        what = f"the process group failed ({text.strip().splitlines()[-1][:200]})"
    else:
        return None
    rank = f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"
    if dist.is_initialized():
        # Left for the interpreter's exit, a group that lost a peer may abort the process there.
        # Already on the way out: the first error is the one to tell.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    said = f"the last whole checkpoint, {kept}, is kept" if kept else "no checkpoint yet"
    return PeerLostError(
        f"{rank} stops at {where}: {what}; {said}: run the same command on every node again"
        + (" to resume" if kept else "")
    )


def leave_process_group() -> None:
    """A run's normal end: every rank done with every collective, then the group closed, rather
    than left to the interpreter's exit (where NCCL warns of it and gloo may abort the process)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def release_shared_buffer(device: str = "cpu") -> bool:
    """Unlink this rank's name of DeepSpeed's CPU allreduce buffer once every rank has mapped it.

    On CPU with all ranks on one machine, DeepSpeed's allreduce keeps a 66 MB buffer per rank in
    /dev/shm, named after MASTER_ADDR, MASTER_PORT and the rank, and never removes it: each run
    (killed or not) would leave it in RAM until the machine restarts. The ranks map each other's
    buffers while the process group starts; after a barrier the names are no longer needed, and
    the memory goes back when the last rank exits, however it exits. Return whether one was removed.
    """
    env = os.environ
    if device != "cpu" or env.get("LOCAL_SIZE") != env.get("WORLD_SIZE"):
        return False  # DeepSpeed's CPU accelerator only, and (its test) only when all ranks are local
    barrier()  # every rank, or none: each decides from the same two variables
    addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    path = SHM_BUFFER.format(uid=os.getuid(), addr=addr, port=port, rank=env.get("RANK", "0"))
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
